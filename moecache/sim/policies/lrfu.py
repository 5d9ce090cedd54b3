"""LRFU (Lee et al., IEEE Trans. Computers 2001), the plan's "frequency-plus-recency scoring":
score(k) = CRF(k) = sum over past uses of F(now - t), F(x) = (1/2)^(lambda_ * x), x in tokens of the
token clock, and a miss is always admitted, in place of the resident with the smallest CRF.

t is the token clock of the step that used k (a step's uses all count at its first token); uses
weigh their token count. At every step the CRFs of all the step's keys (hits and misses) first take
its uses, so the step's hits are protected by their fresh scores; then its misses are admitted in
router order: into a free slot while there is one, else in place of the victim, the resident with
the smallest CRF, among equal CRFs the largest key. The miss itself is never its own victim, but a
key admitted earlier in the same step may be: the step lists it as evicted all the same, and
apply_step (moecache/sim/visit.py) cancels the pair (no copy, no eviction), as in lru. CRFs of all
keys are kept, resident or not. Residents sit in an indexed min-heap (`_heap`), top = victim.

`lambda_` spans the spectrum from frequency to recency. 0: every use weighs 1, so the victim is the
resident with the fewest uses (cumulative LFU with always-admit; equal counts: the larger key). A
tiny lambda_ also ranks by uses, but among equal counts the older uses go first. 1: one use
outweighs all older ones together, so on one layer with one expert per one-token step the victim is
the least recently used resident, as in LRU. Unlike LRU, all the layer steps (and tokens) of one
forward step share its clock: keys last used by the same forward step rank by their uses in it,
then by their older uses, then by key, not by access order.

How it differs from lfu_decay: lfu_decay(half_life_tokens=h) has the same kernel (lambda_ = 1/h)
but the LFU family's admission rule: once full, a miss replaces the victim only when its score is
strictly greater, else it is not admitted (a tie never causes a transfer). lrfu always admits, so
every miss with a full cache costs a transfer, and a key used once still takes a slot, until a later
miss (perhaps of the same step) finds it the victim. (With the LFU family's rule it would replay
exactly as lfu_decay.)

Storage is that of lfu_decay: scores scaled by 2^(lambda_ * now), divided by a common power of two
(exact) before the scale overflows; uses more than about 1100 / lambda_ tokens old may fall to zero.
lambda_ 0 stores exact integer counts. At a tiny lambda_ the CRFs of different histories can differ by
less than a rounding error; their order is then the rounded one.
"""

from __future__ import annotations

import numba as nb

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_number
from moecache.sim.policies.lfu_decay import LFUDecay, decayed_score_state, note_decayed_uses
from moecache.sim.policy import Policy, register


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lrfu_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    score_G, heap, pos_G, miss, meta, fmeta = state  # meta: [held, capacity, scale exponent m]
    n = meta[0]
    cap = meta[1]
    # Every CRF first (hits sift down), misses kept in router order; fmeta[0]: lambda_. The misses'
    # best score goes unused: always-admit needs no "can any miss win" test.
    nm, _ = note_decayed_uses(score_G, heap, pos_G, n, meta, fmeta[0] * clock, key_U, uses_U, miss)
    na = 0
    ne = 0
    if cap > 0:
        for j in range(nm):
            m = miss[j]
            if n < cap:
                n = _heap.push(heap, pos_G, score_G, n, m)
            else:  # the victim is the heap's top: smallest CRF, then largest key
                evict_out[ne] = _heap.replace_top(heap, pos_G, score_G, n, m)
                ne += 1
            admit_out[na] = m
            na += 1
    meta[0] = n
    return na, ne


@register
class LRFU(Policy):
    name = "lrfu"
    step = lrfu_step
    state_fields = LFUDecay.state_fields  # lfu_decay's storage, lambda_ in place of the half-life
    defaults = {"lambda_": 0.01}

    def __init__(self, **params):
        super().__init__(**params)
        require_number(self, "lambda_", lambda lam: 0 <= lam <= 1, "a number from 0 to 1")

    def init_state(self, trace, capacity: int) -> tuple:
        return decayed_score_state(trace.num_keys, capacity, self.params["lambda_"])
