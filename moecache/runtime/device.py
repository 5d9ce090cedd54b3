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
"""

from __future__ import annotations

import ctypes
import functools
import os
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
        self.copy_many(((dst, src),), stream)

    def copy_many(self, pairs, stream) -> None:
        """Enqueue `dst.copy_(src)` for each (dst, src) pair on `stream`, in order."""
        raise NotImplementedError

    def on_visit(self) -> bool:
        """Called by the cache manager before each layer visit (the stand-in may complete work here).
        True: everything enqueued so far has completed."""
        return False

    def synchronize(self) -> None:
        """Wait for (stand-in: execute) everything enqueued on every stream."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ CUDA


class Cudart:
    """The CUDA runtime calls of the runtime's hot path (copies, event record/query/sync, stream waits),
    made through ctypes on the libcudart the process already has loaded (torch's). The same calls
    through torch cost several microseconds more each (dispatch, argument checks, the caching host
    allocator's bookkeeping of pinned buffers), and a layer visit makes several. `load()` returns None
    where no libcudart is mapped (a CUDA runtime linked statically into torch) or MOECACHE_RAW_CUDA=0:
    the torch calls are used then."""

    NOT_READY = 600  # cudaErrorNotReady
    MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
    DISABLE_TIMING = 2  # cudaEventDisableTiming

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (
            ("cudaMemcpyAsync", (vp, vp, sz, ctypes.c_int, vp)),
            ("cudaEventCreateWithFlags", (ctypes.POINTER(vp), ctypes.c_uint)),
            ("cudaEventDestroy", (vp,)),
            ("cudaEventRecord", (vp, vp)),
            ("cudaEventQuery", (vp,)),
            ("cudaEventSynchronize", (vp,)),
            ("cudaEventElapsedTime", (ctypes.POINTER(ctypes.c_float), vp, vp)),
            ("cudaStreamWaitEvent", (vp, vp, ctypes.c_uint)),
            ("cudaGetErrorString", (ctypes.c_int,)),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.memcpy_async = lib.cudaMemcpyAsync
        self.event_record = lib.cudaEventRecord
        self.event_query = lib.cudaEventQuery
        self.event_sync = lib.cudaEventSynchronize
        self.stream_wait = lib.cudaStreamWaitEvent

    @staticmethod
    @functools.cache
    def load() -> Cudart | None:
        if os.environ.get("MOECACHE_RAW_CUDA", "1") == "0" or not torch.cuda.is_available():
            return None
        torch.cuda.init()
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        except OSError:
            return None
        for path in sorted(paths):
            try:
                return Cudart(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
        return None

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise MoecacheError(
                f"runtime device cuda: {what} failed: {self.lib.cudaGetErrorString(code).decode()}"
            )


class CudaEvent:
    """A CUDA event with the interface the runtime uses: a raw cudaEvent_t through `Cudart`, or a
    torch.cuda.Event where the raw calls are not available."""

    def __init__(self, timing: bool, rt: Cudart | None):
        self.timing = timing
        self.rt = rt
        if rt is None:
            self.event = torch.cuda.Event(enable_timing=timing)
            return
        handle = ctypes.c_void_p()
        rt.check(
            rt.lib.cudaEventCreateWithFlags(ctypes.byref(handle), 0 if timing else rt.DISABLE_TIMING),
            "event create",
        )
        self.handle = handle

    def __del__(self):
        if self.rt is not None and getattr(self, "handle", None) is not None:
            self.rt.lib.cudaEventDestroy(self.handle)

    def record(self, stream) -> None:
        if self.rt is None:
            self.event.record(stream.stream)
        else:
            self.rt.check(self.rt.event_record(self.handle, stream.handle), "event record")

    def query(self) -> bool:
        if self.rt is None:
            return self.event.query()
        code = self.rt.event_query(self.handle)
        if code == Cudart.NOT_READY:
            return False
        self.rt.check(code, "event query")
        return True

    def synchronize(self) -> None:
        if self.rt is None:
            self.event.synchronize()
        else:
            self.rt.check(self.rt.event_sync(self.handle), "event synchronize")

    def elapsed_ns(self, start: CudaEvent) -> int | None:
        """Device time from `start` to this event (both timing events, recorded), else None. Waits for
        this event to complete (a timing read happens off the hot path: the logger's writer thread)."""
        if not (self.timing and start.timing):
            return None
        self.synchronize()
        if self.rt is None:
            return int(start.event.elapsed_time(self.event) * 1e6)
        ms = ctypes.c_float()
        self.rt.check(
            self.rt.lib.cudaEventElapsedTime(ctypes.byref(ms), start.handle, self.handle), "elapsed time"
        )
        return int(ms.value * 1e6)


class CudaStream:
    """`current`: the stream was the current stream when wrapped (the compute stream), so work for it
    is enqueued without entering a stream context (which costs microseconds per entry). `handle`: the
    raw cudaStream_t."""

    def __init__(self, stream: torch.cuda.Stream, current: bool = False, rt: Cudart | None = None):
        self.stream = stream
        self.current = current
        self.rt = rt
        self.handle = ctypes.c_void_p(stream.cuda_stream)

    def wait_event(self, event: CudaEvent) -> None:
        if self.rt is None:
            self.stream.wait_event(event.event)
        else:
            self.rt.check(self.rt.stream_wait(self.handle, event.handle, 0), "stream wait")

    def synchronize(self) -> None:
        self.stream.synchronize()


class CudaDevice(Device):
    name = "cuda"
    is_cuda = True

    def __init__(self, index: int | None = None, raw: bool | None = None):
        if not torch.cuda.is_available():
            raise MoecacheError("runtime device cuda: torch.cuda.is_available() is false on this machine")
        self.torch_device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.rt = Cudart.load() if raw is not False else None
        if raw and self.rt is None:
            raise MoecacheError("runtime device cuda: raw=True but no libcudart is loaded in this process")

    def new_stream(self) -> CudaStream:
        return CudaStream(torch.cuda.Stream(device=self.torch_device), rt=self.rt)

    def compute_stream(self) -> CudaStream:
        """The current stream (at the time of the call): the manager's user runs its kernels there."""
        return CudaStream(torch.cuda.current_stream(self.torch_device), current=True, rt=self.rt)

    def new_event(self, timing: bool = False) -> CudaEvent:
        return CudaEvent(timing, self.rt)

    def copy_many(self, pairs, stream: CudaStream) -> None:
        rt = self.rt
        if rt is not None:
            for dst, src in pairs:
                n = dst.nbytes
                if n != src.nbytes or not (dst.is_contiguous() and src.is_contiguous()):
                    raise MoecacheError(
                        f"runtime device cuda: copy of {tuple(src.shape)} into {tuple(dst.shape)}: the runtime "
                        "copies contiguous buffers of one size"
                    )
                rt.check(
                    rt.memcpy_async(dst.data_ptr(), src.data_ptr(), n, rt.MEMCPY_DEFAULT, stream.handle),
                    "copy",
                )
            return
        if stream.current:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return
        with stream.stream:  # torch.Stream's own context (C++): torch.cuda.stream() costs ~40 us here
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


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

    def copy_many(self, pairs, stream: StandinStream) -> None:
        for dst, src in pairs:
            stream.enqueue(lambda dst=dst, src=src: dst.copy_(src))

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
