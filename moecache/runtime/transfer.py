"""The transfer engine: host-to-device copies of expert weights into slots, on one dedicated stream.

`enqueue(key, slot, after)` is called the moment the policy admits `key` (a demand admission or a
prefetch of a later layer's expert): if `after` (an event after the slot's last reader: CUDA work that reads
the slot's previous expert may still be queued) is given, the copy stream first waits on it; then the
expert's row (w13 then w2, one contiguous copy) is enqueued from the pinned store and a ready event is recorded. Nothing
here blocks the caller: the manager later queries (never waits on) the ready event. On CUDA the copy is the
driver's `cuMemcpyAsync` on the rows' addresses, taken once (moecache/runtime/device.py says why).

`synchronous=True` waits for every copy before returning: only for tests and transfer-cost calibration.

With `copy_estimate_ns` set (on_miss="split", moecache/runtime/miss_split.py) each copy also carries
when it should land on the host clock, the timed replay's FIFO timeline: `est_ready_ns` = max(its
enqueue, the previous copy's estimate) + copy_estimate_ns.

Legend: G global expert keys, S slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moecache.runtime.device import plain_pair


@dataclass(slots=True)
class Copy:
    """One expert copy in flight or done. Times are host `time.monotonic_ns()`; `duration_ns` is the
    device time between the copy's start and ready events, where the device measures it and the engine
    timed the copy (`start_event` None: untimed)."""

    key: int
    slot: int
    nbytes: int
    enqueued_ns: int
    ready_event: object
    start_event: object
    seq: int = -1  # its place on the copy stream (0, 1, ...): copies complete in this order
    est_ready_ns: int = 0  # when it should land (host clock), with TransferEngine.copy_estimate_ns set
    ready_ns: int | None = None  # when the manager saw the ready event complete
    duration_ns: int | None = None
    wasted: bool = field(default=False)  # its key was evicted before the copy was published

    def observe(self, known_complete: bool = False) -> bool:
        """Query the ready event (never waits; not at all when `known_complete`: a later copy on the same
        stream was seen complete); on completion note the times. Returns completion."""
        if self.ready_ns is not None:
            return True
        if not known_complete and not self.ready_event.query():
            return False
        self.ready_ns = time.monotonic_ns()
        if self.start_event is not None:
            self.duration_ns = self.ready_event.elapsed_ns(self.start_event)
        return True


class TransferEngine:
    def __init__(self, device, store, pool, *, synchronous: bool = False, timing: bool = True):
        self.device = device
        self.store = store
        self.pool = pool
        self.synchronous = synchronous
        self.timing = timing  # may change between copies (the manager times copies while logging)
        self.stream = device.new_stream()
        self.copies_enqueued = 0
        self.bytes_enqueued = 0
        self.completed_seq = -1  # every copy up to this seq is known complete (the stream is FIFO)
        self.copy_estimate_ns: float | None = None  # one copy's time, for est_ready_ns (module docstring)
        self.last_enqueued_ns = 0  # host monotonic ns when the last `enqueue` returned its copy
        self._est_free_ns = 0
        # every slot's and every expert's row as a view, made once (indexing a tensor per copy costs more
        # than the copy's enqueue)
        self._slot_rows = list(pool.flat_SB.unbind(0))
        self._expert_rows = list(store.flat_GB.unbind(0))
        # on CUDA, the rows' addresses for the driver's copies (moecache/runtime/device.py)
        self._driver = getattr(device, "driver", None)
        if self._driver is not None and not (self._slot_rows and self._expert_rows and plain_pair(
            self._slot_rows[0], self._expert_rows[0]
        )):  # fmt: skip
            self._driver = None
        if self._driver is not None:
            self._slot_ptrs = [row.data_ptr() for row in self._slot_rows]
            self._expert_ptrs = [row.data_ptr() for row in self._expert_rows]
            self._row_bytes = self._slot_rows[0].nbytes
        self._expert_bytes = store.expert_bytes
        # events of completed copies, recorded again by later copies: timing ones, plain ones
        self._free_events: dict[bool, list] = {True: [], False: []}

    def _event(self, timing: bool):
        free = self._free_events[timing]
        return free.pop() if free else self.device.new_event(timing=timing)

    def release(self, copy: Copy) -> None:
        """The copy is complete and observed: its events may be recorded again."""
        for event in (copy.start_event, copy.ready_event):
            if event is not None:
                self._free_events[bool(event.timing)].append(event)
        copy.start_event = copy.ready_event = None

    def enqueue(self, key: int, slot: int, after=None) -> Copy:
        """Copy expert `key` into `slot` on the copy stream, after `after` (an event) completes."""
        stream = self.stream
        if after is not None:
            stream.wait_event(after)
        timing = self.timing
        start = self._event(True) if timing else None  # untimed: one event record fewer per copy
        ready = self._event(timing)
        enqueued = time.monotonic_ns()
        if start is not None:
            start.record(stream)
        if self._driver is not None:  # one row: w13 then w2
            self._driver.copy(self._slot_ptrs[slot], self._expert_ptrs[key], self._row_bytes, stream.handle)
        else:
            self.device.copy(self._slot_rows[slot], self._expert_rows[key], stream)
        ready.record(stream)
        nbytes = self._expert_bytes
        copy = Copy(key, slot, nbytes, enqueued, ready, start, self.copies_enqueued)
        if self.copy_estimate_ns is not None:
            self._est_free_ns = copy.est_ready_ns = int(
                max(enqueued, self._est_free_ns) + self.copy_estimate_ns
            )
        self.copies_enqueued += 1
        self.bytes_enqueued += nbytes
        if self.synchronous:
            ready.synchronize()
            copy.observe()
            self.completed_seq = copy.seq
        self.last_enqueued_ns = time.monotonic_ns()
        return copy

    def observe_in_order(self, copies) -> list[Copy]:
        """The leading complete copies of `copies` (given in enqueue order): no query for a copy at or
        below the watermark `completed_seq`, none after the first incomplete one (the stream completes
        copies in order); the last one is queried first: complete, it completes them all in one query.
        Raises the watermark."""
        last = copies[-1] if copies else None
        if last is not None and last.seq > self.completed_seq and last.observe():
            self.completed_seq = last.seq
        done = []
        for copy in copies:
            if not copy.observe(known_complete=copy.seq <= self.completed_seq):
                break
            self.completed_seq = max(self.completed_seq, copy.seq)
            done.append(copy)
        return done
