"""Sliding-window LFU: count(k) = uses of k by the steps of the last `window_tokens` tokens.

A step's uses count at its clock t (its first token); at a step with clock c they are in the window
while t > c - window_tokens (so with one token per step: the current token and the W - 1 before it;
all layers of a forward share its clock). Same rules as lfu with the windowed count: the step first
expires the uses that left the window and adds its own, then considers its misses in rank order
(-count, key); free slots are filled; once full, the victim is the resident with the lowest windowed
count, among equal counts the largest key, and a miss replaces it only when its count is strictly
greater. Per-step uses wait in a ring buffer to be expired; counts of residents fall as uses expire,
so residents sit in an indexed min-heap (`_heap`) with decrease-key.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_ints
from moecache.sim.policies.lfu import frequency_arrays, note_use, settle
from moecache.sim.policy import Policy, register


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lfu_window_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    count_G, heap, pos_G, miss, ring_key, ring_uses, ring_t, meta = state
    # meta: [held, capacity, window, ring head, ring length]
    n = meta[0]
    size = ring_key.shape[0]
    head = meta[3]
    length = meta[4]
    oldest = clock - meta[2]  # uses at t <= oldest have left the window
    while length > 0 and ring_t[head] <= oldest:
        k = ring_key[head]
        count_G[k] -= ring_uses[head]
        if pos_G[k] >= 0:
            _heap.decreased(heap, pos_G, count_G, k)
        head += 1
        if head == size:
            head = 0
        length -= 1
    if length + key_U.shape[0] > size:
        raise ValueError("lfu_window: ring buffer of in-window uses is full")
    tail = head + length
    if tail >= size:
        tail -= size
    nm = 0
    best = -1
    for i in range(key_U.shape[0]):
        k = key_U[i]
        u = uses_U[i]
        count_G[k] += u
        ring_key[tail] = k
        ring_uses[tail] = u
        ring_t[tail] = clock
        tail += 1
        if tail == size:
            tail = 0
        nm, best = note_use(heap, pos_G, count_G, n, miss, nm, best, k)
    meta[3] = head
    meta[4] = length + key_U.shape[0]
    n, na, ne = settle(heap, pos_G, count_G, n, meta[1], miss, nm, best, admit_out, evict_out)
    meta[0] = n
    return na, ne


@register
class LFUWindow(Policy):
    name = "lfu_window"
    step = lfu_window_step
    state_fields = ("count_G", "heap", "pos_G", "miss", "ring_key", "ring_uses", "ring_t", "meta")
    defaults = {"window_tokens": 1024}

    def __init__(self, **params):
        super().__init__(**params)
        require_ints(self, window_tokens=1)

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        w = int(self.params["window_tokens"])
        # In-window uses: the forwards before the current one hold < w tokens (<= top_k experts per
        # token and layer); the current one <= num_experts per layer.
        bound = trace.num_layers * (trace.top_k * (w - 1) + trace.num_experts)
        # A replayed trace cannot hold more accesses than it has (saves memory for long windows); the
        # runtime's ModelShape has no accesses, so the ring takes the bound.
        accesses = getattr(trace, "num_accesses", None)
        size = max(1, bound if accesses is None else min(bound, accesses))
        heap, pos_G, miss = frequency_arrays(n, capacity)
        meta = np.array([0, capacity, w, 0, 0], np.int64)
        return (
            np.zeros(n, np.int64), heap, pos_G, miss,
            np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int64), meta,
        )  # fmt: skip
