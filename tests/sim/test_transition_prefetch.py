"""Policy transition_prefetch (moecache/sim/policies/transition_prefetch.py): golden hit counts worked
out by hand, the compiled policy against the plain Python reference, budget 0 = lfu, capacity edges,
timed = instant at infinite bandwidth, the union-to-union transition counts, and parameters."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError
from moecache.sim.cost_model import CostModel
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.timed import replay_timed
from tests.sim.reference import reference_run
from tests.sim.strategies import assert_matches_reference, small_traces

NAME = "transition_prefetch"
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARAMS = [
    {},
    {"budget": 1, "top": 1},
    {"budget": 5, "min_probability": 0.0},
    {"budget": 3, "top": 2, "min_probability": 0.5},
    {"budget": 2, "min_probability": 1.0},
]


def replay(trace, capacity, **params):
    return replay_instant(trace, make_policy(NAME, **params), capacity)


def hits_at(trace, name, capacity, **params) -> int:
    return int(replay_instant(trace, make_policy(name, **params), capacity).hit_A.sum())


# 2 layers x 2 experts (keys: layer 0 -> 0, 1; layer 1 -> 2, 3), one request of 8 decode steps:
# expert 0 of layer 0 is always followed by expert 0 of layer 1 (key 2), expert 1 by expert 1 (key 3).
ALTERNATING = [(0, f, layer, [[f % 2]]) for f in range(8) for layer in range(2)]
# Hits at capacities 0..4 (16 accesses), by hand. Fk = forward step k; cN = count of key N.
# lfu: F0 admits 0 and 2. A new key then needs a count strictly above the victim's, but 1 and 3 are
#   always one use behind 0 and 2 (or level with them): the cache never changes. Capacity 1 holds 0
#   (hits at F2, F4, F6: 3); 2 holds {0, 2} (both hit at F2, F4, F6: 6); 3 also takes 1 at F1 (free
#   slot): + F3, F5, F7 = 9; 4 holds all: 16 - 4 compulsory = 12.
# transition_prefetch (top 8, budget 2, min_probability 0.1), capacity 2: F3 L0 misses 1 (c1 2 = c2
#   2, victim 2: not admitted); N[0, 1] = 1, A[1, 1, 1] = 1 -> p = [0, 1]: prefetch 3, the victim 2 is
#   not a key of the step: evict 2, admit 3; F3 L1 hits 3. F4 L0 hits 0 and predicts 2: victim 3 (c 2 <
#   c0 3), evict 3, admit 2; F4 L1 hits. And so on: every L1 access from F2 on hits, L0 hits at F2, F4,
#   F6: 6 + 3 = 9. Capacity 3: F1 admits 1 (free slot); from F3 on the layer 1 key of the next step
#   is prefetched in place of the other (the victim: lowest count, then largest key, never the
#   step's key 0 or 1 at counts level with it): every access from F2 on hits, 12. Capacity 1: at F2
#   L0 the victim is 0, this step's key: stop (0 hits). F3 L0: 1 does not beat 0 (2 = 2), the victim
#   0 is not the step's key: prefetch 3 (c3 1); F3 L1 hits. F4 L0: 0 (c0 3) beats 3 (c3 2) by demand,
#   then the victim is 0, the step's key: stop; F4 L1 misses 2. F5, F7 as F3, F6 as F4: hits F2 L0,
#   F3 L1, F5 L1, F7 L1 = 4. Capacity 4: as lfu, every key admitted at its first miss: 12.
ALTERNATING_HITS = {"lfu": [0, 3, 6, 9, 12], NAME: [0, 4, 9, 12, 12]}


def test_golden_hits_alternating(make_trace):
    trace = make_trace(ALTERNATING, 2, 2)
    assert trace.num_accesses == 16
    for name, want in ALTERNATING_HITS.items():
        assert [hits_at(trace, name, c) for c in range(5)] == want, name
        assert [int(reference_run(trace, name, c).hit_A.sum()) for c in range(5)] == want, name


def test_prefetch_turns_misses_into_hits(make_trace):
    """Capacity 2 on ALTERNATING: lfu misses every layer 1 access of the odd forward steps; the
    prefetch of key 3 at F3 L0 (and F5, F7) makes each of them a hit, at a cost of one copy each."""
    trace = make_trace(ALTERNATING, 2, 2)
    lfu = replay_instant(trace, make_policy("lfu"), 2)
    got = replay(trace, 2)
    odd_l1 = [2 * f + 1 for f in (1, 3, 5, 7)]  # access index of F(odd) L1 (one access per step)
    assert not lfu.hit_A[odd_l1].any()
    assert got.hit_A[odd_l1].tolist() == [False, True, True, True]
    assert got.hit_A.sum() > lfu.hit_A.sum()
    # demand admits 0 and 2 at F0; prefetches at F3 .. F7 L0 (one each, one eviction each)
    assert got.admits_V.tolist() == [1, 1, 0, 0, 0, 0] + [1, 0] * 5
    assert got.evicts_V.tolist() == [0] * 6 + [1, 0] * 5


def test_cancelled_eviction_and_stop_at_own_prefetch(make_trace):
    """2 layers x 2 experts, capacity 2 (keys: layer 0 -> 0, 1; layer 1 -> 2, 3); c = counts.
    s0 (prefill, 3 tokens) L0 [1, 0] (c1 2, c0 1): both admitted.
    s1 L1 [2, 3] (c2 2, c3 1): 2 beats the victim 0 (c0 1): evict 0, admit 2; 3 does not beat 2.
       Transitions, union to union: A[1, i, j] = 1 for i, j in {0, 1}; N[0, 0] = N[0, 1] = 1 (token
       pairing would give A[1, 0, 1] = 0: the token that chose expert 0 of layer 0 chose 0 of layer 1).
    s2 (prefill, 2 tokens) L0 [0] (c0 3): beats the victim 2 (c2 2 = c1 2, larger key): evict 2,
       admit 0. Predict p = [1, 1]: keys 2, 3, neither held now. Prefetch 2: the victim is 1 (c1 2 <
       c0 3), not a key of the step: evict 1, and 2 keeps its slot (its eviction is cancelled).
       Prefetch 3: the victim is now 2 (c2 2), prefetched by this step: stop.
       Net: admit 0, evict 1 (lfu: admit 0, evict 2).
    s3 L1 [3, 2]: 2 hits (lfu: misses)."""
    steps = [
        (0, 0, 0, [[1], [1], [0]]),
        (0, 0, 1, [[0], [1], [0]]),
        (0, 1, 0, [[0], [0]]),
        (0, 1, 1, [[1], [0]]),
    ]
    trace = make_trace(steps, 2, 2)
    assert trace.key_A.tolist() == [1, 0, 2, 3, 0, 3, 2]
    got = replay(trace, 2)
    assert got.hit_A.tolist() == [False] * 6 + [True]
    assert got.admits_V.tolist() == [2, 1, 1, 0]
    assert got.evicts_V.tolist() == [0, 1, 1, 0]
    lfu = replay_instant(trace, make_policy("lfu"), 2)
    assert lfu.hit_A.sum() == 0
    ref = reference_run(trace, NAME, 2)
    assert ref.hit_A.tolist() == got.hit_A.tolist()
    assert (ref.admissions, ref.evictions) == (4, 2)


def capture_state(policy):
    """Make `policy` keep the state of its next replay in policy.captured."""
    init = policy.init_state

    def keep(trace, capacity):
        policy.captured = init(trace, capacity)
        return policy.captured

    policy.init_state = keep
    return policy


def test_transition_counts_union_to_union(make_trace):
    # 3 layers x 3 experts. Request 0: a 2-token prefill step, then a decode step; request 1: one
    # decode step. Across forward steps (layer 2 -> layer 0) nothing is counted.
    steps = [
        (0, 0, 0, [[0], [1]]),
        (0, 0, 1, [[2], [0]]),
        (0, 0, 2, [[1], [1]]),
        (0, 1, 0, [[2]]),
        (0, 1, 1, [[2]]),
        (0, 1, 2, [[0]]),
        (1, 0, 0, [[0]]),
        (1, 0, 1, [[1]]),
        (1, 0, 2, [[1]]),
    ]
    trace = make_trace(steps, 3, 3)
    policy = capture_state(make_policy(NAME))
    replay_instant(trace, policy, 4)
    trans, succ = policy.captured[4], policy.captured[5]
    A = trans.reshape(3, 3, 3)
    want = np.zeros((3, 3, 3), np.int64)
    for i in (0, 1):  # prefill: union {0, 1} -> union {2, 0}, -> union {1}: every pair once
        for j in (2, 0):
            want[1, i, j] += 1
    for i in (2, 0):
        want[2, i, 1] += 1
    want[1, 2, 2] += 1  # decode 2 -> 2 -> 0
    want[2, 2, 0] += 1
    want[1, 0, 1] += 1  # request 1: 0 -> 1 -> 1
    want[2, 1, 1] += 1
    assert np.array_equal(A, want)
    # N[n, i]: times expert i of layer n had a successor step; layer 2 never has one
    assert succ.reshape(3, 3).tolist() == [[2, 1, 1], [1, 1, 2], [0, 0, 0]]
    assert np.array_equal(A[1:].sum(axis=2) >= succ.reshape(3, 3)[:2], np.ones((2, 3), bool))


@pytest.mark.parametrize(
    "params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults"
)
@FAST
@given(case=small_traces(max_steps=48))
def test_matches_reference(make_trace, params, case):
    trace = make_trace(*case)
    assert_matches_reference(trace, NAME, params)


@FAST
@given(case=small_traces(max_steps=48))
def test_budget_zero_is_lfu(make_trace, case):
    trace = make_trace(*case)
    for capacity in range(trace.num_keys + 1):
        got = replay(trace, capacity, budget=0)
        lfu = replay_instant(trace, make_policy("lfu"), capacity)
        assert np.array_equal(got.hit_A, lfu.hit_A), f"capacity {capacity}"
        assert np.array_equal(got.admits_V, lfu.admits_V), f"capacity {capacity}"
        assert np.array_equal(got.evicts_V, lfu.evicts_V), f"capacity {capacity}"


@FAST
@given(case=small_traces(max_steps=48))
def test_capacity_edges_and_bound(make_trace, case):
    trace = make_trace(*case)
    for params in PARAMS:
        zero = replay(trace, 0, **params)
        assert not zero.hit_A.any() and zero.admits_V.sum() == 0
        for capacity in range(1, trace.num_keys + 1):
            got = replay(trace, capacity, **params)  # the driver also raises past the capacity
            held = np.cumsum(got.admits_V.astype(np.int64) - got.evicts_V)
            assert held.max() <= capacity and held.min() >= 0


def hand_cost() -> CostModel:
    return CostModel(
        copy_latency_us=2.0,
        bandwidth_bytes_per_us=128.0,
        expert_bytes=1024,
        cpu_us_M=np.linspace(0, 40, 5),
        gpu_us_M=np.linspace(0, 4, 5),
    )


@FAST
@given(case=small_traces(max_steps=48))
def test_timed_infinite_bandwidth_equals_instant(make_trace, case):
    trace = make_trace(*case)
    cost = hand_cost().infinite_bandwidth()
    for capacity in range(trace.num_keys + 1):
        inst = replay(trace, capacity)
        timed = replay_timed(trace, make_policy(NAME), capacity, cost)
        assert np.array_equal(timed.hit_A, inst.hit_A)
        assert np.array_equal(timed.slot_A, inst.hit_A)
        assert np.array_equal(timed.admits_V, inst.admits_V)
        assert np.array_equal(timed.evicts_V, inst.evicts_V)
        assert timed.wasted_copies == 0


def test_timed_prefetch_needs_its_copy(make_trace):
    """ALTERNATING at capacity 2: a prefetched key holds its slot at the next layer step, but at a
    bandwidth too low for the copy to complete it runs on the CPU there."""
    trace = make_trace(ALTERNATING, 2, 2)
    fast = replay_timed(trace, make_policy(NAME), 2, hand_cost())
    slow = replay_timed(trace, make_policy(NAME), 2, hand_cost().replace(bandwidth_bytes_per_us=1e-12))
    odd_l1 = [2 * f + 1 for f in (3, 5, 7)]
    assert slow.slot_A[odd_l1].all() and not slow.hit_A[odd_l1].any()
    assert fast.hit_A[odd_l1].all()  # a 10 us copy, ready at the next step's routing (10 us later)
    assert np.array_equal(fast.admits_V, slow.admits_V)


@pytest.mark.parametrize(
    "params,word",
    [
        ({"top": 0}, "top"),
        ({"top": 2.5}, "top"),
        ({"top": True}, "top"),
        ({"budget": -1}, "budget"),
        ({"budget": 1.0}, "budget"),
        ({"budget": "2"}, "budget"),
        ({"min_probability": -0.1}, "min_probability"),
        ({"min_probability": 1.5}, "min_probability"),
        ({"min_probability": float("nan")}, "min_probability"),
        ({"min_probability": "high"}, "min_probability"),
        ({"half_life_tokens": 3}, "unknown parameter"),
    ],
)
def test_bad_parameters(params, word):
    with pytest.raises(MoecacheError, match=word):
        make_policy(NAME, **params)


def test_config_and_flags(make_trace):
    conf = yaml.safe_load((REPO_ROOT / "conf/policy/transition_prefetch.yaml").read_text())
    assert conf == {"name": NAME, "params": {"top": 8, "budget": 2, "min_probability": 0.1}}
    policy = make_policy(NAME)
    assert policy.params == conf["params"]
    assert policy.prefetches and policy.cold_start and policy.cost is None
    trace = make_trace([(0, 0, 0, [[0]]), (0, 0, 1, [[1]])], 2, 2)
    assert replay_instant(trace, policy, 1).hit_A.size == trace.num_accesses  # no cost model needed
    make_policy(NAME, top=1, budget=0, min_probability=0)  # the edges are valid
