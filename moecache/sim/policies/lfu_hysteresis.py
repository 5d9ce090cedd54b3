"""Decayed LFU with hysteresis and a minimum residency (KTransformers' expert-cache design).

Scores as lfu_decay: score(k) = sum over past uses of 2^(-(now - t) / half_life_tokens), t the token
clock of the using step, stored scaled (see lfu_decay.py). The step's scores first take its uses; then
its misses are considered in rank order (-score, key). Free slots are filled. Once full, the victim is
the *eligible* resident of the lowest score (among equal scores the largest key), eligible meaning
admitted at least `min_residency_tokens` tokens ago (token clock); a miss replaces it only when its
score exceeds (1 + hysteresis) x the victim's. No eligible resident, or a miss that does not clear the
margin, ends the step's admissions (later misses rank no better). With hysteresis 0 and
min_residency_tokens 0 this is lfu_decay exactly. Residents sit in lfu_decay's indexed min-heap; a
victim below the top (the top too young) is found by a scan of the residents.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_ints, require_number
from moecache.sim.policies.lfu import frequency_arrays, sort_ranked
from moecache.sim.policies.lfu_decay import note_decayed_uses
from moecache.sim.policy import Policy, register


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lfu_hysteresis_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    score_G, since_G, heap, pos_G, miss, meta, fmeta = state
    # meta: [held, capacity, scale exponent, min_residency_tokens]; fmeta: [half-life, 1 + hysteresis]
    n = meta[0]
    cap = meta[1]
    young = meta[3]
    margin = fmeta[1]
    nm, best = note_decayed_uses(score_G, heap, pos_G, n, meta, clock / fmeta[0], key_U, uses_U, miss)
    na = 0
    ne = 0
    # The heap's top has the lowest score of all residents: a miss that does not clear the margin over
    # it clears it over no eligible resident either.
    if nm > 0 and (n < cap or (n > 0 and best > margin * score_G[heap[0]])):
        sort_ranked(miss, nm, score_G)
        j = 0
        while j < nm:  # no `break` (see _heap)
            m = miss[j]
            j += 1
            if n < cap:
                n = _heap.push(heap, pos_G, score_G, n, m)
                since_G[m] = clock
                admit_out[na] = m
                na += 1
                continue
            v = -1
            if n > 0:
                v = heap[0]
                if clock - since_G[v] < young:
                    v = -1
                    for p in range(n):
                        c = heap[p]
                        if clock - since_G[c] >= young and (v < 0 or _heap.before(score_G, c, v)):
                            v = c
            if v < 0 or not score_G[m] > margin * score_G[v]:
                j = nm
                continue
            p = pos_G[v]
            pos_G[v] = -1
            heap[p] = m
            pos_G[m] = p
            _heap.sift_up(heap, pos_G, score_G, p)
            _heap.sift_down(heap, pos_G, score_G, n, pos_G[m])
            since_G[m] = clock
            evict_out[ne] = v
            ne += 1
            admit_out[na] = m
            na += 1
    meta[0] = n
    return na, ne


@register
class LFUHysteresis(Policy):
    name = "lfu_hysteresis"
    step = lfu_hysteresis_step
    state_fields = ("score_G", "since_G", "heap", "pos_G", "miss", "meta", "fmeta")
    defaults = {"half_life_tokens": 256, "hysteresis": 0.25, "min_residency_tokens": 16}

    def __init__(self, **params):
        super().__init__(**params)
        require_number(self, "half_life_tokens", lambda h: h > 0, "a positive number")
        require_number(self, "hysteresis", lambda m: m >= 0, "a number >= 0")
        require_ints(self, min_residency_tokens=0)

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        p = self.params
        heap, pos_G, miss = frequency_arrays(n, capacity)
        meta = np.array([0, capacity, 0, int(p["min_residency_tokens"])], np.int64)
        fmeta = np.array([float(p["half_life_tokens"]), 1.0 + float(p["hysteresis"])], np.float64)
        return np.zeros(n, np.float64), np.zeros(n, np.int64), heap, pos_G, miss, meta, fmeta
