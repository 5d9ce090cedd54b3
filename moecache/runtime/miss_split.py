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

import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.miss_split import split_waits


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
        self._ready_J = np.zeros(0)
        self._cpu_J = np.zeros(0)
        self._gpu_W = np.zeros(1)
        # compiled now, not at a run's first waiting visit (the H200 host: ~210 ms in a timed step)
        split_waits(np.zeros(1), np.zeros(1), np.zeros(2), 1, 0, 0.0, 0.0, 0.0, False, 0.0)

    def cpu_us(self, uses: int) -> float:
        return float(self.cpu_M[min(uses, len(self.cpu_M) - 1)])

    def kernel_us(self, tokens: int) -> np.ndarray:
        """The operator's time [N] for a call of `tokens` tokens against N resident entries (scaled)."""
        row = self._kernel_T.get(tokens)
        if row is None:
            row = self._kernel_T[tokens] = self.cost.kernel_row_us(tokens)
        return row

    def waits(self, candidates, uses_J, rest_uses, tokens: int, hit_entries: int) -> int:
        """How many of `candidates` (Copies in landing order; uses_J their experts' uses at this visit)
        to wait for; rest_uses: the uses of the visit's other misses."""
        n = len(candidates)
        if len(self._ready_J) < n:
            self._ready_J, self._cpu_J, self._gpu_W = np.zeros(n), np.zeros(n), np.zeros(n + 1)
        kernel = self.kernel_us(tokens)
        now = time.monotonic_ns()
        entries = 0
        for j, (copy, uses) in enumerate(zip(candidates, uses_J, strict=True)):
            self._ready_J[j] = max(0.0, (copy.est_ready_ns - now) / 1e3)
            self._cpu_J[j] = self.cpu_us(uses)
            entries += uses
            self._gpu_W[j + 1] = kernel[min(entries, len(kernel) - 1)]
        rest = 0.0
        for u in rest_uses:
            rest += self.cpu_us(u)
        hits = float(kernel[min(hit_entries, len(kernel) - 1)]) if hit_entries else 0.0
        return int(
            split_waits(
                self._ready_J, self._cpu_J, self._gpu_W, n, len(rest_uses), rest, self.call_us, hits,
                self.serial, self.wait_host_us,
            )
        )  # fmt: skip
