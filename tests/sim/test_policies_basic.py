"""Policies lru, static_hindsight, static_cold, lfu, lfu_decay, lfu_window: golden hit counts, the
compiled policies against the plain Python reference (tests/sim/reference.py), properties, and
parameters."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from moecache.errors import MoecacheError
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from tests.sim.reference import per_key_uses, reference_run
from tests.sim.strategies import assert_matches_reference, small_traces

# (policy, params) of every variant tested here
VARIANTS = [
    ("lru", {}),
    ("static_hindsight", {}),
    ("static_cold", {}),
    ("lfu", {}),
    ("lfu", {"reset_per_request": True}),
    ("lfu_decay", {}),
    ("lfu_decay", {"half_life_tokens": 1}),
    ("lfu_window", {}),
    ("lfu_window", {"window_tokens": 1}),
    ("lfu_window", {"window_tokens": 2}),
]
DEMAND = {"lru", "lfu", "lfu_decay", "lfu_window"}
STATIC = {"static_hindsight", "static_cold"}

# 2 layers x 3 experts (keys: layer 0 -> 0, 1, 2; layer 1 -> 3, 4, 5), top-2, two requests; the first
# forward step of request 0 is a 2-token prefill step (key 1 and key 3 get 2 uses in one access).
GOLDEN = [
    (0, 0, 0, [[2, 1], [1, 0]]),
    (0, 0, 1, [[0, 2], [0, 1]]),
    (0, 1, 0, [[1, 2]]),
    (0, 1, 1, [[0, 1]]),
    (0, 2, 0, [[1, 0]]),
    (0, 2, 1, [[0, 2]]),
    (0, 3, 0, [[2, 1]]),
    (0, 3, 1, [[1, 0]]),
    (1, 0, 0, [[0, 2]]),
    (1, 0, 1, [[2, 1]]),
    (1, 1, 0, [[0, 2]]),
    (1, 1, 1, [[2, 0]]),
    (1, 2, 0, [[2, 0]]),
    (1, 2, 1, [[2, 1]]),
    (1, 3, 0, [[1, 0]]),
    (1, 3, 1, [[0, 2]]),
]
# Hits at capacities 0..6 (34 accesses, 6 keys), computed by the reference and frozen. By hand:
# - static_cold at 3 holds layer 0 (keys 0-2): every layer-0 access hits, 3 + 7 * 2 = 17;
# - at 6 every demand policy misses each key once only: 34 - 6 = 28;
# - static_hindsight at 1 holds key 3 (expert 0 of layer 1, 7 uses, the most) accessed 6 times.
GOLDEN_HITS = {
    ("lru", ()): [0, 0, 0, 4, 15, 19, 28],
    ("static_hindsight", ()): [0, 6, 12, 17, 23, 29, 34],
    ("static_cold", ()): [0, 6, 11, 17, 23, 28, 34],
    ("lfu", ()): [0, 4, 8, 13, 17, 23, 28],
    ("lfu", (("reset_per_request", True),)): [0, 6, 11, 15, 19, 24, 28],
    ("lfu_decay", (("half_life_tokens", 1),)): [0, 5, 7, 13, 16, 22, 28],
    ("lfu_window", (("window_tokens", 2),)): [0, 5, 8, 13, 18, 23, 28],
}


def hits_at(trace, name, params, capacity) -> int:
    return int(replay_instant(trace, make_policy(name, **params), capacity).hit_A.sum())


@pytest.mark.parametrize(
    "variant", list(GOLDEN_HITS), ids=lambda v: v[0] + "".join(f",{k}={x}" for k, x in v[1])
)
def test_golden_hits(make_trace, variant):
    name, params = variant[0], dict(variant[1])
    trace = make_trace(GOLDEN, 2, 3)
    assert trace.num_accesses == 34
    want = GOLDEN_HITS[variant]
    assert [hits_at(trace, name, params, c) for c in range(7)] == want
    assert [int(reference_run(trace, name, c, **params).hit_A.sum()) for c in range(7)] == want


@pytest.mark.parametrize("name,params", VARIANTS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces())
def test_matches_reference(make_trace, name, params, case):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    assert_matches_reference(trace, name, params)


@settings(max_examples=40, deadline=None)
@given(case=small_traces())
def test_properties(make_trace, case):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    k = trace.num_keys
    # a key missed once: at its first step (a key appears once per step, whatever its uses)
    compulsory = len(set(trace.key_A.tolist()))
    for name, params in VARIANTS:
        hits = [hits_at(trace, name, params, c) for c in range(k + 1)]
        assert hits[0] == 0, name
        if name in DEMAND:
            assert hits[k] == trace.num_accesses - compulsory, name
        if name in STATIC:
            assert hits[k] == trace.num_accesses, name
        if name in STATIC or name == "lru":
            assert all(a <= b for a, b in pairwise(hits)), (name, hits)


def test_static_placements(make_trace):
    trace = make_trace(GOLDEN, 2, 3)
    cold = make_policy("static_cold")
    assert cold.initial_residents(cold.init_state(trace, 4), trace, 4).tolist() == [0, 1, 2, 3]
    hind = make_policy("static_hindsight")
    # uses per key: 0: 6, 1: 6, 2: 6, 3: 7, 4: 5, 5: 6 -> ranked 3, then 0, 1, 2, 5 (ties by key), 4
    assert per_key_uses(trace) == {0: 6, 1: 6, 2: 6, 3: 7, 4: 5, 5: 6}
    for capacity, want in [(1, [3]), (3, [0, 1, 3]), (5, [0, 1, 2, 3, 5])]:
        assert hind.initial_residents(hind.init_state(trace, capacity), trace, capacity).tolist() == want
    result = replay_instant(trace, hind, 3)
    assert result.admits_V.sum() == 0 and result.evicts_V.sum() == 0


def test_fixed_placement_is_derived_from_the_static_step(make_trace):
    """`Policy.fixed_placement` (what lets the fast loop skip a resident layer's host point) is exactly
    the policies whose step is `static_step`, and their replays admit and evict nothing."""
    import moecache.sim.policies  # noqa: F401  (registers every policy)
    from moecache.sim.policy import POLICIES, static_step

    fixed = {name for name, cls in POLICIES.items() if cls.fixed_placement}
    assert fixed == {name for name, cls in POLICIES.items() if cls.step is static_step}
    assert {"static_cold", "static_hindsight", "static_layers", "profile_static"} <= fixed
    assert not {"lru", "lfu", "belady", "transition_prefetch"} & fixed
    trace = make_trace(GOLDEN, 2, 3)
    for name in ("static_cold", "static_hindsight", "static_layers"):
        result = replay_instant(trace, make_policy(name), 3)
        assert result.admits_V.sum() == 0 and result.evicts_V.sum() == 0, name


def decode(keys, request=0):
    """One-layer decode steps of one request."""
    return [(request, i, 0, [[e]]) for i, e in enumerate(keys)]


def test_lfu_reset_per_request(make_trace):
    # request 0 uses expert 0 four times, request 1 expert 1 three times; one slot.
    trace = make_trace(decode([0, 0, 0, 0]) + decode([1, 1, 1], request=1), 1, 2)
    plain = replay_instant(trace, make_policy("lfu"), 1).hit_A.tolist()
    reset = replay_instant(trace, make_policy("lfu", reset_per_request=True), 1).hit_A.tolist()
    # cumulative: 1 never gets more uses than 0's 4, so it never enters
    assert plain == [False, True, True, True, False, False, False]
    # reset: at request 1, 0 counts 0 and 1 counts 1 > 0: 1 replaces 0 at once (residency kept)
    assert reset == [False, True, True, True, False, True, True]


def test_lfu_init_counts(make_trace, make_trace_file, tmp_path):
    prior = make_trace_file(tmp_path / "prior.parquet", decode([1] * 10), 1, 2)
    trace = make_trace(decode([0, 0, 1, 0]), 1, 2)
    assert replay_instant(trace, make_policy("lfu"), 1).hit_A.tolist() == [False, True, False, True]
    # with 10 prior uses, 1 (count 11) replaces 0 (count 2) on its first miss and stays
    want = [False, True, False, False]
    assert replay_instant(trace, make_policy("lfu", init_counts=str(prior)), 1).hit_A.tolist() == want
    assert reference_run(trace, "lfu", 1, init_counts={1: 10}).hit_A.tolist() == want
    artifact = tmp_path / "import_trace-0123456789ab"
    artifact.mkdir()
    (artifact / "trace.parquet").write_bytes(prior.read_bytes())
    assert replay_instant(trace, make_policy("lfu", init_counts=artifact), 1).hit_A.tolist() == want
    # reset_per_request restores the initial counts, not zero
    both = make_policy("lfu", init_counts=str(prior), reset_per_request=True)
    assert replay_instant(trace, both, 1).hit_A.tolist() == want


def test_lfu_init_counts_errors(make_trace, make_trace_file, tmp_path):
    trace = make_trace(decode([0, 1]), 1, 2)
    other = make_trace_file(tmp_path / "other.parquet", decode([0, 1]), 2, 2)
    with pytest.raises(MoecacheError, match="other.parquet.*2 layers x 2 experts"):
        replay_instant(trace, make_policy("lfu", init_counts=str(other)), 1)
    with pytest.raises(MoecacheError, match="no trace.parquet"):
        replay_instant(trace, make_policy("lfu", init_counts=str(tmp_path)), 1)
    with pytest.raises(MoecacheError, match="missing.parquet"):
        replay_instant(trace, make_policy("lfu", init_counts=str(tmp_path / "missing.parquet")), 1)


@pytest.mark.parametrize(
    "name,params,word",
    [
        ("lfu_decay", {"half_life_tokens": -1}, "half_life_tokens"),
        ("lfu_decay", {"half_life_tokens": 0}, "half_life_tokens"),
        ("lfu_decay", {"half_life_tokens": float("nan")}, "half_life_tokens"),
        ("lfu_decay", {"half_life_tokens": "long"}, "half_life_tokens"),
        ("lfu_window", {"window_tokens": 0}, "window_tokens"),
        ("lfu_window", {"window_tokens": -3}, "window_tokens"),
        ("lfu_window", {"window_tokens": 2.5}, "window_tokens"),
        ("lfu", {"reset_per_request": "yes"}, "reset_per_request"),
        ("lfu", {"init_counts": 3}, "init_counts"),
        ("lfu", {"half_life_tokens": 3}, "unknown parameter"),
        ("static_cold", {"capacity": 3}, "unknown parameter"),
    ],
)
def test_bad_parameters(name, params, word):
    with pytest.raises(MoecacheError, match=word):
        make_policy(name, **params)


def test_decay_renormalises(make_trace):
    """Half-life 0.25 tokens: the weight of a use doubles 4 times a token, so lfu_decay rescales its
    stored scores (past 512 doublings) within 250 tokens; its decisions still match the reference's,
    computed without rescaling (up to 1000 doublings, within float64)."""
    rng = np.random.default_rng(1)
    keys = rng.choice(4, size=250, p=[0.4, 0.3, 0.2, 0.1]).tolist()
    trace = make_trace(decode(keys), 1, 4)
    for capacity in (1, 2, 3):
        got = replay_instant(trace, make_policy("lfu_decay", half_life_tokens=0.25), capacity)
        ref = reference_run(trace, "lfu_decay", capacity, half_life_tokens=0.25)
        assert np.array_equal(got.hit_A, ref.hit_A)


def test_window_expiry(make_trace):
    # window 2 tokens (the current one and the one before), one slot
    trace = make_trace(decode([0, 0, 1, 1, 1, 0]), 1, 2)
    hits = replay_instant(trace, make_policy("lfu_window", window_tokens=2), 1).hit_A.tolist()
    # step 2: counts {0: 1, 1: 1}, 1 does not beat 0; step 3: {0: 0, 1: 2}, 1 replaces 0;
    # step 5: {0: 1, 1: 1}, 0 does not beat 1
    assert hits == [False, True, False, False, True, False]
    assert hits == reference_run(trace, "lfu_window", 1, window_tokens=2).hit_A.tolist()


def test_real_trace_smoke(esft_law_trace):
    trace = esft_law_trace
    assert trace.num_accesses == 8327 * 26 * 6
    rates = {}
    for name, params in VARIANTS:
        policy = make_policy(name, **params)
        result = replay_instant(trace, policy, 300)
        rates[policy.label()] = result.hit_A.mean()
        assert result.admits_V.sum() - result.evicts_V.sum() <= 300
    assert all(0.1 < r < 0.9 for r in rates.values()), rates
    # one token per step: uses = accesses, so hindsight is the best static placement
    assert rates["static_hindsight"] >= rates["static_cold"]


@pytest.mark.parametrize("window", [0, -4, 2.0, True, "64"])
def test_lfu_window_refuses_a_window_that_is_not_a_positive_integer(window):
    with pytest.raises(
        MoecacheError, match=f"policy lfu_window: window_tokens must be an integer >= 1, got {window!r}"
    ):
        make_policy("lfu_window", window_tokens=window)
