"""Plain Python reference implementations of the policies: the test oracle of the compiled ones.

Slow on purpose: dicts, lists and linear scans, written to be read, not run on real traces. Each
reference policy is a class taking (trace, capacity, **params) with
- `initial`: the keys resident before the first step (a set), and
- `step(s, keys, uses, hits, clock, request, resident) -> (admitted, evicted)`: s is the layer
  step's index in the trace, keys/uses/hits its distinct keys in access order, resident the set of
  keys holding a slot before the step (read only); it returns the net keys admitted and evicted.
`reference_run` applies the driver semantics of moecache/sim/replay.py (hits from the snapshot
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


def cancel_or_evict(victim: int, admitted: list[int], evicted: list[int]) -> None:
    """Evict `victim`, or, when this same step admitted it, drop that admission (no copy is made)."""
    if victim in admitted:
        admitted.remove(victim)
    else:
        evicted.append(victim)


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
                cancel_or_evict(victim, admitted, evicted)
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
                cancel_or_evict(victim, admitted, evicted)
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


# The compiled policies' `2.0 ** y` is compiled to exp2(y) (LLVM rewrites pow(2, y)); CPython's
# `2.0 ** y` calls pow, which differs from exp2 in the last bit for about 1 argument in 1,500: enough
# to break an exact tie of two scores the other way. math.exp2 (Python >= 3.11) is the same libm exp2.
_exp2 = getattr(math, "exp2", lambda y: 2.0**y)


def decay_weight(clock: int, half_life: float) -> float:
    """2^(clock / half_life), computed as lfu_decay does: 2^frac * 2^floor (exact scaling)."""
    x = clock / half_life
    q = math.floor(x)
    return _exp2(x - q) * math.ldexp(1.0, q)


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
        after = int(self.trace.start_V[s + 1])
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
                cancel_or_evict(victim, admitted, evicted)
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
                cancel_or_evict(victim, admitted, evicted)
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


class RefLFUHysteresis(RefLFUDecay):
    """lfu_decay's scores; once full, the victim is the held key of the greatest (-score, key) among
    those admitted at least `min_residency_tokens` tokens ago, replaced only when the miss's score
    exceeds (1 + hysteresis) x its score; no such victim ends the step's admissions."""

    def __init__(self, trace, capacity, half_life_tokens=256, hysteresis=0.25, min_residency_tokens=16):
        super().__init__(trace, capacity, half_life_tokens)
        self.margin = 1.0 + float(hysteresis)
        self.young = min_residency_tokens
        self.since: dict[int, int] = {}

    def step(self, s, keys, uses, hits, clock, request, resident):
        self.update(keys, uses, clock, request)
        misses = sorted((k for k in keys if k not in self.held), key=lambda k: (-self.score_of(k), k))
        admitted, evicted = [], []
        for m in misses:
            if len(self.held) < self.capacity:
                self.held.add(m)
                self.since[m] = clock
                admitted.append(m)
                continue
            eligible = [k for k in self.held if clock - self.since[k] >= self.young]
            if not eligible:
                break
            victim = max(eligible, key=lambda k: (-self.score_of(k), k))
            if not self.score_of(m) > self.margin * self.score_of(victim):
                break
            self.held.remove(victim)
            self.held.add(m)
            self.since[m] = clock
            cancel_or_evict(victim, admitted, evicted)
            admitted.append(m)
        return admitted, evicted


class RefProfileStatic:
    """The keys of the most uses in `profile` (a dict key -> count; the reference reads no files),
    ranked by (-count, key): the `capacity` best (global), or capacity // layers best of every layer
    and the remaining slots to the best keys left (per_layer)."""

    def __init__(self, trace, capacity, profile=None, split="global"):
        counts = dict(profile or {})
        rank = lambda k: (-counts.get(k, 0), k)  # noqa: E731
        if split == "global":
            self.initial = set(sorted(range(trace.num_keys), key=rank)[:capacity])
            return
        E, L = trace.num_experts, trace.num_layers
        chosen = set()
        for layer in range(L):
            chosen |= set(sorted(range(layer * E, (layer + 1) * E), key=rank)[: capacity // L])
        rest = sorted((k for k in range(trace.num_keys) if k not in chosen), key=rank)
        self.initial = chosen | set(rest[: capacity - (capacity // L) * L])

    def step(self, s, keys, uses, hits, clock, request, resident):
        return [], []


class _RefFilter:
    """An admission filter over a reference base (`base`, `base_params`): the base's step sees the
    step's hits and the misses `lets_through` keeps, with the uses `weigh` gives them."""

    def __init__(self, trace, capacity, base="lru", base_params=None):
        self.base = REFERENCES[base](trace, capacity, **dict(base_params or {}))
        self.initial = set(self.base.initial)
        self.top_k = trace.top_k

    def view(self, keys, uses, hits, clock):
        raise NotImplementedError

    def step(self, s, keys, uses, hits, clock, request, resident):
        view = self.view(keys, uses, hits, clock)
        return self.base.step(
            s,
            [k for k, _, _ in view],
            [u for _, u, _ in view],
            [h for _, _, h in view],
            clock,
            request,
            resident,
        )


class RefSecondTouch(_RefFilter):
    """A miss reaches the base only when the key's previous miss was at most `window_tokens` earlier;
    every miss records its clock."""

    def __init__(self, trace, capacity, base="lru", base_params=None, window_tokens=32):
        super().__init__(trace, capacity, base, base_params)
        self.window = window_tokens
        self.touched: dict[int, int] = {}

    def view(self, keys, uses, hits, clock):
        out = []
        for k, u, h in zip(keys, uses, hits, strict=True):
            keep = h
            if not h:
                keep = k in self.touched and clock - self.touched[k] <= self.window
                self.touched[k] = clock
            if keep:
                out.append((k, u, h))
        return out


class RefPrefillAdmit(_RefFilter):
    """A step of more selections than top_k is a prefill step: its misses with the most uses (ties:
    access order) reach the base, at most `prefill_max_admits` (-1: all), every use weighed by
    `prefill_weight` (rounded half up); a decode step's misses reach it only with `decode_admits`."""

    def __init__(
        self, trace, capacity, base="lru", base_params=None, prefill_max_admits=0, prefill_weight=1.0,
        decode_admits=True,
    ):  # fmt: skip
        super().__init__(trace, capacity, base, base_params)
        self.cap, self.weight, self.decode_admits = prefill_max_admits, prefill_weight, decode_admits

    def view(self, keys, uses, hits, clock):
        if sum(uses) <= self.top_k:
            return [(k, u, h) for k, u, h in zip(keys, uses, hits, strict=True) if h or self.decode_admits]
        misses = sorted((i for i, h in enumerate(hits) if not h), key=lambda i: (-uses[i], i))
        allowed = set(misses if self.cap < 0 else misses[: self.cap])
        return [
            (k, math.floor(u * self.weight + 0.5), h)
            for i, (k, u, h) in enumerate(zip(keys, uses, hits, strict=True))
            if h or i in allowed
        ]


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
    "lfu_hysteresis": RefLFUHysteresis,
    "profile_static": RefProfileStatic,
    "second_touch": RefSecondTouch,
    "prefill_admit": RefPrefillAdmit,
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
        a0, a1 = int(trace.start_V[s]), int(trace.start_V[s + 1])
        keys = trace.key_A[a0:a1].tolist()
        uses = trace.uses_A[a0:a1].tolist()
        hits = [k in resident for k in keys]
        hit_A[a0:a1] = hits
        admitted, evicted = policy.step(
            s, keys, uses, hits, int(trace.clock_V[s]), int(trace.request_V[s]), frozenset(resident)
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


class RefTransitionPrefetch(RefLFU):
    """Cumulative LFU (RefLFU) for demand, then a prefetch of layer n + 1 predicted from adjacent-layer
    transition counts. A[(n, i, j)]: expert i of layer n - 1 followed by expert j of layer n in the
    same forward step (the previous layer step, same request and clock); N[(n - 1, i)]: times i had
    a successor step. p_j = mean over the step's experts i with N[(n, i)] > 0 of A[(n + 1, i, j)] /
    N[(n, i)] (summed in access order); predicted: the `top` best by (-p_j, j) with p_j >=
    min_probability, minus keys held; up to `budget` of them, best first, take a free slot or evict
    the LFU victim (greatest (-count, key)) unless it is a key of this step or prefetched by it (then
    stop). A prefetch of a key that this step's demand evicted cancels that eviction."""

    def __init__(self, trace, capacity, top=8, budget=2, min_probability=0.1):
        super().__init__(trace, capacity)
        self.E = trace.num_experts
        self.L = trace.num_layers
        self.top, self.budget, self.minp = top, budget, min_probability
        self.A: dict[tuple[int, int, int], int] = {}
        self.N: dict[tuple[int, int], int] = {}
        self.prev = None  # (layer, clock, request, experts) of the previous step

    def step(self, s, keys, uses, hits, clock, request, resident):
        admitted, evicted = super().step(s, keys, uses, hits, clock, request, resident)
        if not keys:
            return admitted, evicted
        E = self.E
        layer = keys[0] // E
        experts = [k - layer * E for k in keys]
        if self.prev is not None and self.prev[:3] == (layer - 1, clock, request):
            for i in self.prev[3]:
                self.N[(layer - 1, i)] = self.N.get((layer - 1, i), 0) + 1
                for j in experts:
                    self.A[(layer, i, j)] = self.A.get((layer, i, j), 0) + 1
        self.prev = (layer, clock, request, experts)
        if self.budget == 0 or layer + 1 >= self.L:
            return admitted, evicted
        known = [i for i in experts if self.N.get((layer, i), 0) > 0]
        p = []
        for j in range(E):
            total = 0.0
            for i in known:
                total += self.A.get((layer + 1, i, j), 0) / self.N[(layer, i)]
            p.append(total / len(known) if known else 0.0)
        ranked = sorted((j for j in range(E) if p[j] >= self.minp), key=lambda j: (-p[j], j))[: self.top]
        candidates = [(layer + 1) * E + j for j in ranked if (layer + 1) * E + j not in self.held]
        prefetched: list[int] = []
        for k in candidates[: self.budget]:
            if len(self.held) >= self.capacity:
                if not self.held:
                    break
                victim = max(self.held, key=lambda v: (-self.score_of(v), v))
                if victim in keys or victim in prefetched:
                    break
                self.held.remove(victim)
                evicted.append(victim)
            self.held.add(k)
            prefetched.append(k)
            if k in evicted:
                evicted.remove(k)
            else:
                admitted.append(k)
        return admitted, evicted


REFERENCES["transition_prefetch"] = RefTransitionPrefetch


class RefActivationMatch:
    """Activation matching (moecache/sim/policies/activation_match.py), recomputed from scratch at every
    step. cur: key -> uses in the current request; stored: the matrices (key -> uses) of the last
    `history` finished requests, oldest first. Match: the stored matrix with the greatest
    dot / sqrt(|stored|^2) among those with dot > 0 (ties: the newest). Priority: the key's count in
    the match, else in cur; rank (priority, last access index (-1: never), -key), the victim the
    lowest-ranked held key not accessed or admitted by this step. Demand: misses by (-priority, router
    order); free slot, or replace the victim when priority >= its priority, else stop. Prefetch (with
    a match, layer n + 1 < L): the `top` keys of layer n + 1 with match count > 0 by (-priority, -last,
    key), skipping held ones; up to `budget`: free slot, or replace the victim when strictly better,
    else stop."""

    def __init__(self, trace, capacity, history=32, top=8, budget=2):
        self.trace = trace
        self.capacity = capacity
        self.E, self.L = trace.num_experts, trace.num_layers
        self.history, self.top, self.budget = history, top, budget
        self.cur: dict[int, int] = {}
        self.stored: list[dict[int, int]] = []
        self.request = None
        self.last: dict[int, int] = {}
        self.held: set[int] = set()
        self.initial: set[int] = set()

    def step(self, s, keys, uses, hits, clock, request, resident):
        if request != self.request:
            if self.cur:
                self.stored = (self.stored + [self.cur])[-self.history :]
            self.cur = {}
            self.request = request
        a0 = int(self.trace.start_V[s])
        for i, (k, u) in enumerate(zip(keys, uses, strict=True)):
            self.cur[k] = self.cur.get(k, 0) + u
            self.last[k] = a0 + i
        match, best = None, 0.0
        for stored in self.stored:  # oldest first: >= keeps the newest of equal cosines
            dot = sum(c * stored.get(k, 0) for k, c in self.cur.items())
            if dot > 0:
                cos = dot / math.sqrt(sum(c * c for c in stored.values()))
                if cos >= best:
                    match, best = stored, cos
        counts = match if match is not None else self.cur

        def prio(k):
            return counts.get(k, 0)

        protected = set(keys)

        def victim():
            free = self.held - protected
            return min(free, key=lambda k: (prio(k), self.last.get(k, -1), -k)) if free else None

        admitted, evicted = [], []
        for k in sorted((k for k in keys if k not in self.held), key=lambda k: -prio(k)):
            if len(self.held) >= self.capacity:
                v = victim()
                if v is None or prio(k) < prio(v):
                    break
                self.held.remove(v)
                evicted.append(v)
            self.held.add(k)
            admitted.append(k)
        if match is None or not keys or keys[0] // self.E + 1 >= self.L or self.capacity == 0:
            return admitted, evicted
        nxt = (keys[0] // self.E + 1) * self.E
        predicted = [k for k in range(nxt, nxt + self.E) if prio(k) > 0]
        predicted = sorted(predicted, key=lambda k: (-prio(k), -self.last.get(k, -1), k))[: self.top]
        done = 0
        for k in predicted:
            if done == self.budget:
                break
            if k in self.held:
                continue
            if len(self.held) >= self.capacity:
                v = victim()
                if v is None or not prio(k) > prio(v):
                    break
                self.held.remove(v)
                evicted.append(v)
            self.held.add(k)
            protected.add(k)
            admitted.append(k)
            done += 1
        return admitted, evicted


REFERENCES["activation_match"] = RefActivationMatch


class RefImpact:
    """Score S_k (EMA per visit of k's layer of u_k = uses / the step's tokens, 0 when not selected) x
    saving(m_k) = cpu(m_k) - gpu(m_k), m_k = max(1, floor(mu_k + 1/2)), mu_k an EMA of uses per access.
    S_k is kept as in lfu_decay: X_k = sum over k's selections of alpha * u * W(V), S_k = X_k / W(V_l),
    W(V) = 2^(V log2(1 / (1 - alpha))) (2^frac * 2^floor, not rescaled), V the layer's visit count;
    alpha = 1: S_k = u_k of the layer's last visit. Misses by (-impact, key): admitted if impact x
    horizon > copy_us and a slot is free or impact > the victim's (lowest impact, ties the larger key,
    among residents that are not keys of this step nor admitted by it). Then up to `budget` times the
    non-held key of layer n + 1 with the greatest impact > 0 (ties: the smaller key), same tests; the
    first refusal stops. `cost` (a CostModel) is required: the compiled policy reads it from bind_cost."""

    def __init__(self, trace, capacity, cost=None, alpha=0.3, horizon=8, budget=1):
        if cost is None:
            raise ValueError("RefImpact needs cost=CostModel")
        self.trace, self.capacity = trace, capacity
        self.E, self.L = trace.num_experts, trace.num_layers
        self.alpha, self.horizon, self.budget = float(alpha), float(horizon), int(budget)
        self.sav = (cost.cpu_table() - cost.gpu_table()).tolist()
        self.copy_us = float(cost.copy_us())
        self.visits = [0] * self.L
        self.X: dict[int, float] = {}
        self.mu: dict[int, float] = {}
        self.held: set[int] = set()
        self.initial: set[int] = set()

    def weight(self, layer):
        if self.alpha == 1.0:
            return 1.0
        x = self.visits[layer] * -math.log2(1.0 - self.alpha)
        q = math.floor(x)
        return _exp2(x - q) * math.ldexp(1.0, q)

    def impact(self, k):
        m = min(max(1, math.floor(self.mu.get(k, 0.0) + 0.5)), len(self.sav) - 1)
        return (self.X.get(k, 0.0) * self.sav[m]) / self.weight(k // self.E)

    def step(self, s, keys, uses, hits, clock, request, resident):
        admitted, evicted = [], []
        if not keys:
            return admitted, evicted
        layer = keys[0] // self.E
        tokens = sum(uses) / self.trace.top_k  # each token selects top_k experts of the layer
        self.visits[layer] += 1
        if self.alpha == 1.0:
            for k in range(layer * self.E, (layer + 1) * self.E):
                self.X[k] = 0.0
        w = self.weight(layer)
        for k, u in zip(keys, uses, strict=True):
            self.X[k] = self.X.get(k, 0.0) + (self.alpha * (u / tokens)) * w
            mu = self.mu.get(k, 0.0)
            self.mu[k] = u if mu == 0.0 else self.alpha * u + (1.0 - self.alpha) * mu
        excluded = set(keys)

        def admit(k):
            imp = self.impact(k)
            if not imp * self.horizon > self.copy_us:
                return False
            if len(self.held) >= self.capacity:
                eligible = [v for v in self.held if v not in excluded]
                if not eligible:
                    return False
                victim = min(eligible, key=lambda v: (self.impact(v), -v))
                if not imp > self.impact(victim):
                    return False
                self.held.remove(victim)
                evicted.append(victim)
            self.held.add(k)
            excluded.add(k)
            admitted.append(k)
            return True

        for k in sorted((k for k in keys if k not in self.held), key=lambda k: (-self.impact(k), k)):
            admit(k)  # every one is tried: a refusal refuses all later (lower) misses as well
        if layer + 1 < self.L:
            for _ in range(self.budget):
                nxt = range((layer + 1) * self.E, (layer + 2) * self.E)
                candidates = [k for k in nxt if k not in self.held and self.impact(k) > 0]
                if not candidates or not admit(min(candidates, key=lambda k: (-self.impact(k), k))):
                    break
        return admitted, evicted


REFERENCES["impact"] = RefImpact
