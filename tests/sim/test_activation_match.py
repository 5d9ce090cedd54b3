"""Policy activation_match (moecache/sim/policies/activation_match.py): hand-computed hits, matching and
prefetch semantics, the compiled policy against the plain Python reference (RefActivationMatch in
tests/sim/reference.py), capacity bounds, timed = instant at infinite bandwidth, and parameters."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from moecache.errors import MoecacheError
from moecache.sim.cost_model import CostModel
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.timed import replay_timed
from tests.sim.reference import reference_run
from tests.sim.strategies import assert_matches_reference, skewed_trace, small_traces

NAME = "activation_match"

# 2 layers x 3 experts: layer 0 -> keys 0, 1, 2; layer 1 -> keys 3, 4, 5. One-token decode steps.
# Request r0 runs the pattern (0, 3) twice, r1 once (1, 4), r2 once (0, 3) again.
REPEAT = [
    (0, 0, 0, [[0]]),  # access 0
    (0, 0, 1, [[0]]),  # access 1: key 3
    (0, 1, 0, [[0]]),  # access 2
    (0, 1, 1, [[0]]),  # access 3: key 3
    (1, 0, 0, [[1]]),  # access 4: key 1
    (1, 0, 1, [[1]]),  # access 5: key 4
    (2, 0, 0, [[0]]),  # access 6: key 0
    (2, 0, 1, [[0]]),  # access 7: key 3
]
# Hits at capacities 0..6, by hand. Stored matrices: r0 -> A = {0: 2, 3: 2}, r1 -> B = {1: 1, 4: 1}.
# Capacity 2, budget 2 (the default):
#   r0: 0 and 3 fill the free slots; the second token hits both (2 hits). No match (nothing stored).
#   r1 step [1]: A is pushed; cur = {1: 1}, dot with A = 0: no match, priority = r1's own counts.
#     victim among {0, 3}: counts 0 and 0, last accesses 2 and 3 -> 0 (older); 1 (count 1 >= 0)
#     replaces it. Step [4]: victim among {3, 1}: counts 0 and 1 -> 3; 4 replaces it. Held {1, 4}.
#   r2 step [0]: B is pushed; cur = {0: 1}: dot A = 2 > 0, dot B = 0 -> match A, priority = A's
#     counts. 0 (2) replaces the victim 1 (A: 0; last access 4 < 5 of key 4). Prefetch of layer 1:
#     A's keys with a count > 0: [3], not held; the victim among {4, 0} minus this step's 0 is 4
#     (A: 0 < 2), so 3 replaces 4. Step [3]: a hit. Total 3.
#   With budget 0, step [3] of r2 misses (held {4, 0}): total 2.
# Capacity 1: every access misses (r2's prefetch finds no victim: the only resident, 0, was accessed
#   by the step itself).
# Capacity 3: r1 step [1] takes the free slot; step [4] evicts 0 (r1 counts 0, last 2 < 3 of key 3).
#   r2 step [0] (match A) evicts 1 (A: 0, last 4 < 5); the prediction [3] is held (no prefetch);
#   step [3] hits: 2 + 1 = 3, with any budget.
# Capacities 4 to 6: nothing is ever evicted: r0's second token and both accesses of r2 hit: 4.
REPEAT_HITS = {
    (): [0, 0, 3, 3, 4, 4, 4],
    (("budget", 0),): [0, 0, 2, 3, 4, 4, 4],
}


def hits(trace, capacity, **params) -> int:
    return int(replay_instant(trace, make_policy(NAME, **params), capacity).hit_A.sum())


@pytest.mark.parametrize("params", list(REPEAT_HITS), ids=str)
def test_golden_hits(make_trace, params):
    trace = make_trace(REPEAT, 2, 3)
    assert trace.num_accesses == 8
    want = REPEAT_HITS[params]
    assert [hits(trace, c, **dict(params)) for c in range(7)] == want
    assert [int(reference_run(trace, NAME, c, **dict(params)).hit_A.sum()) for c in range(7)] == want


def test_prefetch_turns_a_miss_into_a_hit(make_trace):
    """The repeated request r2 matches r0, whose matrix predicts key 3 at layer 1: prefetched during
    r2's layer-0 step, it hits; without prefetch (budget 0) the same access misses."""
    trace = make_trace(REPEAT, 2, 3)
    with_pf = replay_instant(trace, make_policy(NAME), 2)
    without = replay_instant(trace, make_policy(NAME, budget=0), 2)
    assert with_pf.hit_A.tolist() == [False, False, True, True, False, False, False, True]
    assert without.hit_A.tolist() == [False, False, True, True, False, False, False, False]
    # r2's layer-0 step: demand admits 0 (evicting 1), then the prefetch admits 3 (evicting 4)
    assert with_pf.admits_V[6] == 2 and with_pf.evicts_V[6] == 2
    assert with_pf.prefetches == 1 and with_pf.prefetches_used == 1
    assert without.prefetches == 0


def test_history_bounds_the_collection(make_trace):
    """2 layers x 2 experts (keys 0, 1 | 2, 3), capacity 2. rA: [0] then [2]; rB: [1] then [3]; rC
    repeats rA. At rC's first step cur = {0: 1}: with history 2 the collection holds rA and rB and rA
    matches (dot 1); rC's step [0] replaces 1 (rA count 0, last access 2 < 3) and the prefetch of 2
    (rA count 1) replaces 3 (count 0): rC's [2] hits. With history 1 only rB is kept, dot 0: no match,
    no prefetch, and [2] misses (held {3, 0})."""
    steps = [("a", 0, 0, [[0]]), ("a", 0, 1, [[0]]), ("b", 0, 0, [[1]]), ("b", 0, 1, [[1]])]
    steps += [("c", 0, 0, [[0]]), ("c", 0, 1, [[0]])]
    trace = make_trace(steps, 2, 2)
    assert hits(trace, 2, history=2) == 1
    assert hits(trace, 2, history=1) == 0


def test_equal_cosines_match_the_newest(make_trace):
    """rA: [0] then [3]; rB: [0] then [4]; rC: [0] then [4] (2 layers x 3 experts), capacity 2.
    rA fills the cache with 0 and 3. rB's [0] hits; its [4] (rA count 0) cannot replace the victim 3
    (rA count 1): held {0, 3}. At rC's [0], rA = {0: 1, 3: 1} and rB = {0: 1, 4: 1} have the same
    cosine with cur = {0: 1}: the newest, rB, is the match; it predicts 4 (count 1), which replaces
    3 (rB count 0). rC's [4] hits: 3 hits in all (matching rA would predict 3, held: rC's [4] misses)."""
    steps = [("a", 0, 0, [[0]]), ("a", 0, 1, [[0]]), ("b", 0, 0, [[0]]), ("b", 0, 1, [[1]])]
    steps += [("c", 0, 0, [[0]]), ("c", 0, 1, [[1]])]
    trace = make_trace(steps, 2, 3)
    got = replay_instant(trace, make_policy(NAME), 2)
    assert got.hit_A.tolist() == [False, False, True, False, True, True]


VARIANTS = [
    {},
    {"budget": 0},
    {"history": 1},
    {"history": 2, "top": 1, "budget": 1},
    {"top": 2, "budget": 3},
]


@pytest.mark.parametrize("params", VARIANTS, ids=str)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces())
def test_matches_reference(make_trace, params, case):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    assert_matches_reference(trace, NAME, params)


@settings(max_examples=40, deadline=None)
@given(case=small_traces())
def test_capacity_bounds(make_trace, case):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    assert hits(trace, 0) == 0
    assert replay_instant(trace, make_policy(NAME), 0).admits_V.sum() == 0
    for capacity in range(1, trace.num_keys + 1):
        got = replay_instant(trace, make_policy(NAME), capacity)
        held = np.cumsum(got.admits_V.astype(np.int64) - got.evicts_V)
        assert held.max() <= capacity and held.min() >= 0


# this module's sizes of the shared skewed trace
random_trace = functools.partial(skewed_trace, requests=4, tokens=10, layers=3, experts=8, top_k=2, prefill=3)


@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 24])
def test_timed_at_infinite_bandwidth_equals_instant(make_trace, capacity):
    trace = random_trace(make_trace)
    cost = CostModel(
        copy_latency_us=2.0,
        bandwidth_bytes_per_us=128.0,
        expert_bytes=1024,
        cpu_us_M=np.linspace(0, 40, 5),
        gpu_us_M=np.linspace(0, 4, 5),
    ).infinite_bandwidth()
    for params in ({}, {"budget": 4, "history": 2}):
        inst = replay_instant(trace, make_policy(NAME, **params), capacity)
        timed = replay_timed(trace, make_policy(NAME, **params), capacity, cost)
        assert np.array_equal(timed.hit_A, inst.hit_A)
        assert np.array_equal(timed.slot_A, inst.hit_A)
        assert np.array_equal(timed.admits_V, inst.admits_V)
        assert np.array_equal(timed.evicts_V, inst.evicts_V)
        assert timed.wasted_copies == 0
    if capacity == 7:
        assert inst.prefetches > 0  # the random trace does exercise prefetching


@pytest.mark.parametrize(
    "params,word",
    [
        ({"history": 0}, "history"),
        ({"history": 2.5}, "history"),
        ({"history": True}, "history"),
        ({"top": 0}, "top"),
        ({"top": "8"}, "top"),
        ({"budget": -1}, "budget"),
        ({"budget": None}, "budget"),
        ({"lookahead": 2}, "lookahead"),
    ],
)
def test_bad_parameters_are_named(params, word):
    with pytest.raises(MoecacheError, match=word):
        make_policy(NAME, **params)


def test_registered_as_a_prefetcher(make_trace):
    policy = make_policy(NAME)
    # a prefetcher that needs no cost model: it replays with none bound
    trace = make_trace([(0, 0, 0, [[0]]), (0, 0, 1, [[1]])], 2, 2)
    assert policy.prefetches and policy.cost is None
    assert replay_instant(trace, policy, 1).hit_A.size == trace.num_accesses
    assert policy.params == {"history": 32, "top": 8, "budget": 2}
