"""Prefill-aware admission over any online base policy: keep a long prompt from wrecking the decode
working set.

A layer step is a *prefill* step when its experts were selected more times than one token selects
(sum of uses > top_k): more than one token was routed (with top-k routing, every token selects exactly
top_k experts). The same rule holds in the simulator and in the runtime's manager, which both see
only the step's keys and uses. In a prefill step:
- `prefill_max_admits` (-1: no cap) caps the misses the base may consider: the misses with the most
  uses first (ties: access order); the others are left out of the base's view and run on the CPU
  (moecache/sim/policies/_wrap.py). 0: no admission from a prefill step (llama.cpp's cap per step,
  "preserve the decode working set");
- `prefill_weight` scales the uses the base counts: uses -> round(uses x weight) (half up), so a
  frequency base counts a prefill token at that weight (1: as a decode token; 0: not at all).
In a decode step everything reaches the base, unless `decode_admits` is false: then decode misses
are left out (the mapping is frozen during decode and refreshed only by prefill steps, KTransformers'
design). Hits always reach the base.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.sim.policies._params import is_int, require, require_number
from moecache.sim.policies._wrap import AdmissionFilter, add_to_view, make_view_step, register_filter
from moecache.sim.policies.lru import LRU
from moecache.sim.policy import register


def make_prefill_admit_step(base_step, n):
    """The step of prefill_admit over the base whose step is `base_step` and state has n members."""
    # members n .. n + 2 are the view (make_view_step); constants: static getitem
    i_rank, i_allow, i_meta, i_weight = range(n + 3, n + 7)

    @nb.njit(inline="always")
    def prefill_admit_view(state, key_U, uses_U, hit_U, clock, view_key, view_uses, view_hit):
        rank_U = state[i_rank]  # scratch: the step's misses, most uses first
        allow_U = state[i_allow]  # scratch: which of the step's misses reach the base
        meta = state[i_meta]  # [top_k, prefill_max_admits (-1: no cap), decode_admits]
        weight = state[i_weight][0]
        U = key_U.shape[0]
        total = 0
        for i in range(U):
            total += uses_U[i]
        prefill = total > meta[0]
        if prefill:
            nr = 0
            for i in range(U):
                if not hit_U[i]:
                    j = nr
                    while j > 0 and uses_U[rank_U[j - 1]] < uses_U[i]:
                        rank_U[j] = rank_U[j - 1]
                        j -= 1
                    rank_U[j] = i
                    nr += 1
            limit = nr if meta[1] < 0 else min(nr, meta[1])
            for r in range(limit):
                allow_U[rank_U[r]] = True
        m = 0
        for i in range(U):
            if prefill:
                keep = hit_U[i] or allow_U[i]
                allow_U[i] = False
                u = np.int32(math.floor(uses_U[i] * weight + 0.5))
            else:
                keep = hit_U[i] or meta[2] != 0
                u = uses_U[i]
            if keep:
                m = add_to_view(view_key, view_uses, view_hit, m, key_U[i], u, hit_U[i])
        return m

    return make_view_step(base_step, n, n, prefill_admit_view)


class PrefillAdmit(AdmissionFilter):
    name = "prefill_admit"
    defaults = {
        "base": "lru",
        "base_params": {},
        "prefill_max_admits": 0,
        "prefill_weight": 1.0,
        "decode_admits": True,
    }
    own_fields = (
        "prefill_admit_view_key",
        "prefill_admit_view_uses",
        "prefill_admit_view_hit",
        "prefill_admit_rank_U",
        "prefill_admit_allow_U",
        "prefill_admit_meta",
        "prefill_admit_weight",
    )
    make_step = staticmethod(make_prefill_admit_step)

    def __init__(self, **params):
        super().__init__(**params)
        cap, d = self.params["prefill_max_admits"], self.params["decode_admits"]
        require(self, "prefill_max_admits", is_int(cap) and cap >= -1, "an integer >= -1 (-1: no cap)")
        require_number(self, "prefill_weight", lambda w: w >= 0, "a number >= 0")
        require(self, "decode_admits", isinstance(d, bool | np.bool_), "true or false")

    def own_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        p = self.params
        return (
            np.zeros(n, np.int32),
            np.zeros(n, np.int32),
            np.zeros(n, np.bool_),
            np.zeros(trace.num_experts, np.int64),
            np.zeros(trace.num_experts, np.bool_),
            np.array([trace.top_k, int(p["prefill_max_admits"]), int(bool(p["decode_admits"]))], np.int64),
            np.array([float(p["prefill_weight"])], np.float64),
        )


register(register_filter(PrefillAdmit, LRU))
