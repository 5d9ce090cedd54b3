"""The runtime's side of on_miss="split": the costs and landing times `split_waits` weighs.

The rule itself (which misses wait for their copy, which run on the CPU) is the simulator's
(moecache/sim/miss_split.py), called with the same cost model the timed replay reads: the profile
`moecache calibrate` wrote for this machine, tabulated for the model's expert (`SplitCosts`). When a
copy lands is estimated on the host clock by the transfer engine with the same FIFO timeline as the
replay (`Copy.est_ready_ns`: max(enqueue time, previous copy's landing) + one copy's time).

Legend: T tokens, K top-k, J candidates (misses whose copy is in flight), W = 0..J.
"""

from __future__ import annotations

import time

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.miss_split import split_waits  # the rule, the simulator's own


class SplitCosts:
    """A CostModel's numbers for the manager's split: CPU cost per missed expert of M tokens, the CPU
    path's call cost, the operator's time against resident entries (per token count T), one copy."""

    def __init__(self, cost):
        if cost.runtime is None:
            raise MoecacheError(
                f'on_miss="split": cost profile {cost.source} has no runtime section (the runtime\'s CPU path,'
                " operator and copy engine): run moecache calibrate"
            )
        self.cost = cost
        self.cpu_M = cost.cpu_step_table()
        self.call_us = cost.cpu_call_us()
        self.copy_ns = cost.copy_us() * 1e3
        self.serial = cost.serial
        self.wait_host_us = cost.split_host_us()[1]  # a waiting visit's own host time (calibrate's)
        self._kernel_T: dict[int, np.ndarray] = {}
        self._key_J, self._use_J = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self._ready_J, self._cpu_J, self._gpu_W = np.zeros(0), np.zeros(0), np.zeros(1)
        # compiled now, not at a run's first waiting visit (the H200 host: ~210 ms in a timed step)
        # with the manager's dtypes (misses int64, their uses int32): one signature, compiled once
        one = np.zeros(1, np.int64)
        self.decide(one, np.ones(1, np.int32), 0, np.zeros(1, np.bool_), one, one, 1, 1)

    def kernel_us(self, tokens: int) -> np.ndarray:
        """The operator's time [N] for a call of `tokens` tokens against N resident entries (scaled)."""
        row = self._kernel_T.get(tokens)
        if row is None:
            row = self._kernel_T[tokens] = self.cost.kernel_row_us(tokens)
        return row

    def decide(self, miss_E, uses_M, base: int, loading_G, seq_G, est_ready_G, entries: int, tokens: int):
        """The visit's decision (`_decide`): (w, candidates, their keys in landing order [n]). miss_E: the
        visit's missed experts, uses_M their uses; a miss is a candidate where loading_G[base + e] (its
        copy in flight: seq_G / est_ready_G, its FIFO position and estimated landing, host ns)."""
        n = len(miss_E)
        if len(self._ready_J) < n:
            self._key_J, self._use_J = np.zeros(n, np.int64), np.zeros(n, np.int64)
            self._ready_J, self._cpu_J, self._gpu_W = np.zeros(n), np.zeros(n), np.zeros(n + 1)
        w, n_cand = _decide(
            miss_E, uses_M, base, loading_G, seq_G, est_ready_G, time.monotonic_ns(), self.cpu_M,
            self.kernel_us(tokens), self.call_us, self.serial, self.wait_host_us, entries, self._key_J,
            self._use_J, self._ready_J, self._cpu_J, self._gpu_W,
        )  # fmt: skip
        return w, n_cand, self._key_J[:n_cand]


@nb.njit(cache=True, nogil=True)
def _decide(
    miss_E, uses_M, base, loading_G, seq_G, est_ready_G, now_ns, cpu_M, kernel_N, call_us, serial,
    wait_host_us, entries, key_J, use_J, ready_J, cpu_J, gpu_W,
):  # fmt: skip
    """(w, candidates): the misses whose copy is in flight, in landing order (FIFO: copy seq) into
    key_J / use_J, weighed by `split_waits` with their landing from now (us, 0 if due), CPU costs
    cpu_M[uses], the waiting call kernel_N[entries of the first w] and the hits' call over the visit's
    other entries; the other misses' CPU costs summed."""
    last_m = cpu_M.shape[0] - 1
    last_n = kernel_N.shape[0] - 1
    n = 0
    n_rest = 0
    rest_us = 0.0
    miss_entries = 0
    for i in range(miss_E.shape[0]):
        key = base + miss_E[i]
        uses = uses_M[i]
        miss_entries += uses
        cost = cpu_M[min(uses, last_m)]
        if not loading_G[key]:
            n_rest += 1
            rest_us += cost
            continue
        j = n  # insertion by seq: a handful of candidates
        while j > 0 and seq_G[key_J[j - 1]] > seq_G[key]:
            key_J[j], use_J[j], cpu_J[j], ready_J[j] = (
                key_J[j - 1],
                use_J[j - 1],
                cpu_J[j - 1],
                ready_J[j - 1],
            )
            j -= 1
        key_J[j], use_J[j], cpu_J[j] = key, uses, cost
        ready_J[j] = max(0.0, (est_ready_G[key] - now_ns) / 1e3)
        n += 1
    if n == 0:
        return 0, 0
    waited_entries = 0
    for j in range(n):
        waited_entries += use_J[j]
        gpu_W[j + 1] = kernel_N[min(waited_entries, last_n)]
    hit_entries = entries - miss_entries
    hits_us = kernel_N[min(hit_entries, last_n)] if hit_entries > 0 else 0.0
    w = split_waits(ready_J, cpu_J, gpu_W, n, n_rest, rest_us, call_us, hits_us, serial, wait_host_us)
    return w, n
