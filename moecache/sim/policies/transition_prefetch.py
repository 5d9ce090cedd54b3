"""Cumulative LFU for demand caching plus a prefetch of the next layer's experts predicted from online
adjacent-layer transition counts.

Demand caching is exactly `lfu` (with its defaults: cumulative counts, no reset, no initial counts):
the counts of all the step's keys grow by their uses, then the misses are admitted in rank order
(-count, key), into free slots, then in place of the victim (the resident with the lowest count,
among equal counts the largest key) only when strictly better. Residents sit in lfu's indexed
min-heap, top = victim; a prefetched key joins it with its current count as priority.

Transition counts (kept for the whole replay, never reset). A[n, i, j]: how often expert i of layer
n - 1 was followed by expert j of layer n in the same forward step; N[n - 1, i]: how often expert i
of layer n - 1 had a successor step. When the step of layer n directly follows the step of layer
n - 1 of the same forward step (same request and token clock), then for every expert i of the
previous step and j of this step, A[n, i, j] += 1, and N[n - 1, i] += 1 once per i. A prefill step is
counted union to union (every expert of the previous step's union with every expert of this step's
union, once, whatever the tokens): the simulator's layer steps hold the union over tokens, so which
token chose which pair is lost. Counting happens before predicting (and touches other rows).

Prediction, once the step of layer n has routed (n + 1 < L): for each expert j of layer n + 1,
p_j = mean over the step's experts i with N[n, i] > 0 of A[n + 1, i, j] / N[n, i] (0 when there is
no such i), computed in float64 as sum in access order, then divided by their number. The predicted
set is the `top` experts by p_j (ties: lower j first) among those with p_j >= `min_probability`
(with min_probability 0 even p_j = 0 qualifies). Keys of the set already held, in the policy's view
after the step's demand admissions and evictions, are skipped (they take no budget).

Prefetch, after demand admission: up to `budget` keys of the predicted set, best first. A free slot
is taken if there is one; otherwise the LFU victim (heap top) is evicted, unless the victim is one
of this step's keys (a hit or a demand admission) or a key prefetched by this step: then prefetching
stops for this step. A prefetched key that this step's demand admission had just evicted keeps its
slot instead (the eviction is cancelled: no copy, no eviction; it still counts against the budget).
budget 0 is exactly lfu. Parameters: `top` (int >= 1, default 8), `budget` (int >= 0, default 2),
`min_probability` (in [0, 1], default 0.1).

In the spirit of inter-layer expert-affinity prefetchers (expert selection at layer n + 1 is
predictable from layer n's, e.g. ExFlow, Yao et al. 2024; MoE-Infinity's activation tracing).
Simplified: a first-order, one-layer-back predictor from online counts (no offline profiling, no
gate-input or hidden-state lookahead, no per-request model), a mean of conditional frequencies in
place of a learned combination, a fixed per-step budget instead of a timing-aware one (each copy
competes with demand copies on the one FIFO copy engine of timed mode), and LFU's victim rule for
every replacement.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_ints, require_number
from moecache.sim.policies.lfu import frequency_arrays, note_use, settle
from moecache.sim.policy import Policy, register

# meta indices
HELD, CAP, NUM_E, NUM_L, PREV_LAYER, PREV_CLOCK, PREV_REQUEST, N_PREV, TOP, BUDGET = range(10)


@nb.njit(cache=True, inline="always")
def _contains(arr, n, k):
    """Whether k is in arr[:n]."""
    found = False
    for r in range(n):
        found = found or arr[r] == k
    return found


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def transition_prefetch_step(
    state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out
):  # fmt: skip
    count_G, heap, pos_G, miss, trans, succ, prev_E, p_E, cand, pf, meta, fmeta = state
    n = meta[HELD]
    cap = meta[CAP]
    E = meta[NUM_E]
    nu = key_U.shape[0]
    # 1. demand caching: lfu
    nm = 0
    best = -1
    for i in range(nu):
        k = key_U[i]
        count_G[k] += uses_U[i]
        nm, best = note_use(heap, pos_G, count_G, n, miss, nm, best, k)
    n, na, ne = settle(heap, pos_G, count_G, n, cap, miss, nm, best, admit_out, evict_out)
    if nu > 0:
        layer = key_U[0] // E
        base = layer * E
        # 2. transition counts from the previous step (layer - 1 of the same forward step)
        if layer == meta[PREV_LAYER] + 1 and clock == meta[PREV_CLOCK] and request == meta[PREV_REQUEST]:
            for r in range(meta[N_PREV]):
                i = prev_E[r]
                succ[base - E + i] += 1
                row = (base + i) * E  # trans[layer, i, :]
                for u in range(nu):
                    trans[row + key_U[u] - base] += 1
        for u in range(nu):
            prev_E[u] = key_U[u] - base
        meta[N_PREV] = nu
        meta[PREV_LAYER] = layer
        meta[PREV_CLOCK] = clock
        meta[PREV_REQUEST] = request
        # 3. predict layer + 1 and prefetch
        if meta[BUDGET] > 0 and layer + 1 < meta[NUM_L]:
            for j in range(E):
                p_E[j] = 0.0
            m = 0
            for u in range(nu):
                i = key_U[u] - base
                c = succ[base + i]
                if c > 0:
                    m += 1
                    row = (base + E + i) * E  # trans[layer + 1, i, :]
                    for j in range(E):
                        p_E[j] += trans[row + j] / c
            if m > 0:
                for j in range(E):
                    p_E[j] /= m
            # the `top` best (greater p, then lower j) with p >= min_probability, best first
            minp = fmeta[0]
            nc = 0
            top = cand.shape[0]
            for j in range(E):
                pj = p_E[j]
                if pj >= minp and (nc < top or pj > p_E[cand[nc - 1]]):
                    r = min(nc, top - 1)
                    while r > 0 and p_E[cand[r - 1]] < pj:
                        cand[r] = cand[r - 1]
                        r -= 1
                    cand[r] = j
                    nc = min(nc + 1, top)
            nxt = base + E
            nf = 0  # skip the keys held now (after the demand admissions), before any prefetch
            for c in range(nc):
                if pos_G[nxt + cand[c]] < 0:
                    cand[nf] = cand[c]
                    nf += 1
            npf = 0
            c = 0
            while c < nf and npf < meta[BUDGET]:
                k = nxt + cand[c]
                c += 1
                if n < cap:
                    n = _heap.push(heap, pos_G, count_G, n, k)
                else:
                    v = heap[0] if n > 0 else -1
                    if v < 0 or _contains(key_U, nu, v) or _contains(pf, npf, v):
                        c = nf  # stop prefetching for this step
                        continue
                    _heap.replace_top(heap, pos_G, count_G, n, k)
                    evict_out[ne] = v
                    ne += 1
                pf[npf] = k
                npf += 1
                admit_out[na] = k  # if this step's demand admission evicted k, apply_step keeps its slot
                na += 1
    meta[HELD] = n
    return na, ne


@register
class TransitionPrefetch(Policy):
    name = "transition_prefetch"
    step = transition_prefetch_step
    state_fields = (
        "count_G", "heap", "pos_G", "miss",  # lfu's demand caching
        "trans", "succ", "prev_E",  # the transition counts, the previous step's experts
        "p_E", "cand", "pf",  # the prediction, the step's prefetches
        "meta", "fmeta",
    )  # fmt: skip
    defaults = {"top": 8, "budget": 2, "min_probability": 0.1}
    prefetches = True

    def __init__(self, **params):
        super().__init__(**params)
        require_ints(self, top=1, budget=0)
        require_number(self, "min_probability", lambda p: 0 <= p <= 1, "a number in [0, 1]")

    def init_state(self, trace, capacity: int) -> tuple:
        L, E = trace.num_layers, trace.num_experts
        n = trace.num_keys
        heap, pos_G, miss = frequency_arrays(n, capacity)
        width = max(min(int(self.params["top"]), E), 1)
        meta = np.array(
            [0, capacity, E, L, -2, -1, -1, 0, int(self.params["top"]), int(self.params["budget"])], np.int64
        )
        fmeta = np.array([float(self.params["min_probability"])], np.float64)
        return (
            np.zeros(n, np.int64),  # count_G
            heap,
            pos_G,
            miss,
            np.zeros(L * E * E, np.int64),  # trans: A[n, i, j] at (n * E + i) * E + j
            np.zeros(n, np.int64),  # succ: N[n, i] at n * E + i
            np.zeros(E, np.int64),  # prev_E: experts of the previous step
            np.zeros(E, np.float64),  # p_E: predicted probabilities of the next layer
            np.zeros(width, np.int64),  # cand: the predicted set, best first
            np.zeros(width, np.int64),  # pf: keys prefetched by the current step
            meta,
            fmeta,
        )
