"""Belady's offline optimum (MIN): on a miss with a full cache, evict the resident whose next use is
farthest in the future; with bypass, a miss whose own next use is at least as far is not admitted.

The next use of a key at a step is the access index of its first access in a later step (keys are
distinct within a step, so this is simply its next access), or infinity (the number of accesses) when
it is never used again. At every step the next uses of the step's hits are first moved on to their
next accesses; then the misses are considered in router order: a free slot admits the miss; once
full, the victim is the resident with the farthest next use, among equal next uses (only possible
for residents never used again) the larger key. With `bypass` (default) the miss replaces the victim
only when the victim's next use is strictly later than the miss's own, otherwise it skips the cache;
without bypass every miss is admitted and the victim evicted (even one used sooner than the miss).
A key admitted earlier in the same step can be the victim of a later miss: the step lists it as
evicted all the same, and apply_step (moecache/sim/visit.py) cancels the pair (no copy, no eviction).

With bypass, the result is optimal over all demand schedules (hits from the snapshot before a step,
admissions resident from the next step): once the cache is full, after each step the residents are
the `capacity` keys of (residents + misses) used soonest, whatever the order of the misses. Belady
minimises misses, not transfers: while slots are free it admits even keys never used again.

`warm=False` (default) starts empty like every demand policy: the upper bound on their hits.
`warm=True` starts with the `capacity` soonest-used keys resident, free of charge (ranked by first
access index, never-used keys last, among them the smaller key first): the bound that also covers
the static placements, which start resident.

Residents sit in an indexed binary max-heap of packed priorities next_use << shift | key (one
int64 compare per level, no indirection), so its top is the victim.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policy import Policy, register


@nb.njit(cache=True)
def next_uses(key_A, num_keys):
    """next_A[a]: index of the next access of key_A[a] (len(key_A) if none); first_G[k]: index of
    k's first access (len(key_A) if never used). One backward pass."""
    n = key_A.shape[0]
    next_A = np.empty(n, np.int64)
    first_G = np.full(num_keys, n, np.int64)
    for a in range(n - 1, -1, -1):
        k = key_A[a]
        next_A[a] = first_G[k]
        first_G[k] = a
    return next_A, first_G


# The heap: heap[:n] holds packed priorities c = next_use << shift | key, the largest on top (the
# farthest next use; among equal next uses the larger key); pos_G[k] is key k's index (-1: none).
# Helpers are inlined, the step has one return and no loop is left both by its condition and by a
# `break`: otherwise numba keeps the reference-count updates of the array arguments (see _heap).


@nb.njit(cache=True, inline="always")
def _sift_up(heap, pos_G, mask, i, c):
    """Place priority c (not smaller than the one it replaces) at index i and restore the order."""
    while True:
        if i == 0:
            break
        p = (i - 1) >> 1
        q = heap[p]
        if q >= c:
            break
        heap[i] = q
        pos_G[q & mask] = i
        i = p
    heap[i] = c
    pos_G[c & mask] = i


@nb.njit(cache=True, inline="always")
def _sift_down(heap, pos_G, mask, n, i, c):
    """Place priority c (not larger than the one it replaces) at index i and restore the order."""
    while True:
        j = 2 * i + 1
        if j >= n:
            break
        q = heap[j]
        if j + 1 < n and heap[j + 1] > q:
            j += 1
            q = heap[j]
        if q <= c:
            break
        heap[i] = q
        pos_G[q & mask] = i
        i = j
    heap[i] = c
    pos_G[c & mask] = i


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def belady_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    next_A, heap, pos_G, meta = state  # meta: [held, capacity, bypass, shift]
    n = meta[0]
    cap = meta[1]
    bypass = meta[2] != 0
    shift = meta[3]
    mask = (np.int64(1) << shift) - 1
    m = key_U.shape[0]
    n_admit = 0
    n_evict = 0
    for i in range(m):
        if hit_U[i]:
            k = key_U[i]
            # the next use only moves later: the priority grows
            _sift_up(heap, pos_G, mask, pos_G[k], (next_A[a0 + i] << shift) | k)
    if cap > 0:
        for i in range(m):
            if hit_U[i]:
                continue
            k = key_U[i]
            c = (next_A[a0 + i] << shift) | k
            if n < cap:
                _sift_up(heap, pos_G, mask, n, c)
                n += 1
            else:
                top = heap[0]
                if bypass and (top >> shift) <= (c >> shift):  # the victim is used no later: bypass
                    continue
                victim = top & mask
                pos_G[victim] = -1
                _sift_down(heap, pos_G, mask, n, 0, c)
                evict_out[n_evict] = victim
                n_evict += 1
            admit_out[n_admit] = k
            n_admit += 1
        meta[0] = n
    return n_admit, n_evict


def warm_residents(first_G: np.ndarray, capacity: int) -> np.ndarray:
    """The `capacity` keys used soonest, by (first access index, key), as int64 in that order."""
    order = np.lexsort((np.arange(len(first_G)), first_G))
    return order[:capacity].astype(np.int64)


@register
class Belady(Policy):
    """Offline: `init_state` needs the whole trace to be replayed (every key's next use), so this
    policy runs only in the simulator; the runtime refuses it."""

    name = "belady"
    step = belady_step
    offline = True  # init_state reads the future of the replayed trace
    state_fields = ("next_A", "heap", "pos_G", "meta")
    defaults = {"warm": False, "bypass": True}

    def __init__(self, **params):
        super().__init__(**params)
        for p in ("warm", "bypass"):
            if not isinstance(self.params[p], bool | np.bool_):
                raise MoecacheError(f"policy belady: {p} must be true or false, got {self.params[p]!r}")
        self.params = {p: bool(v) for p, v in self.params.items()}
        self.cold_start = not self.params["warm"]  # warm Belady starts resident, like the statics

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        next_A, first_G = next_uses(trace.key_A, n)
        shift = max(1, int(n - 1).bit_length())
        if (trace.num_accesses + 1) >> (62 - shift):
            raise MoecacheError(f"policy belady: {trace.num_accesses} accesses x {n} keys overflow int64")
        heap = np.zeros(max(capacity, 1), np.int64)
        pos_G = np.full(n, -1, np.int64)
        held = 0
        if self.params["warm"]:
            initial = warm_residents(first_G, capacity)
            held = len(initial)
            # farthest first use (then larger key) first: a descending array is in heap order
            heap[:held] = ((first_G[initial] << shift) | initial)[::-1]
            pos_G[initial[::-1]] = np.arange(held)
        meta = np.array([held, capacity, int(self.params["bypass"]), shift], np.int64)
        return next_A, heap, pos_G, meta

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        heap, meta = state[1], state[3]
        return np.sort(heap[: meta[0]] & ((1 << int(meta[3])) - 1)).astype(np.int32)
