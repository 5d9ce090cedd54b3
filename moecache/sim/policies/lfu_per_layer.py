"""Cumulative LFU with per-layer budgets: the capacity is split into one budget per MoE layer (the
`split` rules of lru_per_layer: "equal", or "entropy", a hindsight split in proportion to each
layer's effective number of experts, exp(Shannon entropy) of its expert uses over the very trace
being replayed; a split by total uses would always equal "equal", since with fixed top-k routing
every layer has the same uses), and each layer runs cumulative LFU (same rules as lfu: counts of all
keys grow by their uses, misses in rank order (-count, key), the victim the layer's resident with the
lowest count, among equal counts the largest key, replaced only by a strictly greater count) within
its own budget, evicting only its own keys. Each layer's residents sit in their own indexed heap, a
slice of one array.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies.lfu import note_use, settle
from moecache.sim.policies.lru_per_layer import PerLayerPolicy
from moecache.sim.policy import register


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lfu_per_layer_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    count_G, heap, pos_G, miss, off_L, held_L, layer_G = state
    na = 0
    ne = 0
    if key_U.shape[0] > 0:
        layer = layer_G[key_U[0]]  # every key of a layer step belongs to its layer
        lo = off_L[layer]
        hi = off_L[layer + 1]
        h = heap[lo:hi]  # the layer's heap; pos_G holds positions within it
        n = held_L[layer]
        nm = 0
        best = -1
        for i in range(key_U.shape[0]):
            k = key_U[i]
            count_G[k] += uses_U[i]
            nm, best = note_use(h, pos_G, count_G, n, miss, nm, best, k)
        n, na, ne = settle(h, pos_G, count_G, n, hi - lo, miss, nm, best, admit_out, evict_out)
        held_L[layer] = n
    return na, ne


@register
class LFUPerLayer(PerLayerPolicy):
    name = "lfu_per_layer"
    step = lfu_per_layer_step
    state_fields = ("count_G", "heap", "pos_G", "miss", "off_L", "held_L", "layer_G")

    def init_state(self, trace, capacity: int) -> tuple:
        n, layers = trace.num_keys, trace.num_layers
        off_L = np.zeros(layers + 1, np.int64)
        np.cumsum(self.budgets(trace, capacity), out=off_L[1:])
        return (
            np.zeros(n, np.int64),
            np.zeros(max(capacity, 1), np.int64),
            np.full(n, -1, np.int64),
            np.zeros(n, np.int64),
            off_L,
            np.zeros(layers, np.int64),
            np.arange(n, dtype=np.int64) // trace.num_experts,  # layer of each key
        )
