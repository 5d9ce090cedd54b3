"""Exponentially decayed LFU: score(k) = sum over past uses of 2^(-(now - t) / half_life_tokens).

t is the token clock of the step that used k (a step's uses all count at its first token) and `now`
the current step's clock; uses weigh their token count. Same rules as lfu with the score in place
of the count: the step's scores first take its uses, then its misses are considered in rank order
(-score, key); free slots are filled; once full, the victim is the resident with the lowest score,
among equal scores the largest key, and a miss replaces it only when its score is strictly greater.

All scores decay by the same factor, so they are stored multiplied by 2^(now / half_life): a use at t
adds uses * 2^(t / half_life) (computed as 2^frac(t/h) * 2^floor(t/h)). Before that factor overflows,
every stored score (the heap priorities) is divided by the same power of two, which is exact and keeps
the order, except that scores older than about 1000 half-lives fall to zero.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_number
from moecache.sim.policies.lfu import frequency_arrays, note_use, settle
from moecache.sim.policy import Policy, register

RENORM_EXPONENT = 512  # rescale once the weight of a new use exceeds 2^512


@nb.njit(cache=True, inline="always", _nrt=False)
def decayed_weight(score_G, heap, pos_G, n, meta, x):
    """The stored weight of a use at decay exponent x (age 1 = one halving), 2^(x - m), where
    stored scores are true scores x 2^m (m = meta[2]). Before 2^(x - m) overflows, every stored score
    (and so the heap of the n residents) is divided by the same power of two: exact, order-keeping,
    until old scores underflow."""
    q = math.floor(x)
    e = np.int64(q) - meta[2]
    if e > RENORM_EXPONENT:
        f = 2.0 ** (-e)
        for k in range(score_G.shape[0]):
            score_G[k] *= f
        meta[2] += e
        e = 0
        _heap.heapify(heap, pos_G, score_G, n)  # underflow may have made unequal scores equal
    return 2.0 ** (x - q) * 2.0**e


@nb.njit(cache=True, inline="always", _nrt=False)
def note_decayed_uses(score_G, heap, pos_G, n, meta, x, key_U, uses_U, miss):
    """The step's uses, each weighing decayed_weight(x), added to its keys' stored scores; then, as
    note_use does it, the held keys' heap order restored and the others listed in miss[:nm]. Returns
    (nm, best): the number of misses and their greatest score (-1.0: none). Shared by lfu_decay, lrfu
    and lfu_hysteresis."""
    w = decayed_weight(score_G, heap, pos_G, n, meta, x)
    nm = 0
    best = -1.0
    for i in range(key_U.shape[0]):
        k = key_U[i]
        score_G[k] += uses_U[i] * w
        nm, best = note_use(heap, pos_G, score_G, n, miss, nm, best, k)
    return nm, best


def decayed_score_state(num_keys: int, capacity: int, rate: float) -> tuple:
    """Fresh state of a decayed-score policy (lfu_decay, lrfu): stored scores (float64, all 0), the
    residents' heap, the misses' scratch, meta [held, capacity, scale exponent m] and fmeta [rate],
    the parameter its step turns the token clock into a decay exponent with."""
    heap, pos_G, miss = frequency_arrays(num_keys, capacity)
    meta = np.array([0, capacity, 0], np.int64)
    fmeta = np.array([float(rate)], np.float64)
    return np.zeros(num_keys, np.float64), heap, pos_G, miss, meta, fmeta


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lfu_decay_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    score_G, heap, pos_G, miss, meta, fmeta = state  # meta: [held, capacity, scale exponent m]
    n = meta[0]
    # fmeta[0]: the half-life in tokens
    nm, best = note_decayed_uses(score_G, heap, pos_G, n, meta, clock / fmeta[0], key_U, uses_U, miss)
    n, na, ne = settle(heap, pos_G, score_G, n, meta[1], miss, nm, best, admit_out, evict_out)
    meta[0] = n
    return na, ne


@register
class LFUDecay(Policy):
    name = "lfu_decay"
    step = lfu_decay_step
    state_fields = ("score_G", "heap", "pos_G", "miss", "meta", "fmeta")
    defaults = {"half_life_tokens": 128}

    def __init__(self, **params):
        super().__init__(**params)
        require_number(self, "half_life_tokens", lambda h: h > 0, "a positive number")

    def init_state(self, trace, capacity: int) -> tuple:
        return decayed_score_state(trace.num_keys, capacity, self.params["half_life_tokens"])
