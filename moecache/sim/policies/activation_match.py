"""Activation matching, in the spirit of MoE-Infinity (Xue et al., arXiv 2401.14361): a bounded collection
of past requests' layer x expert activation matrices, matched by cosine similarity against the current
request's partial matrix, sets the eviction priority and picks next-layer prefetches.

State. cur_G: the current request's activation matrix, uses per key (a step's uses: the tokens that
selected the expert). A ring of at most `history` stored matrices (the last `history` finished
requests; when full, the oldest is dropped), their squared norms, and dot_M = cur . stored_m. When
`request` changes, the finished request's matrix is pushed into the ring and cur restarts from zero.
Every step first adds its uses to cur_G and to dot_M (only the step's keys: O(history x keys)) and
to cur's squared norm, and records each key's last access index (a0 + its position in the step).

Stored matrices hold counts, not per-token frequencies. MoE-Infinity's matrices are counts over the
request's tokens; dividing a stored matrix by its request's tokens (or cur by the tokens so far)
changes no decision: the cosine ignores scale, and priorities are only ever compared with other
priorities from the same matrix. Keeping exact integers makes every dot product, norm and priority
exact, so the plain-Python oracle reproduces them bit for bit (float64 appears only in the cosine).

Match, after the step's update: m* = the stored matrix with the greatest cosine(cur, stored_m) =
dot_m / (|cur| |stored_m|), evaluated as dot_m / sqrt(|stored_m|^2) (|cur| is common); ties: the
most recently stored. No match when the collection is empty or every dot product is 0.

Priority of key k: stored[m*, k] (its count in the matched request) with a match, else cur_G[k] (its
count in the current request, i.e. the request's own frequency so far). Equal priorities: the older
last access ranks lower, a key never accessed (prefetched, still unused) lowest, and among those
the larger key.
The victim is the lowest-ranked resident that this step neither accessed nor admitted (a linear
scan over the residents, O(capacity)); none: nothing is replaced.

Demand. The step's misses in rank order (greater priority first; equal: router order): a free slot
admits; once full, a miss replaces the victim only when its priority >= the victim's; the first
miss that does not stops the step's demand admissions (later ones rank no better).

Prefetch (only with a match, when the step's layer n has a next layer n + 1 < L): the predicted set
is the `top` keys of layer n + 1 with the greatest priority > 0 under m* (ties: the more recent last
access, then the smaller key); keys of it already held (after the demand decisions) are skipped and
take no budget. Up to `budget` of the others, best first: a free slot admits; once full, the key
replaces the victim only when its priority is strictly greater, else prefetching stops for the step.
A key admitted (or accessed) by this step is never a victim in the same step.

Parameters: `history` (int >= 1, default 32), `top` (int >= 1, default 8), `budget` (int >= 0,
default 2; 0: no prefetch, matching still sets the eviction priority). Per step the work is
O(history x keys + capacity + E x top).

What MoE-Infinity does (read in its public code, TorchMoE/MoE-Infinity, moe_infinity/memory/
expert_tracer.py, expert_predictor.py, expert_prefetcher.py, expert_priority_score.py, and
core/prefetch/task_scheduler.cpp; the paper, v2 "Offloading-Efficient MoE Model Serving", describes
request-level expert activation matrices (EAM) and an EAM collection guiding prefetching and caching)
and how this policy simplifies it:
- matching: MoE-Infinity normalises each layer row of both matrices to sum 1, averages the per-layer
  cosines, and flattens the layers up to the current one in the stored matrices (so that only later
  layers discriminate); here one cosine over the whole flattened matrix (with fixed top-k every layer
  row of a request sums to tokens x top-k, so the layers weigh about equally), nothing flattened;
- collection: MoE-Infinity keeps a fixed-capacity collection, fills empty entries first and then
  replaces the entry matched least often (a persistent, preloaded prefix is never replaced); here a
  FIFO ring of the last `history` requests, nothing preloaded;
- prefetch: MoE-Infinity scores every expert of layers >= the current one in the matched matrix,
  weighted by a layer-distance decay (1 - (l - current) / (L + 1)), and queues all of them, best
  first, on its copy engine (demand fetches go first and drop queued prefetches of layers already
  passed); here only layer n + 1, at most `top` candidates and `budget` copies per step, each on
  the one FIFO copy engine of timed mode;
- eviction: MoE-Infinity protects the current prediction's experts from eviction and otherwise
  ranks by visit counts (and, in its priority-score variant, by current-request frequency x layer
  position x global frequency); here one priority, the matched request's count (or the current
  request's own count without a match), with recency as the tie break.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies._params import require_ints
from moecache.sim.policy import Policy, register

# meta indices
HELD, CAP, NUM_E, NUM_L, LAST_REQUEST, SERIAL, N_STORED, HEAD, CUR_NORM, BUDGET = range(10)


@nb.njit(cache=True, inline="always")
def _prio(cur_G, stored_KM, m, k):
    """Priority of key k: its count in stored matrix m (m >= 0), else in the current request."""
    return stored_KM[k, m] if m >= 0 else cur_G[k]


@nb.njit(cache=True, inline="always")
def _better(cur_G, stored_KM, last_G, m, a, b):
    """Whether key a ranks above key b: greater priority, then more recent last access, then smaller key."""
    pa = _prio(cur_G, stored_KM, m, a)
    pb = _prio(cur_G, stored_KM, m, b)
    return pa > pb or (pa == pb and (last_G[a] > last_G[b] or (last_G[a] == last_G[b] and a < b)))


@nb.njit(cache=True, inline="always")
def _victim(held_H, n, stamp_G, serial, cur_G, stored_KM, last_G, m):
    """The lowest-ranked held key that this step neither accessed nor admitted; -1 when none."""
    v = -1
    for j in range(n):
        k = held_H[j]
        if stamp_G[k] != serial and (v < 0 or _better(cur_G, stored_KM, last_G, m, v, k)):
            v = k
    return v


@nb.njit(cache=True, inline="always")
def _admit(held_H, hpos_G, n, k, admit_out, na):
    """Hold key k (held_H[:n] holds n keys) and list it as admitted; returns (n + 1, na + 1)."""
    held_H[n] = k
    hpos_G[k] = n
    admit_out[na] = k
    return n + 1, na + 1


@nb.njit(cache=True, inline="always")
def _evict(held_H, hpos_G, n, k, evict_out, ne):
    """Release held key k (the last held key takes its place) and list it as evicted; returns
    (n - 1, ne + 1)."""
    i = hpos_G[k]
    hpos_G[k] = -1
    n -= 1
    last = held_H[n]
    if i < n:
        held_H[i] = last
        hpos_G[last] = i
    evict_out[ne] = k
    return n, ne + 1


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def activation_match_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    cur_G, stored_KM, nrm_M, dot_M, last_G, stamp_G, held_H, hpos_G, miss, cand, meta = state
    num_keys = cur_G.shape[0]
    M = nrm_M.shape[0]
    nu = key_U.shape[0]
    # 1. a new request: push the finished one into the ring (the oldest is dropped) and restart cur
    if request != meta[LAST_REQUEST]:
        if meta[CUR_NORM] > 0:
            slot = meta[HEAD]
            for k in range(num_keys):
                stored_KM[k, slot] = cur_G[k]
                cur_G[k] = 0
            nrm_M[slot] = meta[CUR_NORM]
            meta[HEAD] = (slot + 1) % M
            meta[N_STORED] = min(meta[N_STORED] + 1, M)
            meta[CUR_NORM] = 0
            for m in range(M):
                dot_M[m] = 0
        meta[LAST_REQUEST] = request
    serial = meta[SERIAL] + 1
    meta[SERIAL] = serial
    ns = meta[N_STORED]
    # 2. the step's uses: cur, its squared norm, its dot products, recency
    cn = meta[CUR_NORM]
    for i in range(nu):
        k = key_U[i]
        u = np.int64(uses_U[i])
        c = cur_G[k]
        cn += (2 * c + u) * u
        cur_G[k] = c + u
        for m in range(ns):
            dot_M[m] += u * stored_KM[k, m]
        last_G[k] = a0 + i
        stamp_G[k] = serial
    meta[CUR_NORM] = cn
    # 3. match: the greatest cosine, oldest to newest so that the newest of equal cosines wins
    ms = -1
    best = 0.0
    head = meta[HEAD]
    for j in range(ns):
        m = (head - ns + j + M) % M
        d = dot_M[m]
        if d > 0:
            cs = d / np.sqrt(nrm_M[m])
            if cs >= best:
                best = cs
                ms = m
    # 4. demand: misses in rank order (stable insertion sort: router order among equal priorities)
    n = meta[HELD]
    cap = meta[CAP]
    nm = 0
    for i in range(nu):
        k = key_U[i]
        if hpos_G[k] < 0:
            p = _prio(cur_G, stored_KM, ms, k)
            j = nm
            while j > 0 and _prio(cur_G, stored_KM, ms, miss[j - 1]) < p:
                miss[j] = miss[j - 1]
                j -= 1
            miss[j] = k
            nm += 1
    na = 0
    ne = 0
    v = -2  # -2: victim not computed yet
    j = 0
    while j < nm:
        k = miss[j]
        j += 1
        if n >= cap:
            if v == -2:
                v = _victim(held_H, n, stamp_G, serial, cur_G, stored_KM, last_G, ms)
            if v < 0 or _prio(cur_G, stored_KM, ms, k) < _prio(cur_G, stored_KM, ms, v):
                j = nm  # later misses rank no better
                continue
            n, ne = _evict(held_H, hpos_G, n, v, evict_out, ne)
            v = -2
        n, na = _admit(held_H, hpos_G, n, k, admit_out, na)
    # 5. prefetch the matched request's best keys of the next layer
    E = meta[NUM_E]
    if ms >= 0 and nu > 0 and meta[BUDGET] > 0 and cap > 0 and key_U[0] // E + 1 < meta[NUM_L]:
        base = (key_U[0] // E + 1) * E
        top = cand.shape[0]
        nc = 0
        for e in range(E):
            k = base + e
            if stored_KM[k, ms] > 0 and (nc < top or _better(cur_G, stored_KM, last_G, ms, k, cand[nc - 1])):
                r = min(nc, top - 1)
                while r > 0 and _better(cur_G, stored_KM, last_G, ms, k, cand[r - 1]):
                    cand[r] = cand[r - 1]
                    r -= 1
                cand[r] = k
                nc = min(nc + 1, top)
        npf = 0
        c = 0
        v = -2
        while c < nc and npf < meta[BUDGET]:
            k = cand[c]
            c += 1
            if hpos_G[k] >= 0:
                continue  # held: takes no budget
            if n >= cap:
                if v == -2:
                    v = _victim(held_H, n, stamp_G, serial, cur_G, stored_KM, last_G, ms)
                if v < 0 or not stored_KM[k, ms] > stored_KM[v, ms]:
                    c = nc  # stop prefetching for this step
                    continue
                n, ne = _evict(held_H, hpos_G, n, v, evict_out, ne)
                v = -2
            n, na = _admit(held_H, hpos_G, n, k, admit_out, na)
            stamp_G[k] = serial
            npf += 1
    meta[HELD] = n
    return na, ne


@register
class ActivationMatch(Policy):
    name = "activation_match"
    step = activation_match_step
    state_fields = (
        "cur_G", "stored_KM", "nrm_M", "dot_M",  # the current and the stored matrices, norms, dot products
        "last_G", "stamp_G", "held_H", "hpos_G",  # recency, the held keys
        "miss", "cand", "meta",  # the step's scratch, scalars
    )  # fmt: skip
    defaults = {"history": 32, "top": 8, "budget": 2}
    prefetches = True

    def __init__(self, **params):
        super().__init__(**params)
        require_ints(self, history=1, top=1, budget=0)

    def init_state(self, trace, capacity: int) -> tuple:
        L, E = trace.num_layers, trace.num_experts
        n = trace.num_keys
        M = int(self.params["history"])
        meta = np.zeros(10, np.int64)
        meta[CAP] = capacity
        meta[NUM_E] = E
        meta[NUM_L] = L
        meta[LAST_REQUEST] = -1
        meta[BUDGET] = int(self.params["budget"])
        return (
            np.zeros(n, np.int64),  # cur_G: uses per key in the current request
            np.zeros((n, M), np.int64),  # stored_KM: column m = the stored matrix in ring slot m
            np.zeros(M, np.int64),  # nrm_M: squared norms of the stored matrices
            np.zeros(M, np.int64),  # dot_M: cur . stored_m
            np.full(n, -1, np.int64),  # last_G: last access index
            np.full(n, -1, np.int64),  # stamp_G: serial of the last step that accessed or admitted k
            np.zeros(max(capacity, 1), np.int64),  # held_H: the held keys, in no order
            np.full(n, -1, np.int64),  # hpos_G: index in held_H, -1: not held
            np.zeros(n, np.int64),  # miss: the step's misses, ranked
            np.zeros(max(min(int(self.params["top"]), E), 1), np.int64),  # cand: the predicted set
            meta,
        )
