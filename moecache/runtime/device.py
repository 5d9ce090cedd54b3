"""Streams, events and copies: the few device operations the runtime uses, behind one small interface.

`CudaDevice` maps them onto torch.cuda streams and events. `StandinDevice` runs the same state machine
on the CPU: slots are host tensors, and every operation is queued on a stand-in stream and executed in
stream order only when the test lets it run (`run`, or automatically before each layer visit), so a
test decides exactly which copies have completed when the manager queries their events.

Semantics shared by both (those of CUDA):
- operations on one stream execute in the order they were enqueued;
- `event.record(stream)` marks the point reached by `stream`; `event.query()` says whether the stream
  has executed everything before that point (an event never recorded counts as complete);
- `stream.wait_event(event)` holds back everything enqueued on `stream` afterwards until `event` completes;
- `copy(dst, src, stream)` enqueues `dst.copy_(src)` on `stream` (asynchronous from pinned host memory).

On CUDA the transfer engine's expert copies go straight to the driver's `cuMemcpyAsync` (`DriverCopies`,
`CudaDevice.driver`): torch's `copy_` inside the copy stream's context costs 6.3 us of host time per
expert copy on the H200 host (its dispatch and the stream context around the same driver call). Copies on the current stream (mapping-row uploads, which may be captured into a CUDA
graph) stay torch's.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from moecache.errors import MoecacheError

STANDIN_MODES = ("manual", "before_visit", "eager")


class Device:
    """Interface. `torch_device` is where slots and `slot_of_E` live."""

    name: str
    torch_device: torch.device
    is_cuda: bool = False

    def new_stream(self):
        raise NotImplementedError

    def compute_stream(self):
        """The stream the model's kernels run on (the one that reads the slots)."""
        raise NotImplementedError

    def new_event(self, timing: bool = False):
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Enqueue `dst.copy_(src)` on `stream`."""
        raise NotImplementedError

    def on_visit(self) -> bool:
        """Called by the cache manager before each layer visit (the stand-in may complete work here).
        True: everything enqueued so far has completed."""
        return False

    def launch(self, stream, op: Callable[[], object], *, after_copies: bool = False):
        """Run the compute operation `op` on `stream`, in that stream's order, and return its result.
        CUDA: `op` enqueues its kernels now (on the current stream, which is `stream`). The stand-in
        queues `op` on `stream` and runs that stream, or every stream (`after_copies`: the copies that
        `stream` waits for run first), so `op` reads what was enqueued before it."""
        return op()

    def drain(self, stream=None) -> None:
        """The stand-in: run what is queued on `stream` (None: every stream) now, as a GPU would by the
        time the host reads its results. CUDA: nothing (the GPU runs it on its own)."""

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor the device copies to and from: pinned on CUDA (asynchronous copies),
        plain on the stand-in."""
        return torch.zeros(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for (stand-in: execute) everything enqueued on every stream."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ CUDA


class CudaEvent:
    """A torch.cuda.Event with the interface the runtime uses; host time of record for the log."""

    def __init__(self, timing: bool):
        self.event = torch.cuda.Event(enable_timing=timing)
        self.timing = timing

    def record(self, stream) -> None:
        self.event.record(stream.stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_ns(self, start: CudaEvent) -> int | None:
        """Device time from `start` to this event (both timing events, recorded), else None. Waits for
        this event to complete (a timing read happens off the hot path: the logger's writer thread)."""
        if not (self.timing and start.timing):
            return None
        self.event.synchronize()
        return int(start.event.elapsed_time(self.event) * 1e6)


class CudaStream:
    """`current`: the stream was the current stream when wrapped (the compute stream), so work for it
    is enqueued without entering a stream context (which costs microseconds per entry)."""

    def __init__(self, stream: torch.cuda.Stream, current: bool = False):
        self.stream = stream
        self.current = current
        self.handle = stream.cuda_stream  # the raw cudaStream_t, for the driver's copies

    def wait_event(self, event: CudaEvent) -> None:
        self.stream.wait_event(event.event)


CUDA_ERROR_INVALID_CONTEXT = 201


class DriverCopies:
    """`cuMemcpyAsync` from libcuda (unified addressing: any direction between pinned host and device
    memory), the context torch made current on the thread that built it set on any other thread first.
    Every return code is checked: a failure raises, naming the code."""

    def __init__(self, lib: ctypes.CDLL):
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._set_current = lib.cuCtxSetCurrent
        self._set_current.argtypes = [ctypes.c_void_p]
        self._set_current.restype = ctypes.c_int
        get_current = lib.cuCtxGetCurrent
        get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        get_current.restype = ctypes.c_int
        ctx = ctypes.c_void_p()
        rc = get_current(ctypes.byref(ctx))
        if rc != 0 or not ctx.value:
            raise MoecacheError(f"runtime device cuda: cuCtxGetCurrent returned {rc} with no current context")
        self._ctx = ctx.value
        self._thread = threading.get_ident()

    @classmethod
    def load(cls) -> DriverCopies | None:
        """The driver's copies, or None where libcuda cannot be loaded (the caller keeps torch's)."""
        try:
            return cls(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int, stream_handle: int) -> None:
        rc = self._memcpy(dst_ptr, src_ptr, nbytes, stream_handle)
        if rc == CUDA_ERROR_INVALID_CONTEXT and threading.get_ident() != self._thread:
            self._set_current(self._ctx)  # a thread the runtime has not used yet
            rc = self._memcpy(dst_ptr, src_ptr, nbytes, stream_handle)
        if rc != 0:
            raise MoecacheError(
                f"runtime device cuda: cuMemcpyAsync of {nbytes} bytes returned CUDA error {rc}"
            )


class CudaDevice(Device):
    name = "cuda"
    is_cuda = True

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise MoecacheError("runtime device cuda: torch.cuda.is_available() is false on this machine")
        self.torch_device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        # The driver's copies run in the context current on this thread: the device's only where it is
        # torch's current device (torch.empty makes its primary context exist and be current).
        on_current = self.torch_device.index == torch.cuda.current_device()
        if on_current:
            torch.empty(1, device=self.torch_device)
        self.driver = DriverCopies.load() if on_current else None

    def new_stream(self) -> CudaStream:
        return CudaStream(torch.cuda.Stream(device=self.torch_device))

    def compute_stream(self) -> CudaStream:
        """The current stream (at the time of the call): the manager's user runs its kernels there."""
        return CudaStream(torch.cuda.current_stream(self.torch_device), current=True)

    def new_event(self, timing: bool = False) -> CudaEvent:
        return CudaEvent(timing)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: CudaStream) -> None:
        if stream.current:
            dst.copy_(src, non_blocking=True)
            return
        with stream.stream:  # torch.Stream's own context (C++): torch.cuda.stream() costs ~40 us here
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)


def plain_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """A copy the driver can do as bytes: same dtype and size, both contiguous, host to device."""
    return (
        dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.is_cuda
        and not src.is_cuda
    )


# -------------------------------------------------------------------------------------- stand-in


class StandinEvent:
    """Complete until recorded; then incomplete until its stream executes the record."""

    def __init__(self, device: StandinDevice, timing: bool):
        self.device = device
        self.timing = timing
        self.done = True
        self.done_ns: int | None = None
        self.generation = 0  # records so far: a re-record invalidates the previous one

    def record(self, stream: StandinStream) -> None:
        self.generation += 1
        generation = self.generation
        self.done = False

        def complete():
            if self.generation == generation:
                self.done = True
                self.done_ns = time.monotonic_ns()

        stream.enqueue(complete)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.device.run()
        if not self.done:
            raise MoecacheError(
                "stand-in device: event.synchronize() would wait forever (a stream is blocked)"
            )

    def elapsed_ns(self, start: StandinEvent) -> int | None:
        if not (self.timing and start.timing) or self.done_ns is None or start.done_ns is None:
            return None
        return self.done_ns - start.done_ns


class StandinStream:
    """A FIFO of operations: callables, or ("wait", event) barriers."""

    def __init__(self, device: StandinDevice, name: str):
        self.device = device
        self.name = name
        self.ops: deque = deque()

    def enqueue(self, op: Callable[[], None]) -> None:
        self.ops.append(op)
        if self.device.mode == "eager":
            self.device.run()

    def wait_event(self, event: StandinEvent) -> None:
        self.ops.append(("wait", event))

    def run(self, max_ops: int | None = None) -> int:
        """Execute operations in order until empty, blocked on an incomplete event, or `max_ops` done."""
        done = 0
        while self.ops and (max_ops is None or done < max_ops):
            op = self.ops[0]
            if isinstance(op, tuple):
                if not op[1].query():
                    break
                self.ops.popleft()
                continue
            self.ops.popleft()
            op()
            done += 1
        return done


class StandinDevice(Device):
    """The CPU stand-in. `mode`: "manual" (work runs only when the test calls `run`), "before_visit"
    (everything queued runs before each layer visit: every copy completes before the next visit),
    "eager" (every operation runs when enqueued, like a synchronous device)."""

    name = "standin"

    def __init__(self, mode: str = "before_visit"):
        if mode not in STANDIN_MODES:
            raise MoecacheError(f"stand-in device mode={mode!r}: expected one of {list(STANDIN_MODES)}")
        self.mode = mode
        self.torch_device = torch.device("cpu")
        self.streams: list[StandinStream] = []
        self._compute = self.new_stream("compute")

    def new_stream(self, name: str = "side") -> StandinStream:
        stream = StandinStream(self, name)
        self.streams.append(stream)
        return stream

    def compute_stream(self) -> StandinStream:
        return self._compute

    def new_event(self, timing: bool = False) -> StandinEvent:
        return StandinEvent(self, timing)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: StandinStream) -> None:
        stream.enqueue(lambda: dst.copy_(src))

    def enqueue(self, stream: StandinStream, op: Callable[[], None]) -> None:
        """Queue any host work (a test's stand-in kernel) on `stream`."""
        stream.enqueue(op)

    def run(self, stream: StandinStream | None = None, max_ops: int | None = None) -> int:
        """Execute queued work: one stream (up to `max_ops` operations) or every stream until none
        can progress. Returns the operations executed."""
        if stream is not None:
            return stream.run(max_ops)
        total = 0
        while True:
            progressed = sum(s.run() for s in self.streams)
            total += progressed
            if not progressed:
                return total

    def pending(self) -> int:
        return sum(len(s.ops) for s in self.streams)

    def launch(self, stream: StandinStream, op: Callable[[], object], *, after_copies: bool = False):
        result: list = []
        stream.enqueue(lambda: result.append(op()))
        self.run(None if after_copies else stream)
        return result[0]

    def drain(self, stream: StandinStream | None = None) -> None:
        self.run(stream)

    def on_visit(self) -> bool:
        if self.mode != "before_visit":
            return False
        self.run()
        return not self.pending()

    def synchronize(self) -> None:
        self.run()
        if self.pending():
            raise MoecacheError(
                "stand-in device: synchronize() with a stream blocked on an event that never completes"
            )


def make_device(name: str, **options) -> Device:
    """ "cuda", "standin" (options: mode) or "auto" (cuda where available, else the stand-in)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "standin"
    if name == "cuda":
        return CudaDevice(**options)
    if name == "standin":
        return StandinDevice(**options)
    raise MoecacheError(f"runtime device={name!r}: expected cuda, standin or auto")
