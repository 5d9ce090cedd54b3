"""Least recently used: on a miss with a full cache, evict the resident used longest ago.

Recency is updated for all of a step's hits (in access order) before its misses are admitted (in
router order), so a step's own hits are the most recent. State: a doubly linked list over keys,
most recent first. Ties cannot occur: every access has its own position in the order. A miss's
victim may be a key admitted earlier in the same step (more misses than slots); the step lists it as
evicted all the same, and apply_step (moecache/sim/visit.py) cancels the pair: no copy, no eviction.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policy import Policy, register


@nb.njit(cache=True, inline="always", _nrt=False)
def _unlink(prev_G, next_G, k):
    p, n = prev_G[k], next_G[k]
    next_G[p] = n
    prev_G[n] = p


@nb.njit(cache=True, inline="always", _nrt=False)
def _push_front(prev_G, next_G, head, k):
    first = next_G[head]
    prev_G[k] = head
    next_G[k] = first
    prev_G[first] = k
    next_G[head] = k


@nb.njit(cache=True, inline="always", _nrt=False)
def lru_update(prev_G, next_G, head, held, cap, key_U, hit_U, admit_out, evict_out):
    """One step of LRU over the list behind sentinel `head` holding `held` of `cap` slots: the step's
    hits move to the front (in access order), then each miss is admitted at the front, evicting the
    back when full (even a key admitted by this step: apply_step cancels the pair). Returns (held,
    n_admit, n_evict)."""
    for i in range(key_U.shape[0]):
        if hit_U[i]:
            _unlink(prev_G, next_G, key_U[i])
            _push_front(prev_G, next_G, head, key_U[i])
    n_admit = 0
    n_evict = 0
    if cap == 0:
        return held, 0, 0
    for i in range(key_U.shape[0]):
        if hit_U[i]:
            continue
        k = key_U[i]
        if held == cap:
            victim = prev_G[head]
            _unlink(prev_G, next_G, victim)
            held -= 1
            evict_out[n_evict] = victim
            n_evict += 1
        _push_front(prev_G, next_G, head, k)
        held += 1
        admit_out[n_admit] = k
        n_admit += 1
    return held, n_admit, n_evict


@nb.njit(_nrt=False)
def lru_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    prev_G, next_G, meta = state  # meta: [head sentinel, keys holding a slot, capacity]
    held, n_admit, n_evict = lru_update(
        prev_G, next_G, meta[0], meta[1], meta[2], key_U, hit_U, admit_out, evict_out
    )
    meta[1] = held
    return n_admit, n_evict


@register
class LRU(Policy):
    name = "lru"
    step = lru_step
    state_fields = ("prev_G", "next_G", "meta")

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        prev_G = np.full(n + 1, n, np.int64)  # index n is the list's head sentinel
        next_G = np.full(n + 1, n, np.int64)
        return prev_G, next_G, np.array([n, 0, capacity], np.int64)
