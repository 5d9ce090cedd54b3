"""Sums of a replay's counters per group of layer steps (per layer, per request), in one compiled
pass over the steps and their accesses. The metrics (metrics.py) are ratios of these sums.

Legend: V layer visits, A accesses, R result groups (rows of the aggregate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from moecache.sim.replay import ReplayResult
from moecache.sim.trace_arrays import TraceArrays


@dataclass(frozen=True)
class GroupSums:
    """int64 [G] counts, and the float64 [G] sum of step times (zeros when there are none)."""

    accesses: np.ndarray
    hits: np.ndarray  # accesses that hit
    selections: np.ndarray  # accesses weighted by uses (token selections)
    hit_selections: np.ndarray
    slots: np.ndarray  # accesses whose key held a slot (timed results; else equal to hits)
    admissions: np.ndarray
    evictions: np.ndarray
    step_us: np.ndarray


@nb.njit(cache=True, nogil=True)
def _sum_by_group(
    group_V, start_V, uses_A, hit_A, slot_A, admits_V, evicts_V, step_us_V, counts_R, step_us_R
):
    """counts_R[:, g] += (accesses, hits, selections, hit selections, slots, admissions, evictions)
    of the steps s with group_V[s] == g; step_us_R[g] += step_us_V[s] in step order (as np.bincount),
    when step_us_V is not empty. Consecutive steps of one group (a request) are summed as one run:
    one long loop over their accesses instead of one short loop per step."""
    num_steps = group_V.shape[0]
    s = 0
    while s < num_steps:
        g = group_V[s]
        e = s + 1
        while e < num_steps and group_V[e] == g:
            e += 1
        # Slices indexed from 0: the compiler then knows the index is never negative and vectorises.
        uses, hit, slot = (
            uses_A[start_V[s] : start_V[e]],
            hit_A[start_V[s] : start_V[e]],
            slot_A[start_V[s] : start_V[e]],
        )
        hits = selections = hit_selections = slots = 0
        for i in range(uses.shape[0]):
            m = uses[i]
            h = hit[i]
            hits += h
            selections += m
            hit_selections += m * h
            slots += slot[i]
        counts_R[0, g] += uses.shape[0]
        counts_R[1, g] += hits
        counts_R[2, g] += selections
        counts_R[3, g] += hit_selections
        counts_R[4, g] += slots
        admissions = evictions = 0
        for t in range(s, e):
            admissions += admits_V[t]
            evictions += evicts_V[t]
        counts_R[5, g] += admissions
        counts_R[6, g] += evictions
        if step_us_V.shape[0] > 0:
            us = step_us_R[g]  # added one step at a time, in step order: the sum np.bincount gives
            for t in range(s, e):
                us += step_us_V[t]
            step_us_R[g] = us
        s = e


def group_sums(
    trace: TraceArrays,
    result: ReplayResult,
    group_V: np.ndarray,
    num_groups: int,
    step_us_V: np.ndarray | None = None,
) -> GroupSums:
    """The sums of `result` over the layer steps of each group (group_V: the group of every step)."""
    counts = np.zeros((7, num_groups), np.int64)
    step_us = np.zeros(num_groups, np.float64)
    _sum_by_group(
        group_V,
        trace.start_V,
        trace.uses_A,
        result.hit_A,
        getattr(result, "slot_A", result.hit_A),
        result.admits_V,
        result.evicts_V,
        np.zeros(0) if step_us_V is None else step_us_V,
        counts,
        step_us,
    )
    return GroupSums(*counts, step_us=step_us)
