"""A many-token visit's missed experts run on the compute device: each copied from the host store into a
staging slot and run by the slot-pool kernel there, instead of on the CPU (`runtime.stream_min_tokens`).

A prompt's visit reads every missed expert once either way. The CPU path streams its weights through the
host's cores and computes each of its tokens there: its time grows with the expert's token count. The
device copies its weights once over the host link, whatever its token count, and computes its tokens
there. So an expert missed by at least `min_tokens` of the visit's tokens goes to the device, the others stay
on the CPU, whose call runs while the copies fly (the two halves overlap; `ExpertsRuntime.run`). A
one-token decode visit never reaches a `min_tokens` above 1.

The cache is not touched: a streamed expert is a miss to the manager as before (its policy saw it and
admits what it admits), and its staging slot is free again once the visit's kernel has read it.

Staging: two pools of `chunk` slots (SlotPool: the store's row layout, so a copy is one store row),
filled in turn on a copy stream of their own: chunk c+1's copies fly while chunk c's kernel runs; a pool
is refilled only after the compute stream has passed the kernel that read it (an event).

Legend: T tokens, H hidden, K top-k, E experts, U streamed experts of a visit, C chunk.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moecache.errors import MoecacheError
from moecache.runtime.slot_pool import SlotPool

DEFAULT_CHUNK = 16  # staging slots per pool (runtime.stream_chunk's default)
# runtime.stream_min_tokens=auto: this many entries where the slot pool is on CUDA (llama.cpp's own batch for
# moving a CPU op to the GPU, GGML_OP_OFFLOAD_MIN_BATCH; measured there: docs/benchmarks.md, "A prompt's
# misses streamed"), none on the CPU stand-in, whose "copies" are host copies the CPU path does not need.
AUTO_MIN_TOKENS = 32


def check_settings(min_tokens, chunk) -> None:
    """`min_tokens` an integer >= 0 (0: nothing streamed) or "auto" (`resolve_min_tokens`), `chunk` an
    integer >= 1; MoecacheError naming the bad one."""
    if min_tokens == "auto":
        min_tokens = 0
    for key, value, least in (("stream_min_tokens", min_tokens, 0), ("stream_chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            want = "auto or an integer >= 0" if key == "stream_min_tokens" else f"an integer >= {least}"
            raise MoecacheError(f"runtime.{key} must be {want}, got {value!r}")


def resolve_min_tokens(min_tokens, on_cuda: bool) -> int:
    """A checked `min_tokens` as an integer: "auto" is AUTO_MIN_TOKENS with the slot pool on CUDA, else 0."""
    if min_tokens == "auto":
        return AUTO_MIN_TOKENS if on_cuda else 0
    return min_tokens


class StreamedMisses:
    def __init__(self, device, store, compute, kernel, *, min_tokens: int, chunk: int):
        """`min_tokens` >= 1, `chunk` >= 1 (`ExpertsRuntime.stream_misses` checks them)."""
        self.device, self.compute, self.kernel = device, compute, kernel
        self.min_tokens, self.chunk = min_tokens, chunk
        self.num_experts = store.num_experts
        self.pools = [SlotPool.for_store(device, chunk, store) for _ in range(2)]
        self.stream = device.new_stream()
        self._expert_rows = list(store.flat_GB.unbind(0))
        self._slot_rows = [list(pool.flat_SB.unbind(0)) for pool in self.pools]
        self._copied = [device.new_event(), device.new_event()]
        self._read: list = [None, None]  # per pool: recorded on the compute stream after its last kernel

    def select(self, ids_host_TK: np.ndarray, miss_TK: np.ndarray) -> np.ndarray:
        """The experts (ascending ids) that at least `min_tokens` missed entries of the visit use."""
        if miss_TK.sum() < self.min_tokens:
            return np.empty(0, np.int64)
        counts_E = np.bincount(ids_host_TK[miss_TK], minlength=self.num_experts)
        return np.flatnonzero(counts_E >= self.min_tokens)

    def run(self, layer: int, x_TH, ids_TK, weights_TK, experts_U: np.ndarray, *, round_product: bool):
        """The float32 sums [T, H] on x's device of every entry whose expert is in `experts_U`, enqueued
        on the compute stream after their copies (module docstring)."""
        y_TH = None
        E, C = self.num_experts, self.chunk
        for c, start in enumerate(range(0, len(experts_U), C)):
            b = c % 2
            chunk_U = experts_U[start : start + C]
            if self._read[b] is not None:
                self.stream.wait_event(self._read[b])
            rows, slots = self._expert_rows, self._slot_rows[b]
            for j, expert in enumerate(chunk_U.tolist()):
                self.device.copy(slots[j], rows[layer * E + expert], self.stream)
            self._copied[b].record(self.stream)
            self.compute.wait_event(self._copied[b])
            slot_of_E = np.full(E, -1, np.int32)
            slot_of_E[chunk_U] = np.arange(len(chunk_U), dtype=np.int32)
            row_E = torch.from_numpy(slot_of_E).to(x_TH.device)
            pool = self.pools[b]
            kernel = functools.partial(
                self.kernel, x_TH, ids_TK, weights_TK, row_E, pool.w13_SIH, pool.w2_SHI,
                out=torch.empty(x_TH.shape, dtype=torch.float32, device=x_TH.device), round_product=round_product,
            )  # fmt: skip
            part_TH = self.device.launch(self.compute, kernel, after_copies=True)
            y_TH = part_TH if y_TH is None else y_TH.add_(part_TH)
            if self._read[b] is None:
                self._read[b] = self.device.new_event()
            self._read[b].record(self.compute)
        return y_TH
