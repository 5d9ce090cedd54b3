"""LRU with per-layer budgets: the capacity is split into one budget per MoE layer, and each layer
runs LRU (same rules as lru) over its own keys within its own budget, evicting only its own keys.

`split` (see `layer_budgets`): "equal" gives every layer floor(C / L) slots and one more to each of
the C mod L lowest layer ids. "entropy" splits C in proportion to each layer's demand, its effective
number of experts: exp(Shannon entropy) of the layer's expert-use distribution (uses = tokens
selecting each expert, summed over the trace), in millionths of an expert. A layer whose routing
concentrates on few experts gets fewer slots; one spread evenly over n experts counts n. It is a
hindsight split, computed from the very trace being replayed. (Splitting by each layer's total uses
would be pointless: with fixed top-k routing every token selects k experts in every layer, so every
layer has the same uses and such a split always equals "equal".)

Rounding is by largest remainder (among equal remainders the lower layer id first). A layer never
gets more slots than it has experts: such a layer is held at num_experts and the rest is split again
among the others in proportion to their demand. Layers without demand (never used) share what is
left equally. Budgets always sum to the capacity.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policies.lfu import key_counts
from moecache.sim.policies.lru import lru_update
from moecache.sim.policy import Policy, register

SPLITS = ("equal", "entropy")
DEMAND_UNIT = 10**6  # demands are whole millionths of an expert, so equal demands tie exactly


def _largest_remainder(weights: list[int], seats: int) -> list[int]:
    """`seats` split in proportion to the integer `weights` (sum > 0) by largest remainder, exactly;
    among equal remainders the lower index first."""
    total = sum(weights)
    shares = [seats * w // total for w in weights]
    rest = seats - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: (-(seats * weights[i] % total), i))
    for i in order[:rest]:
        shares[i] += 1
    return shares


def effective_experts(uses_E) -> float:
    """exp(Shannon entropy) of one layer's expert-use distribution p_e = u_e / U:
    exp(log U - sum_e u_e log u_e / U), summed over the counts in sorted order (so it does not depend
    on which experts hold them). 0.0 for a layer never used."""
    counts = sorted(int(u) for u in uses_E if u > 0)
    total = sum(counts)
    if total == 0:
        return 0.0
    return math.exp(math.log(total) - sum(u * math.log(u) for u in counts) / total)


def layer_demands(uses_LE) -> list[int]:
    """Each layer's effective number of experts, rounded to whole millionths (DEMAND_UNIT)."""
    return [round(effective_experts(row) * DEMAND_UNIT) for row in uses_LE]


def layer_budgets(uses_LE, capacity: int, num_experts: int, split: str) -> np.ndarray:
    """Slots per layer (int64 [L]) summing to `capacity` (0 <= capacity <= L * num_experts), from the
    uses of each layer's experts over the trace (`uses_LE`: L rows of num_experts counts)."""
    num_layers = len(uses_LE)
    if split not in SPLITS:
        raise MoecacheError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not 0 <= capacity <= num_layers * num_experts:
        raise MoecacheError(f"capacity {capacity} outside 0..{num_layers * num_experts}")
    budgets = [0] * num_layers
    free = list(range(num_layers))  # layers whose budget is not yet held at num_experts
    left = capacity
    if split == "entropy":
        demand = layer_demands(uses_LE)
        while free:
            total = sum(demand[i] for i in free)
            if total == 0:
                break
            full = [i for i in free if left * demand[i] >= num_experts * total]
            if not full:
                for i, b in zip(free, _largest_remainder([demand[i] for i in free], left), strict=True):
                    budgets[i] = b
                return np.array(budgets, np.int64)
            for i in full:
                budgets[i] = num_experts
            left -= num_experts * len(full)
            free = [i for i in free if i not in full]
    # equal split (or the rest of an entropy split over layers that were never used)
    for j, i in enumerate(free):
        budgets[i] = left // len(free) + (1 if j < left % len(free) else 0)
    return np.array(budgets, np.int64)


def trace_budgets(trace, capacity: int, split: str) -> np.ndarray:
    """layer_budgets from the uses of every key of the trace being replayed. The "equal" split needs
    only the shape (a ModelShape in the runtime); "entropy" reads the whole trace (hindsight)."""
    if split == "equal":
        uses_LE = np.zeros((trace.num_layers, trace.num_experts), np.int64)
        return layer_budgets(uses_LE, capacity, trace.num_experts, split)
    if not hasattr(trace, "key_A"):
        raise MoecacheError(
            f"split={split} is a hindsight split over the whole replayed trace: it exists only in the "
            "simulator; use split=equal in the runtime"
        )
    uses_LE = key_counts(trace).reshape(trace.num_layers, trace.num_experts)
    return layer_budgets(uses_LE, capacity, trace.num_experts, split)


def check_split(policy: str, split) -> str:
    if split not in SPLITS:
        raise MoecacheError(f"policy {policy}: split must be one of {list(SPLITS)}, got {split!r}")
    return split


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def lru_per_layer_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    prev_G, next_G, held_L, budget_L, meta = state  # meta: [num_experts, num_keys]
    n_admit = 0
    n_evict = 0
    if key_U.shape[0] > 0:
        layer = key_U[0] // meta[0]  # every key of a layer step belongs to its layer
        head = meta[1] + layer  # the layer's list sentinel
        held_L[layer], n_admit, n_evict = lru_update(
            prev_G, next_G, head, held_L[layer], budget_L[layer], key_U, hit_U, admit_out, evict_out,
        )  # fmt: skip
    return n_admit, n_evict


class PerLayerPolicy(Policy):
    """Base of the per-layer-budget policies: the `split` parameter and the budgets it gives."""

    defaults = {"split": "equal"}

    def __init__(self, **params):
        super().__init__(**params)
        check_split(self.name, self.params["split"])

    def budgets(self, trace, capacity: int) -> np.ndarray:
        return trace_budgets(trace, capacity, self.params["split"])


@register
class LRUPerLayer(PerLayerPolicy):
    name = "lru_per_layer"
    step = lru_per_layer_step
    state_fields = ("prev_G", "next_G", "held_L", "budget_L", "meta")

    def init_state(self, trace, capacity: int) -> tuple:
        n, layers = trace.num_keys, trace.num_layers
        sentinels = n + np.arange(layers)  # index n + l is layer l's list sentinel
        prev_G = np.zeros(n + layers, np.int64)
        next_G = np.zeros(n + layers, np.int64)
        prev_G[sentinels] = sentinels
        next_G[sentinels] = sentinels
        return (
            prev_G,
            next_G,
            np.zeros(layers, np.int64),
            self.budgets(trace, capacity),
            np.array([trace.num_experts, n], np.int64),
        )
