"""Belady (cold, warm, with and without bypass), LRFU and the per-layer budget policies: compiled ==
plain-Python reference, Belady == exhaustive search over demand schedules on tiny traces, Belady
above every policy of the registry, budgets, golden hit counts, and a real-trace smoke run."""

from __future__ import annotations

import itertools
from fractions import Fraction
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.errors import MoecacheError
from moecache.sim.policies.lru_per_layer import effective_experts, layer_budgets, layer_demands
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.replay import replay_instant
from tests.sim.reference import ref_layer_budgets, reference_run

VARIANTS = [
    ("belady", {}),
    ("belady", {"warm": True}),
    ("belady", {"bypass": False}),
    ("belady", {"warm": True, "bypass": False}),
    ("lrfu", {"lambda_": 0.0}),
    ("lrfu", {"lambda_": 1.0}),
    ("lrfu", {"lambda_": 0.0731}),  # generic: no exact or near ties between different histories
    ("lru_per_layer", {"split": "equal"}),
    ("lru_per_layer", {"split": "entropy"}),
    ("lfu_per_layer", {"split": "equal"}),
    ("lfu_per_layer", {"split": "entropy"}),
]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def step_lists(draw, max_layer_steps=30, shapes=None):
    """(steps, num_layers, num_experts, top_k) for the conftest trace builder: several requests,
    mostly one-token steps, a few of two or three tokens; a few layer steps select one expert per
    token (so per-layer demands differ)."""
    if shapes is None:
        num_layers = draw(st.integers(1, 3))
        num_experts = draw(st.integers(2, 6))
    else:
        num_layers, num_experts = draw(st.sampled_from(shapes))
    top_k = draw(st.integers(1, min(3, num_experts)))
    forwards = draw(st.integers(1, max_layer_steps // num_layers))
    requests = sorted(draw(st.lists(st.integers(0, 2), min_size=forwards, max_size=forwards)))
    steps, next_step = [], {}
    for r in requests:
        s = next_step.get(r, 0)
        next_step[r] = s + 1
        tokens = draw(st.sampled_from([1, 1, 1, 1, 2, 3]))
        for layer in range(num_layers):
            k = draw(st.sampled_from([top_k, top_k, top_k, 1]))  # some layers select fewer experts
            picks = [draw(st.permutations(range(num_experts)))[:k] for _ in range(tokens)]
            steps.append((r, s, layer, picks))
    return steps, num_layers, num_experts, top_k


def hits(trace, name, capacity, **params) -> int:
    return int(replay_instant(trace, make_policy(name, **params), capacity).hit_A.sum())


# --- compiled == reference ------------------------------------------------------------------------


@FAST
@given(case=step_lists())
def test_compiled_equals_reference(make_trace, case):
    trace = make_trace(*case)
    for name, params in VARIANTS:
        policy = make_policy(name, **params)
        for capacity in range(trace.num_keys + 1):
            got = replay_instant(trace, policy, capacity)
            want = reference_run(trace, name, capacity, **params)
            where = f"{policy.label()} at capacity {capacity}"
            np.testing.assert_array_equal(got.hit_A, want.hit_A, err_msg=where)
            assert (int(got.admits_V.sum()), int(got.evicts_V.sum())) == (want.admissions, want.evictions), (
                where
            )


def test_lrfu_renormalises_like_the_reference(make_trace):
    """900 one-token steps at lambda_ 1: the scale passes 2^512 and every score is rescaled."""
    rng = np.random.default_rng(3)
    steps = [(0, i, 0, [[int(rng.integers(0, 5))]]) for i in range(900)]
    trace = make_trace(steps, 1, 5, 1)
    for capacity in (1, 2, 3):
        got = replay_instant(trace, make_policy("lrfu", lambda_=1.0), capacity).hit_A
        np.testing.assert_array_equal(got, reference_run(trace, "lrfu", capacity, lambda_=1.0).hit_A)


def lrfu_hits(trace, capacity, name="lrfu", **params) -> list[int]:
    """Per-access hits (0/1) of the compiled policy; for lrfu also checked against the reference."""
    got = replay_instant(trace, make_policy(name, **params), capacity).hit_A
    if name == "lrfu":
        np.testing.assert_array_equal(got, reference_run(trace, name, capacity, **params).hit_A)
    return got.astype(int).tolist()


def test_lrfu_tiny_lambda_is_lfu_with_always_admit(make_trace):
    # one layer, 3 experts, capacity 2, one expert per decode step: 0 four times, then 1 and 2 in turn
    steps = [(0, i, 0, [[e]]) for i, e in enumerate([0, 0, 0, 0, 1, 2, 1, 2, 1, 2, 0])]
    trace = make_trace(steps, 1, 3, 1)
    # always-admit by use count: each of 1, 2 replaces the other (fewer uses than 0's 4), 0 stays
    thrash = [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert lrfu_hits(trace, 2, lambda_=1e-6) == thrash
    assert lrfu_hits(trace, 2, lambda_=0.0) == thrash
    # lfu admits only a strictly greater count: 2 never beats 1 (equal counts), 1 keeps hitting
    assert lrfu_hits(trace, 2, "lfu") == [0, 1, 1, 1, 0, 0, 1, 0, 1, 0, 1]
    # lru keeps the two most recent: 1 and 2 hit, 0 is gone when it comes back
    assert lrfu_hits(trace, 2, "lru") == [0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0]
    # equal counts: a tiny lambda_ evicts the older use (0), lambda_ 0 the larger key (1)
    trace = make_trace([(0, i, 0, [[e]]) for i, e in enumerate([0, 1, 2, 0])], 1, 3, 1)
    assert lrfu_hits(trace, 2, lambda_=1e-6) == [0, 0, 0, 0]
    assert lrfu_hits(trace, 2, lambda_=0.0) == [0, 0, 0, 1]


def test_lrfu_lambda_one_against_lru(make_trace):
    # agree: one layer, one expert per one-token step; a use then outweighs all older ones together,
    # so the smallest CRF is the least recently used key
    seq = [0, 1, 2, 0, 3, 1, 0, 2, 3, 3, 1, 0]
    trace = make_trace([(0, i, 0, [[e]]) for i, e in enumerate(seq)], 1, 4, 1)
    want = [0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert lrfu_hits(trace, 3, lambda_=1.0) == lrfu_hits(trace, 3, "lru") == want
    for capacity in (1, 2, 4):
        assert lrfu_hits(trace, capacity, lambda_=1.0) == lrfu_hits(trace, capacity, "lru")
    # differ: 2 layers of 2 experts (keys 0, 1 | 2, 3), capacity 2, one token per forward step.
    # Forward 0 uses key 0 (layer 0), then key 2 (layer 1); forward 1 key 1, then key 2 again.
    # Both layer steps of forward 0 run at the same token clock, so keys 0 and 2 have equal CRFs
    # when key 1 misses: lrfu evicts the larger key, 2, which then misses; lru evicts 0, used first.
    steps = [(0, 0, 0, [[0]]), (0, 0, 1, [[0]]), (0, 1, 0, [[1]]), (0, 1, 1, [[0]])]
    trace = make_trace(steps, 2, 2, 1)
    assert lrfu_hits(trace, 2, lambda_=1.0) == [0, 0, 0, 0]
    assert lrfu_hits(trace, 2, "lru") == [0, 0, 0, 1]


@FAST
@given(seq=st.lists(st.integers(0, 4), min_size=1, max_size=50))
def test_lrfu_lambda_one_is_lru_on_one_key_per_token(make_trace, seq):
    """One layer, one expert per one-token step (at most 50: CRFs stay exact): lrfu(1) == lru."""
    trace = make_trace([(0, i, 0, [[e]]) for i, e in enumerate(seq)], 1, 5, 1)
    for capacity in range(trace.num_keys + 1):
        lrfu1 = replay_instant(trace, make_policy("lrfu", lambda_=1.0), capacity).hit_A
        np.testing.assert_array_equal(lrfu1, replay_instant(trace, make_policy("lru"), capacity).hit_A)


@FAST
@given(case=step_lists())
def test_one_layer_budget_is_the_global_policy(make_trace, case):
    steps, _, num_experts, top_k = case
    steps = [(r, s, 0, picks) for r, s, layer, picks in steps if layer == 0]
    trace = make_trace(steps, 1, num_experts, top_k)
    for capacity in range(trace.num_keys + 1):
        for split in ("equal", "entropy"):
            for per_layer, glob in (("lru_per_layer", "lru"), ("lfu_per_layer", "lfu")):
                assert hits(trace, per_layer, capacity, split=split) == hits(trace, glob, capacity)


# --- Belady is optimal ---------------------------------------------------------------------------


def reachable(held: frozenset, misses: list[int], capacity: int) -> set[frozenset]:
    """Every resident set after a step: at each miss (router order) bypass, or admit it into a free
    slot, or (cache full) admit it in place of any key holding a slot, even one admitted by this step."""
    out: set[frozenset] = set()

    def go(i, cur):
        if i == len(misses):
            out.add(cur)
            return
        go(i + 1, cur)
        if capacity == 0:
            return
        if len(cur) < capacity:
            go(i + 1, cur | {misses[i]})
        else:
            for victim in cur:
                go(i + 1, (cur - {victim}) | {misses[i]})

    go(0, held)
    return out


def best_hits(trace, capacity: int, initial) -> int:
    """The most hits of any demand schedule from `initial` (hits from the snapshot before a step,
    admissions resident from the next step), by exhaustive search."""
    steps = [trace.key_A[trace.start_V[s] : trace.start_V[s + 1]].tolist() for s in range(trace.num_steps)]

    @cache
    def best(s, held):
        if s == len(steps):
            return 0
        keys = steps[s]
        misses = [k for k in keys if k not in held]
        return len(keys) - len(misses) + max(best(s + 1, r) for r in reachable(held, misses, capacity))

    return best(0, frozenset(initial))


TINY = [(1, 2), (1, 3), (1, 4), (1, 5), (2, 2)]  # (layers, experts): at most 5 keys


@settings(max_examples=100, deadline=None)
@given(case=step_lists(max_layer_steps=8, shapes=TINY))
def test_belady_equals_exhaustive_search(make_trace, case):
    trace = make_trace(*case)
    used = sorted(set(trace.key_A.tolist()))
    for capacity in range(trace.num_keys + 1):
        cold = best_hits(trace, capacity, ())
        assert hits(trace, "belady", capacity) == cold
        warm = max(
            best_hits(trace, capacity, start)
            for size in range(min(capacity, len(used)) + 1)
            for start in itertools.combinations(used, size)
        )
        assert hits(trace, "belady", capacity, warm=True) == warm
        assert hits(trace, "belady", capacity, bypass=False) <= cold
        assert hits(trace, "belady", capacity, warm=True, bypass=False) <= warm


def registry_policies(trace, policy_params):
    """Every registered policy with its default parameters (profile_static with a profile of the trace's
    shape: it has no default one), plus the variants of this file's ones."""
    out = [cls(**policy_params(name, trace)) for name, cls in sorted(POLICIES.items())]
    out += [make_policy(name, **params) for name, params in VARIANTS if params]
    out += [make_policy("lfu", reset_per_request=True)]
    return out


@FAST
@given(case=step_lists())
def test_belady_bounds_every_policy(make_trace, policy_params, case):
    trace = make_trace(*case)
    for capacity in range(trace.num_keys + 1):
        cold = hits(trace, "belady", capacity)
        warm = hits(trace, "belady", capacity, warm=True)
        assert cold <= warm
        for policy in registry_policies(trace, policy_params):
            if policy.prefetches:  # Belady bounds demand caching; a prefetcher may load ahead of use
                continue
            try:
                got = int(replay_instant(trace, policy, capacity).hit_A.sum())
            except MoecacheError:  # a parameter it cannot do without
                continue
            assert got <= warm, f"{policy.label()} at {capacity}: {got} > warm Belady {warm}"
            if policy.cold_start:
                assert got <= cold, f"{policy.label()} at {capacity}: {got} > cold Belady {cold}"


@FAST
@given(case=step_lists())
def test_belady_monotone_and_capacity_edges(make_trace, case):
    trace = make_trace(*case)
    distinct = len(set(trace.key_A.tolist()))
    for params in ({}, {"warm": True}):
        seq = [hits(trace, "belady", c, **params) for c in range(trace.num_keys + 1)]
        assert seq == sorted(seq), params
        assert seq[0] == 0
        assert seq[-1] == trace.num_accesses - (0 if params else distinct)  # only compulsory misses
    for name, params in VARIANTS:
        assert hits(trace, name, 0, **params) == 0


def test_belady_edge_semantics(make_trace):
    # capacity 1, keys of one layer: a then b,c then a. Cold with bypass keeps a (used again soonest).
    steps = [(0, 0, 0, [[0]]), (0, 1, 0, [[1]]), (0, 2, 0, [[0]]), (0, 3, 0, [[1]]), (0, 4, 0, [[2]])]
    trace = make_trace(steps, 1, 3, 1)
    # cold: a miss(adm), b miss (b next 3 > a next 2: bypass), a hit, b miss (adm: a never again), c miss
    assert replay_instant(trace, make_policy("belady"), 1).hit_A.tolist() == [
        False,
        False,
        True,
        False,
        False,
    ]
    # without bypass b replaces a: a misses again
    assert replay_instant(trace, make_policy("belady", bypass=False), 1).hit_A.tolist() == [False] * 5
    # warm: a (first used at 0) resident from the start
    warm = replay_instant(trace, make_policy("belady", warm=True), 1)
    assert warm.hit_A.tolist() == [True, False, True, False, False]
    policy = make_policy("belady", warm=True)
    assert not policy.cold_start and make_policy("belady").cold_start
    state = policy.init_state(trace, 3)
    assert policy.initial_residents(state, trace, 3).tolist() == [0, 1, 2]
    with pytest.raises(MoecacheError, match="warm must be true or false"):
        make_policy("belady", warm="yes")
    with pytest.raises(MoecacheError, match="lambda_ must be a number from 0 to 1"):
        make_policy("lrfu", lambda_=2)
    with pytest.raises(MoecacheError, match="split must be one of"):
        make_policy("lru_per_layer", split="uses")


# --- per-layer budgets ---------------------------------------------------------------------------


@st.composite
def layer_uses(draw):
    """(uses of each layer's experts, num_experts); some layers repeat an earlier layer's
    distribution, permuted and scaled (an equal demand)."""
    num_layers = draw(st.integers(1, 6))
    num_experts = draw(st.integers(1, 8))
    rows: list[list[int]] = []
    for _ in range(num_layers):
        if rows and draw(st.booleans()):
            factor = draw(st.integers(1, 3))
            rows.append([factor * u for u in draw(st.permutations(draw(st.sampled_from(rows))))])
        else:
            rows.append(draw(st.lists(st.integers(0, 50), min_size=num_experts, max_size=num_experts)))
    return rows, num_experts


def shares(row: list[int]) -> tuple:
    total = sum(row)
    return tuple(sorted(Fraction(u, total) for u in row)) if total else ()


@settings(max_examples=300, deadline=None)
@given(case=layer_uses(), data=st.data())
def test_budgets_sum_to_capacity(case, data):
    uses, num_experts = case
    capacity = data.draw(st.integers(0, len(uses) * num_experts))
    got = {}
    for split in ("equal", "entropy"):
        b = layer_budgets(uses, capacity, num_experts, split)
        assert int(b.sum()) == capacity and b.min() >= 0 and b.max() <= num_experts
        assert b.tolist() == ref_layer_budgets(uses, capacity, num_experts, split)
        got[split] = b.tolist()
    if len({shares(row) for row in uses}) == 1:  # the same distribution everywhere: equal demand
        assert got["entropy"] == got["equal"]
    demand = layer_demands(uses)
    for i, j in itertools.permutations(range(len(uses)), 2):  # more demand, no fewer slots
        if demand[i] > demand[j]:
            assert got["entropy"][i] >= got["entropy"][j], (demand, got)


def test_effective_experts_by_hand():
    assert effective_experts([1, 1, 1, 1]) == pytest.approx(4)
    assert effective_experts([2, 1, 1, 0]) == pytest.approx(2**1.5)  # entropy 1.5 bits
    assert effective_experts([12, 0, 0, 0]) == pytest.approx(1)  # one expert: one slot's demand
    assert effective_experts([0, 0, 0, 0]) == 0.0
    assert layer_demands([[6, 6, 0, 0], [0, 3, 3, 0], [1, 1, 1, 1]]) == [2_000_000, 2_000_000, 4_000_000]


def test_budgets_by_hand():
    # 12 uses in every layer (fixed top-1 over 12 tokens), spread over 4, 2 and 1 experts:
    # a split by uses would be the equal split; the entropy split follows the demands 4 : 2 : 1
    uses, e = [[3, 3, 3, 3], [6, 6, 0, 0], [12, 0, 0, 0]], 4
    assert layer_budgets(uses, 5, e, "equal").tolist() == [2, 2, 1]
    assert layer_budgets(uses, 7, e, "equal").tolist() == [3, 2, 2]
    assert layer_budgets(uses, 3, e, "entropy").tolist() == [2, 1, 0]  # 1.71, .86, .43
    assert layer_budgets(uses, 5, e, "entropy").tolist() == [3, 1, 1]  # 2.86, 1.43, .71
    assert layer_budgets(uses, 7, e, "entropy").tolist() == [4, 2, 1]  # 4 held at 4; 3 by 2:1
    assert layer_budgets(uses, 9, e, "entropy").tolist() == [4, 3, 2]  # 5.14 held at 4; 5 by 2:1
    assert layer_budgets(uses, 12, e, "entropy").tolist() == [4, 4, 4]
    # non-integer demand: 4 against 2^1.5 = 2.83 experts; 6 slots: 3.51, 2.49
    assert layer_budgets([[1, 1, 1, 1], [2, 1, 1, 0]], 6, e, "entropy").tolist() == [4, 2]
    assert layer_budgets([[1, 1, 1, 1], [2, 1, 1, 0]], 6, e, "equal").tolist() == [3, 3]
    tie = [[1, 1, 0, 0], [3, 0, 0, 0], [0, 5, 0, 0]]  # demands 2, 1, 1
    assert layer_budgets(tie, 2, e, "entropy").tolist() == [1, 1, 0]  # 1, .5, .5: tie to layer 1
    assert layer_budgets(tie, 6, e, "entropy").tolist() == [3, 2, 1]  # 3, 1.5, 1.5
    unused = [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert layer_budgets(unused, 6, e, "entropy").tolist() == [4, 1, 1]  # unused layers: equal


def test_per_layer_evicts_only_its_layer(make_trace):
    # layer 0 alternates between two pairs of experts, layer 1 reuses expert 0: with 1 slot of its own
    # (2 slots split equally; 3 split by entropy, 4 effective experts against 1: 2.4, .6), layer 1
    # keeps its expert; global LRU at 2 slots lets layer 0's misses evict it
    steps = []
    for s in range(8):
        steps += [(0, s, 0, [[2 * (s % 2), 2 * (s % 2) + 1]]), (0, s, 1, [[0]])]
    trace = make_trace(steps, 2, 4, 2)
    layer1 = trace.key_A >= 4
    for name in ("lru_per_layer", "lfu_per_layer"):
        for split, capacity, budgets in (("equal", 2, [1, 1]), ("entropy", 3, [2, 1])):
            policy = make_policy(name, split=split)
            assert policy.budgets(trace, capacity).tolist() == budgets, (name, split)
            hit_A = replay_instant(trace, policy, capacity).hit_A
            assert hit_A[layer1].sum() == 7, (name, split)
    assert replay_instant(trace, make_policy("lru"), 2).hit_A[layer1].sum() == 0


# --- golden hit counts ---------------------------------------------------------------------------

GOLDEN_STEPS = [
    (0, 0, 0, [[0, 1], [1, 2], [0, 3]]),
    (0, 0, 1, [[0], [2], [0]]),
    (0, 1, 0, [[1, 2]]),
    (0, 1, 1, [[3]]),
    (0, 2, 0, [[1, 3]]),
    (0, 2, 1, [[0, 1]]),
    (0, 3, 0, [[2, 1]]),
    (0, 3, 1, [[3]]),
    (1, 0, 0, [[3, 2], [0, 2]]),
    (1, 0, 1, [[1], [1, 3]]),
    (1, 1, 0, [[0, 3]]),
    (1, 1, 1, [[2, 1]]),
    (1, 2, 0, [[0, 1]]),
    (1, 2, 1, [[2]]),
    (1, 3, 0, [[3, 0]]),
    (1, 3, 1, [[2, 1]]),
    (1, 4, 0, [[1, 0]]),
    (1, 4, 1, [[3, 2]]),
]
GOLDEN_CAPACITIES = (1, 2, 3, 4, 6)
GOLDEN = {  # (policy, params): hits at GOLDEN_CAPACITIES, frozen from tests.sim.reference
    ("belady", ()): (8, 15, 19, 22, 27),
    ("belady", (("warm", True),)): (9, 17, 22, 26, 33),
    ("belady", (("bypass", False),)): (0, 10, 16, 21, 27),
    ("belady", (("bypass", False), ("warm", True))): (1, 12, 19, 25, 33),
    ("lrfu", (("lambda_", 0.0),)): (0, 4, 8, 10, 24),
    ("lrfu", (("lambda_", 1.0),)): (0, 4, 9, 11, 23),
    ("lrfu", (("lambda_", 0.0731),)): (0, 3, 8, 8, 24),
    ("lrfu", ()): (0, 3, 8, 8, 24),
    ("lru_per_layer", (("split", "equal"),)): (2, 6, 13, 16, 25),
    # entropy: demands 3.94 and 3.92 effective experts, the equal split at these capacities
    ("lru_per_layer", (("split", "entropy"),)): (2, 6, 13, 16, 25),
    ("lfu_per_layer", (("split", "equal"),)): (4, 6, 9, 11, 19),
    ("lfu_per_layer", (("split", "entropy"),)): (4, 6, 9, 11, 19),
}


def test_golden_hit_counts(make_trace):
    trace = make_trace(GOLDEN_STEPS, 2, 4, 2)
    for (name, params), want in GOLDEN.items():
        params = dict(params)
        for capacity, count in zip(GOLDEN_CAPACITIES, want, strict=True):
            label = make_policy(name, **params).label()
            assert int(reference_run(trace, name, capacity, **params).hit_A.sum()) == count, (label, capacity)
            assert hits(trace, name, capacity, **params) == count, (label, capacity)


# --- real trace ----------------------------------------------------------------------------------


def test_real_trace_smoke(esft_law_trace):
    trace = esft_law_trace
    capacity = 300
    result = {}
    for name, params in [*VARIANTS[:4], ("lrfu", {}), *VARIANTS[7:]]:
        policy = make_policy(name, **params)
        r = replay_instant(trace, policy, capacity)
        result[policy.label()] = int(r.hit_A.sum())
    top = result["belady(bypass=True,warm=True)"]
    assert result["belady(bypass=True,warm=False)"] <= top
    assert all(v <= result["belady(bypass=True,warm=False)"] for k, v in result.items() if "warm" not in k)
