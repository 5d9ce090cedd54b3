"""Policy impact (moecache/sim/policies/impact.py): a golden trace worked out by hand, the compiled policy
against the plain-Python reference at every capacity, the cost rules (a copy that cannot pay for itself
is never made; an expert the CPU runs no slower is never cached), compulsory misses with free copies,
timed = instant at infinite bandwidth, the prefetch turning a miss into a hit, parameters, and a
real-trace smoke run."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.errors import MoecacheError
from moecache.sim.cost_model import instant_step_us
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.timed import replay_timed
from tests.sim.reference import reference_run
from tests.sim.strategies import assert_matches_reference, hand_cost, skewed_trace, small_traces

PROFILE = (
    Path(__file__).resolve().parents[2] / "moecache/data/cost_profiles/h200_qwen3_6_35b_a3b_2026-11-30.json"
)


def replay(trace, capacity, cost, **params):
    return replay_instant(trace, make_policy("impact", **params).bind_cost(cost), capacity)


# ---- golden trace, by hand -------------------------------------------------------------------------

# 3 layers x 2 experts (keys: layer 0 -> 0, 1; layer 1 -> 2, 3; layer 2 -> 4, 5), decode, 4 slots.
GOLDEN = [
    (0, 0, 0, [[0]]),  # key 0
    (0, 0, 1, [[0]]),  # key 2
    (0, 0, 2, [[0, 1]]),  # keys 4, 5
    (0, 1, 0, [[0]]),  # key 0
    (0, 1, 1, [[0, 1]]),  # keys 2, 3
    (0, 1, 2, [[1]]),  # key 5
    (0, 2, 0, [[0]]),  # key 0
    (0, 2, 1, [[0, 1]]),  # keys 2, 3
    (0, 2, 2, [[1]]),  # key 5
]


@pytest.mark.parametrize("budget", [0, 1])
def test_golden(make_trace, budget):
    """alpha 0.5, horizon 8, hand_cost: impact I = S x 5 (M = 1), a copy pays iff 8 I > 10, I > 1.25.
    Forward 0: every key is new, S = 0.5, I = 2.5 > 1.25: 0, 2, 4, 5 fill the 4 slots.
    Forward 1: layer 0: 0 hits, S0 = 0.5 + 0.5 x 0.5 = 0.75. Layer 1: 2 hits (S2 = 0.75); 3 misses with
      S3 = 0.5, I = 2.5; the victim, lowest I outside the step {2, 3}: 4 and 5 tie at 2.5 (0: 3.75), the
      larger key 5; 2.5 is not > 2.5: 3 stays out (the CPU runs it). Layer 2: 5 hits (S5 = 0.75), 4
      decays to 0.25 (I 1.25).
    Forward 2: layer 0: 0 hits (S0 = 0.875).
      budget 1: prefetch of layer 1: its best non-held key 3, I = 2.5 (as of layer 1's last visit); the
        victim outside {0}: 4 (1.25; 2 and 5: 3.75): 3 replaces 4. Layer 1: 2 and 3 both hit. The
        prefetch of layer 2 considers 4: 8 x 1.25 = 10 is not > 10, refused. Layer 2: 5 hits.
      budget 0: layer 1: 2 hits, 3 misses (S3 = 0.5 + 0.5 x 0.5 = 0.75, I 3.75) and replaces 4 (1.25);
        layer 2: 5 hits.
    So the prefetch turns the access of 3 in forward 2 from a miss into a hit: 6 -> 7 hits."""
    trace = make_trace(GOLDEN, 3, 2)
    cost = hand_cost()
    got = replay(trace, 4, cost, alpha=0.5, budget=budget)
    ref = reference_run(trace, "impact", 4, cost=cost, alpha=0.5, budget=budget)
    last = [True, True, True, True] if budget else [True, True, False, True]
    want = [False] * 4 + [True, True, False, True] + last
    assert got.hit_A.tolist() == want
    assert ref.hit_A.tolist() == want
    if budget:  # the prefetch of 3 (evicting 4) happens at forward 2's layer-0 step
        assert got.admits_V.tolist() == [1, 1, 2, 0, 0, 0, 1, 0, 0]
        assert got.evicts_V.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    else:  # the demand copy of 3 (evicting 4) at forward 2's layer-1 step
        assert got.admits_V.tolist() == [1, 1, 2, 0, 0, 0, 0, 1, 0]
        assert got.evicts_V.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 0]
    assert (ref.admissions, ref.evictions) == (int(got.admits_V.sum()), int(got.evicts_V.sum()))


# ---- compiled == reference ---------------------------------------------------------------------------


COSTS = {
    "hand": hand_cost(),
    "free copies": hand_cost().infinite_bandwidth(),
    "cpu cheaper at M=2": hand_cost(cpu=(0, 6, 1, 11, 12)),  # saving(2) = -0.5
    "dear copies": hand_cost(latency=30.0),  # 38 us: a copy needs I > 4.75 (horizon 8)
}
PARAMS = [
    {},
    {"alpha": 0.5, "budget": 2},
    {"alpha": 1.0},
    {"alpha": 0.9, "horizon": 1.5, "budget": 0},
    {"alpha": 0.05, "horizon": 30},
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces(), params=st.sampled_from(PARAMS), cost=st.sampled_from(sorted(COSTS)))
def test_matches_reference(make_trace, case, params, cost):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    assert_matches_reference(trace, "impact", params, COSTS[cost])
    for capacity in range(trace.num_keys + 1):
        got = replay(trace, capacity, COSTS[cost], **params)
        held = np.cumsum(got.admits_V.astype(np.int64) - got.evicts_V)
        assert held.max(initial=0) <= capacity  # never over capacity (the driver checks it too)
        if capacity == 0:
            assert not got.hit_A.any() and got.admits_V.sum() == 0


def test_renormalises(make_trace):
    """alpha 0.9: a layer's weight grows 10x (3.3 doublings) a visit, so its stored values are rescaled
    (past 2^512) within 160 visits; decisions still match the reference, which never rescales."""
    rng = np.random.default_rng(3)
    steps = []
    for i in range(250):
        for layer in range(2):
            steps.append((0, i, layer, [list(rng.choice(4, size=2, replace=False, p=[0.4, 0.3, 0.2, 0.1]))]))
    trace = make_trace(steps, 2, 4)
    cost = hand_cost()
    for capacity in (1, 2, 3, 5):
        for params in ({"alpha": 0.9}, {"alpha": 0.9, "budget": 2}):
            got = replay(trace, capacity, cost, **params)
            ref = reference_run(trace, "impact", capacity, cost=cost, **params)
            assert np.array_equal(got.hit_A, ref.hit_A), (capacity, params)
            assert int(got.admits_V.sum()) == ref.admissions


# ---- the cost rules ----------------------------------------------------------------------------------


# this module's sizes of the shared skewed trace
random_trace = functools.partial(skewed_trace, requests=3, tokens=12, layers=3, experts=8, top_k=2, prefill=4)


def test_copy_that_cannot_pay_is_never_made(make_trace):
    """copy_us ~ 1e12 us: no impact (at most 9.5 us a visit) pays for a copy in 8 visits: nothing is ever
    admitted, at any capacity, and every access runs on the CPU."""
    trace = random_trace(make_trace)
    cost = hand_cost(bandwidth=1e-9)
    for capacity in (0, 5, trace.num_keys):
        got = replay(trace, capacity, cost, budget=2)
        assert got.admits_V.sum() == 0 and not got.hit_A.any()
        timed = replay_timed(trace, make_policy("impact", budget=2).bind_cost(cost), capacity, cost)
        assert timed.copies_total == 0 and not timed.hit_A.any()
        cpu_V = np.bincount(
            np.repeat(np.arange(trace.num_steps), np.diff(trace.start_V)), cost.cpu_table()[trace.uses_A]
        )
        np.testing.assert_allclose(timed.step_us_V, cpu_V)


@pytest.mark.parametrize("cpu_at_2", [1.0, 1.5])  # saving(2) = -0.5 and exactly 0
@pytest.mark.parametrize("budget", [0, 2])
def test_expert_the_cpu_runs_no_slower_is_never_cached(make_trace, cpu_at_2, budget):
    """2-token prefill steps; in both layers expert 0 serves both tokens (one call of M = 2, where the CPU
    is no slower than the GPU), experts 1 and 2 one token each (M = 1, saving 5 us). Copies are free and
    every slot is available: keys 1, 2, 4, 5 are copied at their first use and hit after, keys 0 and 3
    (expert 0 of each layer) are never copied, not even as prefetches."""
    steps = [(0, s, layer, [[0, 1], [0, 2]]) for s in range(5) for layer in range(2)]
    trace = make_trace(steps, 2, 3)
    cost = hand_cost(cpu=(0, 6, cpu_at_2, 11, 12)).infinite_bandwidth()
    for alpha in (0.3, 1.0):
        got = replay(trace, trace.num_keys, cost, alpha=alpha, budget=budget)
        never = np.isin(trace.key_A, [0, 3])
        assert not got.hit_A[never].any()
        first = np.zeros(trace.num_accesses, bool)
        first[np.unique(trace.key_A, return_index=True)[1]] = True
        assert got.hit_A[~never & ~first].all()
        assert int(got.admits_V.sum()) == 4
        ref = reference_run(trace, "impact", trace.num_keys, cost=cost, alpha=alpha, budget=budget)
        assert np.array_equal(ref.hit_A, got.hit_A)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces(), budget=st.sampled_from([0, 1, 2]))
def test_compulsory_misses_only_with_free_copies(make_trace, case, budget):
    """alpha 1, copies free, every slot available, the CPU slower at every M: every miss is copied at its
    first use and never evicted, so only compulsory misses remain (no key is known before its first use,
    so no prefetch can remove one)."""
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    got = replay(trace, trace.num_keys, hand_cost().infinite_bandwidth(), alpha=1.0, budget=budget)
    compulsory = len(set(trace.key_A.tolist()))
    assert int(got.hit_A.sum()) == trace.num_accesses - compulsory
    assert int(got.admits_V.sum()) == compulsory and got.evicts_V.sum() == 0


# ---- timed mode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 24])
def test_timed_at_infinite_bandwidth_equals_instant(make_trace, capacity):
    trace = random_trace(make_trace)
    cost = hand_cost(cpu=np.linspace(0, 40, 5), gpu=np.linspace(0, 4, 5)).infinite_bandwidth()
    for params in ({}, {"alpha": 1.0, "budget": 3}):
        inst = replay(trace, capacity, cost, **params)
        timed = replay_timed(trace, make_policy("impact", **params), capacity, cost)  # binds `cost`
        assert np.array_equal(timed.hit_A, inst.hit_A)
        assert np.array_equal(timed.slot_A, inst.hit_A)
        assert np.array_equal(timed.admits_V, inst.admits_V)
        assert np.array_equal(timed.evicts_V, inst.evicts_V)
        assert timed.wasted_copies == 0
        np.testing.assert_allclose(timed.step_us_V, instant_step_us(trace, inst.hit_A, cost))


@pytest.mark.parametrize("bandwidth", [1e-3, 10.0, 128.0])
def test_placements_do_not_depend_on_the_mode(make_trace, bandwidth):
    """With the same cost bound, timed and instant replays make the same placements; only usability differs."""
    trace = random_trace(make_trace, seed=1)
    cost = hand_cost(bandwidth=bandwidth)
    inst = replay(trace, 5, cost, budget=2)
    timed = replay_timed(trace, make_policy("impact", budget=2).bind_cost(cost), 5, cost)
    assert np.array_equal(timed.slot_A, inst.hit_A)
    assert np.array_equal(timed.admits_V, inst.admits_V)
    assert not np.any(timed.hit_A & ~timed.slot_A)


# ---- parameters and the cost binding ----------------------------------------------------------------


def test_needs_a_bound_cost(make_trace):
    trace = make_trace(GOLDEN, 3, 2)
    with pytest.raises(MoecacheError, match="policy impact weighs measured costs"):
        replay_instant(trace, make_policy("impact"), 2)
    assert make_policy("impact").prefetches
    # bound, the same replay runs
    assert (
        replay_instant(trace, make_policy("impact").bind_cost(hand_cost()), 2).hit_A.size
        == trace.num_accesses
    )


def test_cost_tables_must_cover_the_trace(make_trace):
    """A call of more tokens than the cost tables hold is refused by the step itself, so the instant
    replay and the runtime's manager refuse it alike (the timed replay's cost model refuses it first)."""
    trace = make_trace([(0, 0, 0, [[0]] * 3)], 1, 2)  # one call of 3 tokens
    short = hand_cost(cpu=(0, 6, 9), gpu=(0, 1, 1.5))
    with pytest.raises(MoecacheError, match="more tokens than the cost model's tables hold"):
        replay(trace, 1, short)
    with pytest.raises(MoecacheError, match="cost model tabulated up to 2 tokens"):  # the timing's own check
        replay_timed(trace, make_policy("impact").bind_cost(short), 1, short)
    from tests.runtime.helpers import manager, random_store

    m = manager("impact", 1, store=random_store(L=1, E=2), top_k=1, cost=short)
    m.visit(0, np.array([[0], [0]]))  # two tokens: within the tables
    with pytest.raises(MoecacheError, match="more tokens than the cost model's tables hold"):
        m.visit(0, np.array([[0], [0], [0]]))


@pytest.mark.parametrize(
    "params,word",
    [
        ({"alpha": 0}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": "high"}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"horizon": 0}, "horizon"),
        ({"horizon": -8}, "horizon"),
        ({"horizon": float("inf")}, "horizon"),
        ({"horizon": None}, "horizon"),
        ({"budget": -1}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"budget": True}, "budget"),
        ({"window": 3}, "unknown parameter"),
    ],
)
def test_bad_parameters(params, word):
    with pytest.raises(MoecacheError, match=word):
        make_policy("impact", **params)


def test_real_trace_smoke(esft_law_trace):
    from moecache.cost_profile import CostProfile
    from moecache.sim.sweep import CostSettings, cost_model

    trace = esft_law_trace
    cost = cost_model(trace, CostProfile.load(PROFILE), CostSettings())
    policy = make_policy("impact").bind_cost(cost)
    result = replay_instant(trace, policy, 300)
    assert 0.3 < result.hit_A.mean() < 0.7


def test_a_tie_of_scores_across_layers_breaks_as_in_the_reference(make_trace):
    """Found by Hypothesis: at step 7 the miss (1, 1) and the victim (2, 1) both have impact 1.5 in
    exact arithmetic, their layers visited 3 and 2 times. The weight 2^(V log2(1 / (1 - alpha))) is
    computed by the compiled step with exp2 (LLVM's rewrite of 2.0 ** y), and CPython's 2.0 ** y
    differs from it in the last bit at V = 3 (1000.0000000000011 against ...13): the reference must use
    the same exp2 (math.exp2) or the tie breaks the other way."""
    steps = [(0, 0, layer, [[0]]) for layer in range(3)]
    steps += [(0, 1, 0, [[0]] * 3), (0, 1, 1, [[0]] * 3), (0, 1, 2, [[0], [0], [1]])]
    steps += [(0, 2, 0, [[0]] * 3), (0, 2, 1, [[0], [0], [1]]), (0, 2, 2, [[0]] * 3)]
    steps += [(0, 3, 0, [[0]]), (0, 3, 1, [[0]]), (0, 3, 2, [[1]])]
    steps += [(0, step, layer, [[0]]) for step in range(4, 12) for layer in range(3)]
    trace = make_trace(steps, 3, 5, 1)
    assert_matches_reference(
        trace, "impact", {"alpha": 0.9, "horizon": 1.5, "budget": 0}, COSTS["free copies"]
    )
