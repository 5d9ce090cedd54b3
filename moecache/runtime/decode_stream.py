"""Some of a decode visit's misses run on the device, copied over the host link while the CPU runs the rest
(`runtime.decode_stream_share`; the fast decode loop's split layers).

A decode visit's misses run on the CPU, whose executor reads each one's weights from host memory. The
host link is a second reader of that memory: an expert copied into a device slot by DMA and run there by
the slot-pool kernel does not pass through the CPU's cores. Split between the two, a visit's N misses
end sooner than on the CPU alone (`benchmarks/bench_split_misses.py`: the best split sent one of 4 and
two of 6 over the link, 1.07-1.24x on an H100's host; the two readers slow each other, so the link does
not take its share alone). `share` is the fraction of a visit's missed entries streamed, rounded down
(1/3: one of 3-5, two of 6-8): at least one entry stays on the CPU, so the executor's call and the
copies always overlap.

At the layer's second host point (`ExpertsTaps._combine`, its visit deferred: on_miss="cpu"), after the
read-back, the streamed entries' experts (a decode step's one token: its first k entries; several tokens:
the experts with the most entries first) leave the CPU call; their store rows are copied into this
pool's slots by a transfer engine of its own (its copy stream); the compute stream waits for them,
uploads the pool's mapping row (expert -> slot, -1 elsewhere) and runs the kernel over it into
`out_TH` (float32), added into the layer's float32 sum (`y_TH`) before the next segment adds the CPU
half and rounds once. Captured as one CUDA graph per rounding mode (`capture`), replayed there.

Reuse without events: a slot and the pinned row are next written at the next layer's host point, after
its read-back has landed; that read-back is enqueued on the compute stream after this layer's kernel,
so the kernel has read them by then.

The cache is not touched: a streamed expert is a miss to the manager (its policy saw it and admits what
it admits). Layers without a resident half (capacity 0, or a fixed placement's CPU layers) stream
nothing: their output is the CPU half alone.

Legend: T tokens, H hidden, K top-k, E experts, M missed entries, U streamed experts.
"""

from __future__ import annotations

import numpy as np
import torch

from moecache.errors import MoecacheError
from moecache.runtime.slot_pool import SlotPool
from moecache.runtime.transfer import TransferEngine


def check_share(share, on_miss: str = "cpu") -> None:
    """`share` a number with 0 <= share < 1, and on_miss "cpu" unless it is 0 (the streamed entries leave
    the CPU call of a visit deferred past it); MoecacheError naming runtime.decode_stream_share else."""
    ok = not isinstance(share, bool) and isinstance(share, int | float) and 0 <= share < 1
    if not ok:
        raise MoecacheError(f"runtime.decode_stream_share must be a number >= 0 and < 1, got {share!r}")
    if share and on_miss != "cpu":
        raise MoecacheError(
            f'runtime.decode_stream_share={share} needs on_miss="cpu", got on_miss={on_miss!r}'
        )


def streamed_count(misses: int, share: float) -> int:
    """How many of a visit's `misses` entries go to the device: floor(misses x share), below `misses`."""
    return min(int(misses * share), max(misses - 1, 0))


class DecodeStream:
    def __init__(self, device, store, compute, kernel, *, share: float, max_entries: int):
        """`share` checked (`check_share`, above 0); `max_entries` T x K of the decode step: the pool has a
        slot for each entry `share` may stream."""
        self.device, self.compute, self.kernel = device, compute, kernel
        self.share = share
        self.num_experts = store.num_experts
        self.pool = SlotPool.for_store(device, max(streamed_count(max_entries, share), 1), store)
        # the copies: a transfer engine of the pool's own (its copy stream; the driver's copies on CUDA)
        self.engine = TransferEngine(device, store, self.pool, timing=False)
        self._copies: list = []  # the last visit's, complete by the next one (module docstring)
        self.row_host_E = device.host_buffer(self.num_experts, torch.int32)
        self.row_host_E.fill_(-1)
        self._row_np = self.row_host_E.numpy()
        self.row_E = torch.full((self.num_experts,), -1, dtype=torch.int32, device=device.torch_device)
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}

    def take(
        self, base: int, keys_M: np.ndarray, token_M: np.ndarray, weight_M: np.ndarray, m: int, tokens: int
    ):
        """Choose the streamed experts among a gathered CPU call's first `m` entries (global keys, `base`
        = layer x E) of `tokens` tokens and remove their entries from the arrays, in place. Returns (the
        entries left, the streamed experts' ids [U], their entries). One token (a decode step): its
        entries' experts are distinct, the first k go; else the most used experts first."""
        k = streamed_count(m, self.share)
        if k == 0:
            return m, np.zeros(0, np.int64), 0
        if tokens == 1:
            experts_U = keys_M[:k] - base
            for a in (keys_M, token_M, weight_M):
                a[: m - k] = a[k:m].copy()
            return m - k, experts_U, k
        keys, counts = np.unique(keys_M[:m], return_counts=True)
        order = np.argsort(-counts, kind="stable")  # the most used first; ties by key
        chosen_U, taken = [], 0
        for i in order:
            if taken + counts[i] > k and chosen_U:
                break
            chosen_U.append(keys[i])
            taken += int(counts[i])
        if taken >= m:  # one expert holds every entry: leave the visit to the CPU
            return m, np.zeros(0, np.int64), 0
        keep_M = ~np.isin(keys_M[:m], chosen_U)
        left = int(keep_M.sum())
        for a in (keys_M, token_M, weight_M):
            a[:left] = a[:m][keep_M]
        return left, np.asarray(chosen_U, np.int64) - base, taken

    def enqueue(self, layer: int, experts_U: np.ndarray) -> None:
        """The experts' store rows into the pool's slots on the copy stream, the compute stream's wait for
        them, the pool's mapping row written in pinned memory (`run` or its graph uploads it). The previous
        visit's copies are complete by now (module docstring): their events are reused."""
        engine = self.engine
        for copy in self._copies:
            engine.release(copy)
        base = layer * self.num_experts
        self._copies = [engine.enqueue(base + expert, j) for j, expert in enumerate(experts_U.tolist())]
        self.compute.wait_event(self._copies[-1].ready_event)  # the copy stream is FIFO
        self._row_np.fill(-1)
        self._row_np[experts_U] = np.arange(len(experts_U), dtype=np.int32)

    def run(self, x_TH, ids_TK, weights_TK, out_TH, y_TH, *, round_product: bool) -> None:
        """The mapping row uploaded, the streamed entries' float32 sums into `out_TH`, added into `y_TH`: the
        captured graph where there is one for this rounding, else launched now (after the copies, on the
        stand-in too)."""
        graph = self._graphs.get(round_product)
        if graph is not None:
            graph.replay()
            return
        pool = self.pool
        self.device.copy(self.row_E, self.row_host_E, self.compute)
        self.device.launch(
            self.compute,
            lambda: self.kernel(
                x_TH, ids_TK, weights_TK, self.row_E, pool.w13_SIH, pool.w2_SHI, out=out_TH,
                round_product=round_product,
            ),
            after_copies=True,
        )  # fmt: skip
        y_TH.add_(out_TH)

    def capture(self, x_TH, ids_TK, weights_TK, out_TH, y_TH, roundings) -> None:
        """CUDA: `run`'s row upload, kernel and add as one graph per rounding in `roundings` (a pool of its
        own: it replays between the step's segments), reading the static buffers and the pinned row."""
        if not self.device.is_cuda:
            return
        handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = self.pool
        for rounds in sorted(set(roundings)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=handle, stream=stream):
                self.row_E.copy_(self.row_host_E, non_blocking=True)
                self.kernel(
                    x_TH, ids_TK, weights_TK, self.row_E, pool.w13_SIH, pool.w2_SHI, out=out_TH,
                    round_product=rounds,
                )  # fmt: skip
                y_TH.add_(out_TH)
            self._graphs[rounds] = graph
        torch.cuda.current_stream().wait_stream(stream)
