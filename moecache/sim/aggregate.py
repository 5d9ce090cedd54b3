"""Sums of a replay's counters per group of layer steps (per layer, per request), in one compiled
pass over the steps and their accesses. The metrics (metrics.py) are ratios of these sums.

Legend: S layer steps, A accesses, G groups.
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
    group_S, start_S, uses_A, hit_A, slot_A, admits_S, evicts_S, step_us_S, counts_G, step_us_G
):
    """counts_G[:, g] += (accesses, hits, selections, hit selections, slots, admissions, evictions)
    of the steps s with group_S[s] == g; step_us_G[g] += step_us_S[s] in step order (as np.bincount),
    when step_us_S is not empty. Consecutive steps of one group (a request) are summed as one run:
    one long loop over their accesses instead of one short loop per step."""
    num_steps = group_S.shape[0]
    s = 0
    while s < num_steps:
        g = group_S[s]
        e = s + 1
        while e < num_steps and group_S[e] == g:
            e += 1
        # Slices indexed from 0: the compiler then knows the index is never negative and vectorises.
        uses, hit, slot = (
            uses_A[start_S[s] : start_S[e]],
            hit_A[start_S[s] : start_S[e]],
            slot_A[start_S[s] : start_S[e]],
        )
        hits = selections = hit_selections = slots = 0
        for i in range(uses.shape[0]):
            m = uses[i]
            h = hit[i]
            hits += h
            selections += m
            hit_selections += m * h
            slots += slot[i]
        counts_G[0, g] += uses.shape[0]
        counts_G[1, g] += hits
        counts_G[2, g] += selections
        counts_G[3, g] += hit_selections
        counts_G[4, g] += slots
        admissions = evictions = 0
        for t in range(s, e):
            admissions += admits_S[t]
            evictions += evicts_S[t]
        counts_G[5, g] += admissions
        counts_G[6, g] += evictions
        if step_us_S.shape[0] > 0:
            us = step_us_G[g]  # added one step at a time, in step order: the sum np.bincount gives
            for t in range(s, e):
                us += step_us_S[t]
            step_us_G[g] = us
        s = e


def group_sums(
    trace: TraceArrays,
    result: ReplayResult,
    group_S: np.ndarray,
    num_groups: int,
    step_us_S: np.ndarray | None = None,
) -> GroupSums:
    """The sums of `result` over the layer steps of each group (group_S: the group of every step)."""
    counts = np.zeros((7, num_groups), np.int64)
    step_us = np.zeros(num_groups, np.float64)
    _sum_by_group(
        group_S,
        trace.start_S,
        trace.uses_A,
        result.hit_A,
        getattr(result, "slot_A", result.hit_A),
        result.admits_S,
        result.evicts_S,
        np.zeros(0) if step_us_S is None else step_us_S,
        counts,
        step_us,
    )
    return GroupSums(*counts, step_us=step_us)
