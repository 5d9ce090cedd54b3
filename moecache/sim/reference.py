"""Plain Python reference implementations of the policies: the test oracle of the compiled ones.

Slow on purpose: dicts, lists and linear scans, written to be read, not run on real traces. Each
reference policy is a class taking (trace, capacity, **params) with
- `initial`: the keys resident before the first step (a set), and
- `step(s, keys, uses, hits, clock, request, resident) -> (admitted, evicted)`: s is the layer
  step's index in the trace, keys/uses/hits its distinct keys in access order, resident the set of
  keys holding a slot before the step (read only); it returns the net keys admitted and evicted.
`reference_replay` applies the driver semantics of moecache/sim/replay.py (hits from the snapshot
before the step; evictions, then admissions; an admitted key is resident from the next step).
Add a policy by adding its class to REFERENCES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from moecache.sim.trace_arrays import TraceArrays


def per_key_uses(trace: TraceArrays) -> dict[int, int]:
    """Uses of every key over the whole trace (keys never used: absent)."""
    counts: dict[int, int] = {}
    for k, u in zip(trace.key_A.tolist(), trace.uses_A.tolist(), strict=True):
        counts[k] = counts.get(k, 0) + u
    return counts


class RefLRU:
    """Most recent last; a step's hits are refreshed (access order) before its misses are admitted
    (router order); an admitted key evicted again in the same step cancels out."""

    def __init__(self, trace: TraceArrays, capacity: int):
        self.capacity = capacity
        self.order: list[int] = []  # keys holding a slot, least recently used first
        self.initial: set[int] = set()

    def step(self, s, keys, uses, hits, clock, request, resident):
        for k, hit in zip(keys, hits, strict=True):
            if hit:
                self.order.remove(k)
                self.order.append(k)
        admitted, evicted = [], []
        if self.capacity == 0:
            return admitted, evicted
        for k, hit in zip(keys, hits, strict=True):
            if hit:
                continue
            if len(self.order) == self.capacity:
                victim = self.order.pop(0)
                if victim in admitted:
                    admitted.remove(victim)
                else:
                    evicted.append(victim)
            self.order.append(k)
            admitted.append(k)
        return admitted, evicted


class RefStaticHindsight:
    """The `capacity` keys with the most uses in this trace, ranked by (-count, key)."""

    def __init__(self, trace: TraceArrays, capacity: int):
        counts = per_key_uses(trace)
        ranked = sorted(range(trace.num_keys), key=lambda k: (-counts.get(k, 0), k))
        self.initial = set(ranked[:capacity])

    def step(self, s, keys, uses, hits, clock, request, resident):
        return [], []


class RefStaticCold:
    """Keys 0 .. capacity-1."""

    def __init__(self, trace: TraceArrays, capacity: int):
        self.initial = set(range(capacity))

    def step(self, s, keys, uses, hits, clock, request, resident):
        return [], []


class _RefScored:
    """The frequency policies' common admission rule over a score per key (`self.score`):
    misses in rank order (-score, key); free slots are filled; then a miss replaces the victim (the
    held key with the greatest (-score, key)) only when its score is strictly greater."""

    def __init__(self, trace: TraceArrays, capacity: int):
        self.capacity = capacity
        self.held: set[int] = set()
        self.score: dict[int, float] = {}
        self.initial: set[int] = set()

    def score_of(self, k):
        return self.score.get(k, 0)

    def update(self, keys, uses, clock, request):
        raise NotImplementedError

    def step(self, s, keys, uses, hits, clock, request, resident):
        self.update(keys, uses, clock, request)
        misses = sorted((k for k in keys if k not in self.held), key=lambda k: (-self.score_of(k), k))
        admitted, evicted = [], []
        for m in misses:
            if len(self.held) < self.capacity:
                self.held.add(m)
                admitted.append(m)
                continue
            if not self.held:
                continue
            victim = max(self.held, key=lambda k: (-self.score_of(k), k))
            if self.score_of(m) > self.score_of(victim):
                self.held.remove(victim)
                self.held.add(m)
                if victim in admitted:
                    admitted.remove(victim)
                else:
                    evicted.append(victim)
                admitted.append(m)
        return admitted, evicted


class RefLFU(_RefScored):
    """Cumulative counts; `reset_per_request` restores the initial counts when the request changes;
    `init_counts` is a dict key -> count (the reference does not read files)."""

    def __init__(self, trace, capacity, reset_per_request=False, init_counts=None):
        super().__init__(trace, capacity)
        self.reset = reset_per_request
        self.init = dict(init_counts or {})
        self.score = dict(self.init)
        self.last_request = None

    def update(self, keys, uses, clock, request):
        if self.reset and request != self.last_request:
            self.score = dict(self.init)
        self.last_request = request
        for k, u in zip(keys, uses, strict=True):
            self.score[k] = self.score.get(k, 0) + u


def decay_weight(clock: int, half_life: float) -> float:
    """2^(clock / half_life), computed as lfu_decay does: 2^frac * 2^floor (exact scaling)."""
    x = clock / half_life
    q = math.floor(x)
    return 2.0 ** (x - q) * math.ldexp(1.0, q)


class RefLFUDecay(_RefScored):
    """score = sum of uses * 2^(-(now - t) / h); stored times 2^(now / h), which leaves the order of
    scores at any one time unchanged (all decay by the same factor)."""

    def __init__(self, trace, capacity, half_life_tokens=128):
        super().__init__(trace, capacity)
        self.h = float(half_life_tokens)

    def update(self, keys, uses, clock, request):
        w = decay_weight(clock, self.h)
        for k, u in zip(keys, uses, strict=True):
            self.score[k] = self.score.get(k, 0.0) + u * w


class RefLFUWindow(_RefScored):
    """count = uses by the steps with clock t > now - window_tokens."""

    def __init__(self, trace, capacity, window_tokens=1024):
        super().__init__(trace, capacity)
        self.window = window_tokens
        self.history: list[tuple[int, int, int]] = []  # (clock, key, uses) of every past step

    def update(self, keys, uses, clock, request):
        for k, u in zip(keys, uses, strict=True):
            self.history.append((clock, k, u))
        self.score = {}
        for t, k, u in self.history:
            if t > clock - self.window:
                self.score[k] = self.score.get(k, 0) + u


INFINITY = math.inf


class RefBelady:
    """Belady's MIN. next use of k after step s = index of its first access in a later step
    (infinity if none). Misses in router order: a free slot admits; once full, the victim is the
    held key with the greatest (next use, key); with bypass it is replaced only when its next use
    is strictly later than the miss's, without bypass always. `warm`: starts with the `capacity`
    keys of smallest (first access index, key) resident."""

    def __init__(self, trace, capacity, warm=False, bypass=True):
        self.trace = trace
        self.capacity = capacity
        self.bypass = bypass
        self.held: set[int] = set()
        if warm:
            ranked = sorted(range(trace.num_keys), key=lambda k: (self.next_use_from(k, 0), k))
            self.held = set(ranked[:capacity])
        self.initial = set(self.held)

    def next_use_from(self, k, a):
        """Index of the first access of k at or after access index a (infinity if none)."""
        for b in range(a, self.trace.num_accesses):
            if self.trace.key_A[b] == k:
                return b
        return INFINITY

    def step(self, s, keys, uses, hits, clock, request, resident):
        after = int(self.trace.start_S[s + 1])
        nxt = {k: self.next_use_from(k, after) for k in self.held | set(keys)}
        admitted, evicted = [], []
        if self.capacity == 0:
            return admitted, evicted
        for k, hit in zip(keys, hits, strict=True):
            if hit:
                continue
            if len(self.held) == self.capacity:
                victim = max(self.held, key=lambda v: (nxt[v], v))
                if self.bypass and not nxt[victim] > nxt[k]:
                    continue
                self.held.remove(victim)
                if victim in admitted:
                    admitted.remove(victim)
                else:
                    evicted.append(victim)
            self.held.add(k)
            admitted.append(k)
        return admitted, evicted


class RefLRFU:
    """score = CRF = sum over past uses of uses * (1/2)^(lambda_ * (now - t)), recomputed from the
    whole history at every step, for all the step's keys before any admission. Misses in router
    order: a free slot admits; once full, the miss always replaces the victim, the held key with the
    greatest (-score, key), even one admitted earlier in this step (the two then cancel out)."""

    def __init__(self, trace, capacity, lambda_=0.01):
        self.capacity = capacity
        self.lam = lambda_
        self.history: list[tuple[int, int, int]] = []  # (clock, key, uses) of every past step
        self.score: dict[int, float] = {}
        self.held: set[int] = set()
        self.initial: set[int] = set()

    def step(self, s, keys, uses, hits, clock, request, resident):
        for k, u in zip(keys, uses, strict=True):
            self.history.append((clock, k, u))
        self.score = {}
        for t, k, u in self.history:
            self.score[k] = self.score.get(k, 0.0) + u * 0.5 ** (self.lam * (clock - t))
        admitted, evicted = [], []
        if self.capacity == 0:
            return admitted, evicted
        for m in [k for k in keys if k not in self.held]:  # a hit evicted by this step stays out
            if len(self.held) == self.capacity:
                victim = max(self.held, key=lambda k: (-self.score.get(k, 0.0), k))
                self.held.remove(victim)
                if victim in admitted:
                    admitted.remove(victim)
                else:
                    evicted.append(victim)
            self.held.add(m)
            admitted.append(m)
        return admitted, evicted


def ref_layer_demand(uses: list[int]) -> int:
    """exp(-sum p log p) over the layer's expert-use shares p = u / U (the counts taken in sorted
    order), in whole millionths of an expert; 0 for a layer never used."""
    total = sum(uses)
    if total == 0:
        return 0
    entropy = -math.fsum(u / total * math.log(u / total) for u in sorted(uses) if u > 0)
    return round(math.exp(entropy) * 10**6)


def ref_layer_budgets(
    uses_per_layer: list[list[int]], capacity: int, num_experts: int, split: str
) -> list[int]:
    """equal: floor(C / L) each, one more for each of the C mod L lowest layers. entropy: each
    layer's demand is its effective number of experts (ref_layer_demand of its experts' uses);
    exact quotas C * demand_l / total; a quota above num_experts is held at num_experts and the rest
    shared again among the other layers by their demand; then floors, and one more slot for each of
    the largest remainders (ties: lower layer first). Layers without demand share the rest equally."""
    num_layers = len(uses_per_layer)
    demand = [ref_layer_demand(list(row)) for row in uses_per_layer]
    budgets = [0] * num_layers
    open_layers = list(range(num_layers))
    left = capacity
    if split == "entropy":
        while open_layers and sum(demand[i] for i in open_layers) > 0:
            total = sum(demand[i] for i in open_layers)
            quota = {i: Fraction(left * demand[i], total) for i in open_layers}
            capped = [i for i in open_layers if quota[i] >= num_experts]
            if not capped:
                for i in open_layers:
                    budgets[i] = math.floor(quota[i])
                rest = left - sum(budgets[i] for i in open_layers)
                by_remainder = sorted(open_layers, key=lambda i: (-(quota[i] - math.floor(quota[i])), i))
                for i in by_remainder[:rest]:
                    budgets[i] += 1
                return budgets
            for i in capped:
                budgets[i] = num_experts
                open_layers.remove(i)
                left -= num_experts
    for j, i in enumerate(open_layers):
        budgets[i] = left // len(open_layers) + (1 if j < left % len(open_layers) else 0)
    return budgets


class _RefPerLayer:
    """One instance of the global reference policy `inner` per layer, with the layer's budget."""

    inner: type

    def __init__(self, trace, capacity, split="equal"):
        uses = [[0] * trace.num_experts for _ in range(trace.num_layers)]
        for k, u in zip(trace.key_A.tolist(), trace.uses_A.tolist(), strict=True):
            uses[k // trace.num_experts][k % trace.num_experts] += u
        self.budgets = ref_layer_budgets(uses, capacity, trace.num_experts, split)
        self.layers = [self.inner(trace, b) for b in self.budgets]
        self.num_experts = trace.num_experts
        self.initial: set[int] = set()

    def step(self, s, keys, uses, hits, clock, request, resident):
        if not keys:
            return [], []
        layer = keys[0] // self.num_experts
        assert all(k // self.num_experts == layer for k in keys)
        return self.layers[layer].step(s, keys, uses, hits, clock, request, resident)


class RefLRUPerLayer(_RefPerLayer):
    inner = RefLRU


class RefLFUPerLayer(_RefPerLayer):
    inner = RefLFU


REFERENCES: dict[str, type] = {
    "lru": RefLRU,
    "static_hindsight": RefStaticHindsight,
    "static_cold": RefStaticCold,
    "lfu": RefLFU,
    "lfu_decay": RefLFUDecay,
    "lfu_window": RefLFUWindow,
    "belady": RefBelady,
    "lrfu": RefLRFU,
    "lru_per_layer": RefLRUPerLayer,
    "lfu_per_layer": RefLFUPerLayer,
}


@dataclass
class ReferenceResult:
    hit_A: np.ndarray  # bool
    admissions: int
    evictions: int


def reference_run(trace: TraceArrays, name: str, capacity: int, **params) -> ReferenceResult:
    """Replay `trace` through the reference policy `name` in instant mode."""
    policy = REFERENCES[name](trace, capacity, **params)
    resident = set(policy.initial)
    assert len(resident) <= capacity
    hit_A = np.zeros(trace.num_accesses, bool)
    admissions = evictions = 0
    for s in range(trace.num_steps):
        a0, a1 = int(trace.start_S[s]), int(trace.start_S[s + 1])
        keys = trace.key_A[a0:a1].tolist()
        uses = trace.uses_A[a0:a1].tolist()
        hits = [k in resident for k in keys]
        hit_A[a0:a1] = hits
        admitted, evicted = policy.step(
            s, keys, uses, hits, int(trace.clock_S[s]), int(trace.request_S[s]), frozenset(resident)
        )
        for k in evicted:
            assert k in resident, f"step {s}: evicts {k}, which holds no slot"
            resident.remove(k)
        for k in admitted:
            assert k not in resident, f"step {s}: admits {k}, which already holds a slot"
            resident.add(k)
        assert len(resident) <= capacity, f"step {s}: {len(resident)} keys > capacity {capacity}"
        admissions += len(admitted)
        evictions += len(evicted)
    return ReferenceResult(hit_A, admissions, evictions)


def reference_replay(trace: TraceArrays, name: str, capacity: int, **params) -> np.ndarray:
    """Per-access hits (bool) of the reference policy `name` at `capacity` in instant mode."""
    return reference_run(trace, name, capacity, **params).hit_A
