"""LRFU (Lee et al., 2001), the plan's "frequency-plus-recency scoring": score(k) = CRF(k) = sum over
past uses of F(now - t), F(x) = (1/2)^(lambda_ * x), x in tokens of the token clock.

`lambda_` spans the spectrum from frequency to recency: 0 is exactly cumulative LFU (every use weighs
1), 1 makes one use outweigh all older ones together (with one token per step, the ranking is then
by last use, as in LRU, up to the keys last used by the same forward step). t is the token clock of
the step that used k (a step's uses all count at its first token); uses weigh their token count.
Same rules as lfu with the CRF in place of the count: the step's scores first take its uses, then
its misses are considered in rank order (-score, key); free slots are filled; once full, the victim
is the resident with the lowest score, among equal scores the largest key, and a miss replaces it
only when its score is strictly greater. Scores of all keys are kept, resident or not. (Lee et al.'s
buffer cache instead always replaces the lowest-CRF block on a miss; the admission rule here is the
plan's LFU rule, so that lrfu and the LFU family differ only in the score.)

How it differs from lfu_decay: the same exponential kernel, so lrfu(lambda_) ranks exactly as
lfu_decay(half_life_tokens=1/lambda_) would without rounding; what differs is the parameterisation:
a decay rate per token on LRFU's [0, 1] scale, whose end 0 (no decay, i.e. cumulative LFU) the
half-life cannot express. Storage is that of lfu_decay: scores scaled by 2^(lambda_ * now), divided by
a common power of two (exact) before the scale overflows; uses more than about 1100 / lambda_ tokens
old may fall to zero. lambda_ 0 stores exact integer counts.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policies import _heap
from moecache.sim.policies.lfu import frequency_arrays, note_use, settle
from moecache.sim.policy import Policy, register

RENORM_EXPONENT = 512  # rescale once the weight of a new use exceeds 2^512


@nb.njit(cache=True, _nrt=False)  # no reference counting: see lfu.py
def lrfu_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_K, admit_out, evict_out):
    score_K, heap, pos_K, miss, meta, fmeta = state  # meta: [held, capacity, scale exponent m]
    n = meta[0]
    x = fmeta[0] * clock  # fmeta[0]: lambda_
    q = math.floor(x)
    e = np.int64(q) - meta[2]
    if e > RENORM_EXPONENT:  # divide every stored score by 2^e: exact (until scores underflow)
        f = 2.0 ** (-e)
        for k in range(score_K.shape[0]):
            score_K[k] *= f
        meta[2] += e
        e = 0
        _heap.heapify(heap, pos_K, score_K, n)  # underflow may have made unequal scores equal
    w = 2.0 ** (x - q) * 2.0**e  # 2^(lambda_ * clock - m)
    nm = 0
    best = -1
    for i in range(key_U.shape[0]):
        k = key_U[i]
        score_K[k] += uses_U[i] * w
        nm, best = note_use(heap, pos_K, score_K, n, miss, nm, best, k)
    n, na, ne = settle(heap, pos_K, score_K, n, meta[1], miss, nm, best, admit_out, evict_out)
    meta[0] = n
    return na, ne


@register
class LRFU(Policy):
    name = "lrfu"
    step = lrfu_step
    defaults = {"lambda_": 0.01}

    def __init__(self, **params):
        super().__init__(**params)
        lam = self.params["lambda_"]
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0 <= lam <= 1:
            raise MoecacheError(f"policy lrfu: lambda_ must be a number from 0 to 1, got {lam!r}")

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        heap, pos_K, miss = frequency_arrays(n, capacity)
        meta = np.array([0, capacity, 0], np.int64)
        fmeta = np.array([float(self.params["lambda_"])], np.float64)
        return np.zeros(n, np.float64), heap, pos_K, miss, meta, fmeta
