"""Timed replay (moecache/sim/timed.py), the cost model and the metrics, on hand-computed examples.

Hand examples use expert_bytes = 1024 (the conftest builder's default) and a CostModel built by hand:
latency 2 us + 1024 B / 128 B/us = a 10 us copy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.cost_profile import CostProfile
from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError
from moecache.sim.cost_model import CostModel, instant_step_us
from moecache.sim.metrics import per_layer, per_request, summarize
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.replay import initial_resident_mask, replay_instant
from moecache.sim.timed import TimedResult, _lag_at, replay_timed
from tests.conftest import decode_steps
from tests.runtime.helpers import split_profile
from tests.sim.strategies import hand_cost

PROFILE = REPO_ROOT / "moecache/data/cost_profiles/h200_qwen3_6_35b_a3b_2026-11-30.json"


def random_trace(make_trace, seed=0, requests=3, tokens=12, layers=3, experts=8, top_k=2, prefill=4):
    """Requests of one prefill step of `prefill` tokens, then decode steps."""
    rng = np.random.default_rng(seed)
    steps = []
    for r in range(requests):
        sizes = [prefill] + [1] * (tokens - prefill)
        for step, n in enumerate(sizes):
            for layer in range(layers):
                # skewed routing, so caches hit
                toks = [list(rng.choice(experts, top_k, replace=False, p=_skew(experts))) for _ in range(n)]
                steps.append((f"r{r}", step, layer, toks))
    return make_trace(steps, layers, experts, top_k)


def _skew(n):
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


def all_policies(trace, capacity, policy_params):
    """Every registered policy with default parameters (profile_static with a profile of the trace's
    shape), skipping any that cannot run on them (a cost-aware policy without a bound cost model)."""
    out = []
    for name in sorted(POLICIES):
        try:
            policy = make_policy(name, **policy_params(name, trace))
            policy.init_state(trace, capacity)
        except MoecacheError:
            continue
        out.append(policy)
    return out


# ---- equivalences with instant mode ------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 24])
def test_infinite_bandwidth_equals_instant_for_every_policy(make_trace, policy_params, capacity):
    trace = random_trace(make_trace)
    cost = hand_cost(cpu=np.linspace(0, 40, 5), gpu=np.linspace(0, 4, 5)).infinite_bandwidth()
    policies = all_policies(trace, capacity, policy_params)
    assert {"lru", "profile_static"} <= {p.name for p in policies}
    for policy in policies:
        inst = replay_instant(trace, make_policy(policy.name, **policy.params), capacity)
        timed = replay_timed(trace, make_policy(policy.name, **policy.params), capacity, cost)
        assert np.array_equal(timed.hit_A, inst.hit_A), policy.name
        assert np.array_equal(timed.slot_A, inst.hit_A), policy.name
        assert np.array_equal(timed.admits_V, inst.admits_V), policy.name
        assert np.array_equal(timed.evicts_V, inst.evicts_V), policy.name
        assert timed.wasted_copies == 0
        assert timed.copies_ready_next_visit == timed.copies_with_next_visit
        np.testing.assert_allclose(timed.step_us_V, instant_step_us(trace, inst.hit_A, cost))


@pytest.mark.parametrize("bandwidth", [1e-9, 10.0, 128.0])
def test_placements_do_not_depend_on_bandwidth(make_trace, policy_params, bandwidth):
    """The policy sees every key holding a slot, loading or not: only usability depends on time."""
    trace = random_trace(make_trace, seed=1)
    for policy in all_policies(trace, 5, policy_params):
        inst = replay_instant(trace, make_policy(policy.name, **policy.params), 5)
        timed = replay_timed(
            trace, make_policy(policy.name, **policy.params), 5, hand_cost(bandwidth=bandwidth)
        )
        assert np.array_equal(timed.slot_A, inst.hit_A), policy.name
        assert np.array_equal(timed.admits_V, inst.admits_V), policy.name
        assert not np.any(timed.hit_A & ~timed.slot_A)


def test_tiny_bandwidth_no_copy_is_ever_ready(make_trace, policy_params):
    trace = random_trace(make_trace, seed=2)
    cost = hand_cost(bandwidth=1e-12)
    for policy in all_policies(trace, 6, policy_params):
        inst = replay_instant(trace, make_policy(policy.name, **policy.params), 6)
        timed = replay_timed(trace, make_policy(policy.name, **policy.params), 6, cost)
        assert timed.copies_ready_next_visit == 0
        if policy.cold_start:
            assert not timed.hit_A.any(), policy.name
        if policy.name.startswith("static"):  # resident from the start, free: every instant hit stays
            assert np.array_equal(timed.hit_A, inst.hit_A)
            # hits iff the policy starts with residents (static_layers holds whole layers: at 6 slots
            # of 8-expert layers, none)
            state = policy.init_state(trace, 6)
            assert inst.hit_A.any() == initial_resident_mask(policy, state, trace, 6).any()


# ---- hand examples ---------------------------------------------------------------------------


def test_fifo_copy_engine(make_trace):
    """One layer, top-2 decode, LRU with 4 slots; cpu 6, gpu 1 per call; copy 10 us.
    t=0  [0,1]: both miss (cpu 12). copies: key 0 [0, 10], key 1 queued behind it [10, 20].
    t=12 [0,2]: key 0 ready (10 <= 12): hit (gpu 1); key 2 miss (cpu 6). copy key 2 [20, 30].
    t=18 [1,2]: both hold slots but are loading (20, 30 > 18): CPU (12); nothing admitted.
    t=30 [1,2]: both ready: hits (gpu 2)."""
    trace = make_trace([(0, i, 0, [e]) for i, e in enumerate([[0, 1], [0, 2], [1, 2], [1, 2]])], 1, 8)
    r = replay_timed(trace, make_policy("lru"), 4, hand_cost())
    assert r.hit_A.tolist() == [False, False, True, False, False, False, True, True]
    assert r.slot_A.tolist() == [False, False, True, False, True, True, True, True]
    assert r.step_us_V.tolist() == [12, 6, 12, 2]
    assert r.route_us_V.tolist() == [0, 12, 18, 30]
    assert r.copy_key_C.tolist() == [0, 1, 2]
    assert r.copy_start_us_C.tolist() == [0, 10, 20]
    assert r.copy_ready_us_C.tolist() == [10, 20, 30]
    assert r.copy_ready_next_C.tolist() == [True, False, False]
    assert r.copies_ready_next_visit == 1 and r.copies_with_next_visit == 3
    assert r.cpu_fallbacks == 5 and r.cpu_fallback_selections == 5
    assert r.forward_us_F.tolist() == [12, 6, 12, 2]
    row = summarize(trace, r)
    assert row["ready_fraction"] == pytest.approx(1 / 3)
    assert row["hit_rate"] == pytest.approx(3 / 8) and row["slot_hit_rate"] == pytest.approx(5 / 8)
    assert row["est_total_ms"] == pytest.approx(0.032)
    assert row["est_ms_per_token"] == pytest.approx(0.032 / 4)


def test_wait_mode_waits_for_its_copies_and_runs_those_misses_on_the_gpu(make_trace):
    """on_miss="wait" (the runtime's on_miss="wait"): one layer, LRU with 4 slots; cpu 6, gpu 1 per call,
    copy 10 us.
    t=0  [0,1]: both miss, both admitted: copies [0, 10], [10, 20]; the step waits 20, then runs both on
         the GPU (2): 22. The cache's hits are counted as the step began: none.
    t=22 [0,2]: 0 hits; 2 admitted: copy [22, 32], wait 10, then 2 on the GPU: 10 + 2 = 12.
    t=34 [1,2]: both hit: 2."""
    trace = make_trace([(0, i, 0, [e]) for i, e in enumerate([[0, 1], [0, 2], [1, 2]])], 1, 8)
    r = replay_timed(trace, make_policy("lru"), 4, hand_cost(), on_miss="wait")
    assert r.step_us_V.tolist() == [22, 12, 2]
    assert r.route_us_V.tolist() == [0, 22, 34]
    assert r.hit_A.tolist() == [False, False, True, False, True, True]
    assert r.copy_start_us_C.tolist() == [0, 10, 22] and r.copy_ready_us_C.tolist() == [10, 20, 32]
    no_wait = replay_timed(trace, make_policy("lru"), 4, hand_cost())
    assert no_wait.step_us_V.tolist() == [12, 6, 12]  # the CPU runs the misses (and the loading keys)


def test_wait_mode_leaves_a_copy_into_a_busy_slot_to_the_cpu(make_trace):
    """on_miss="wait", one slot; cpu 6, gpu 1 per call; copy 10 us.
    t=0  [0,1]: LRU admits 1 (0's admission cancelled): copy [0, 10] waited, 1 on the GPU, 0 on the
         CPU: 10 + max(1, 6) = 16.
    t=16 [1,2]: 1 hits (GPU until 17); 2 evicts it, so 2's copy can only take the slot this step's own
         GPU work reads: enqueued after it (starts 17), not waited for; 2 runs on the CPU: max(1, 6)."""
    trace = make_trace([(0, i, 0, [e]) for i, e in enumerate([[0, 1], [1, 2]])], 1, 4)
    r = replay_timed(trace, make_policy("lru"), 1, hand_cost(), on_miss="wait")
    assert r.step_us_V.tolist() == [16, 6]
    assert r.copy_key_C.tolist() == [1, 2] and r.copy_start_us_C.tolist() == [0, 17]


def test_slot_reuse_waits_for_gpu_work_of_the_evicted_key(make_trace):
    """One slot; cpu 6, gpu 4 per call; copy 10 us.
    t=0  [0,1]: misses (cpu 12); LRU admits 0, then 1 evicts it (the two cancel): copy key 1 [0, 10].
    t=12 [1,2]: key 1 hit on the GPU until 16; key 2's miss evicts key 1, whose slot is busy until
    16: copy key 2 starts at 16 (not 12) and is ready at 26.
    t=18 [2,3]: key 2 still loading (26 > 18): CPU."""
    steps = [(0, i, 0, [e]) for i, e in enumerate([[0, 1], [1, 2], [2, 3]])]
    trace = make_trace(steps, 1, 4)
    r = replay_timed(trace, make_policy("lru"), 1, hand_cost(gpu=(0, 4, 5, 6, 7)))
    assert r.copy_key_C.tolist() == [1, 2, 3]
    assert r.copy_start_us_C.tolist()[:2] == [0, 16]
    assert r.copy_ready_us_C.tolist()[:2] == [10, 26]
    assert r.hit_A.tolist() == [False, False, True, False, False, False]
    assert r.step_us_V.tolist() == [12, 6, 12]
    # key 2 was evicted at t=18 while its copy ran until 26: wasted; key 3's copy queues behind it
    assert r.copy_wasted_C.tolist() == [False, True, False]
    assert r.copy_start_us_C[2] == 26
    # no GPU time: the evicted key's slot is safe at once
    r0 = replay_timed(trace, make_policy("lru"), 1, hand_cost(gpu=(0, 0, 0, 0, 0)))
    assert r0.copy_start_us_C.tolist()[:2] == [0, 12]


def test_wasted_copy_of_a_key_evicted_while_loading(make_trace):
    """One slot, copy 1000 us: key 1's copy [0, 1000] is evicted at t=12 (wasted) and still holds
    the engine: key 3's copy starts at 1000."""
    steps = [(0, 0, 0, [[0, 1]]), (0, 1, 0, [[2, 3]])]
    r = replay_timed(make_trace(steps, 1, 4), make_policy("lru"), 1, hand_cost(latency=992.0))
    assert r.copy_key_C.tolist() == [1, 3]
    assert r.copy_wasted_C.tolist() == [True, False]
    assert r.copy_start_us_C.tolist() == [0, 1000]
    assert r.wasted_copies == 1
    assert not r.copy_has_next_C[1]  # no later visit of the layer


def test_layer_time_formula_prefill_and_decode(make_trace):
    """static_cold with 2 slots keeps layer-0 experts 0 and 1 resident (ready at 0); costs per call
    cpu (0, 10, 15, 18), gpu (0, 1, 1.5, 2); non-expert 3 us per decode layer, 0.5 us per prefill token.
    prefill (3 tokens) layer 0: hits 0 (M=3), 1 (M=2) -> gpu 3.5; miss 2 (M=1) -> cpu 10: 1.5 + 10
    prefill layer 1: misses M = 2, 2, 1, 1 -> cpu 50: 1.5 + 50
    decode layer 0: hits 0, 1 -> gpu 2: 3 + 2;  decode layer 1: misses -> cpu 20: 3 + 20."""
    steps = [
        (0, 0, 0, [[0, 1], [0, 2], [0, 1]]),
        (0, 0, 1, [[0, 1], [2, 3], [0, 1]]),
        (0, 1, 0, [[0, 1]]),
        (0, 1, 1, [[2, 3]]),
    ]
    trace = make_trace(steps, 2, 4)
    cost = hand_cost(
        cpu=(0, 10, 15, 18),
        gpu=(0, 1, 1.5, 2),
        non_expert_us_per_layer=3.0,
        non_expert_us_per_prefill_token=0.5,
    )
    r = replay_timed(trace, make_policy("static_cold"), 2, cost)
    assert r.step_us_V.tolist() == [11.5, 51.5, 5, 23]
    assert r.route_us_V.tolist() == [1.5, 13, 66, 71]
    assert r.forward_us_F.tolist() == [63, 28]
    assert r.cpu_fallbacks == 7 and r.cpu_fallback_selections == 1 + 2 + 2 + 1 + 1 + 1 + 1
    np.testing.assert_allclose(instant_step_us(trace, r.hit_A, cost), r.step_us_V)
    row = summarize(trace, r)
    assert row["est_ms_prefill_per_token"] == pytest.approx(0.063 / 3)
    assert row["est_ms_per_token_decode"] == pytest.approx(0.028)
    assert row["est_tokens_per_s_decode"] == pytest.approx(1e6 / 28)
    assert row["est_ms_per_token"] == pytest.approx(0.091 / 4)
    assert row["cost_notes"] == ""  # non-expert time is modelled here


def test_metrics_hand_example(make_trace):
    """Instant LRU, 2 slots, 2 layers of 4 experts, top-1. Keys (layer*4 + expert) in access order:
    a/0: 0, 4   a/1: 0, 5   b/0 (prefill, 2 tokens): 1 (M=2), 5 (M=2)
    LRU: miss 0, miss 4, hit 0, miss 5 (evicts 4), miss 1 (evicts 0), hit 5."""
    steps = [
        ("a", 0, 0, [[0]]),
        ("a", 0, 1, [[0]]),
        ("a", 1, 0, [[0]]),
        ("a", 1, 1, [[1]]),
        ("b", 0, 0, [[1], [1]]),
        ("b", 0, 1, [[1], [1]]),
    ]
    trace = make_trace(steps, 2, 4)
    r = replay_instant(trace, make_policy("lru"), 2)
    assert r.hit_A.tolist() == [False, False, True, False, False, True]
    cost = hand_cost(cpu=(0, 10, 15), gpu=(0, 1, 1.5))
    row = summarize(trace, r, cost)
    assert row["hit_rate"] == pytest.approx(2 / 6)
    assert row["token_hit_rate"] == pytest.approx(3 / 8)
    assert row["transfers"] == row["admissions"] == 4
    assert row["evictions"] == 2
    assert row["h2d_bytes"] == 4 * trace.expert_bytes
    assert row["cpu_fallbacks"] == 4 and row["cpu_fallback_selections"] == 5
    assert row["ready_fraction"] is None and row["wasted_copies"] is None
    # free copies: step times 10, 10 | 1, 10 | 15, 1.5
    assert row["est_total_ms"] == pytest.approx(0.0475)
    assert row["est_ms_per_token_decode"] == pytest.approx(0.031 / 2)
    assert row["est_ms_prefill_per_token"] == pytest.approx(0.0165 / 2)
    assert row["est_tokens_per_s"] == pytest.approx(4 / 47.5e-6)
    assert summarize(trace, r)["est_ms_per_token"] is None  # no cost model: no estimate

    layers = per_layer(trace, r)
    assert layers["accesses"].tolist() == [3, 3]
    assert layers["hits"].tolist() == [1, 1]
    np.testing.assert_allclose(layers["hit_rate"], [1 / 3, 1 / 3])
    np.testing.assert_allclose(layers["token_hit_rate"], [1 / 4, 2 / 4])
    assert layers["admissions"].tolist() == [2, 2] and layers["evictions"].tolist() == [1, 1]

    reqs = per_request(trace, r, cost)
    assert [q["request_id"] for q in reqs] == ["a", "b"]
    a, b = reqs
    assert (a["tokens"], a["accesses"], a["transfers"], a["evictions"]) == (2, 4, 3, 1)
    assert (b["tokens"], b["accesses"], b["transfers"], b["evictions"]) == (2, 2, 1, 1)
    assert a["hit_rate"] == pytest.approx(1 / 4) and b["hit_rate"] == pytest.approx(1 / 2)
    assert b["token_hit_rate"] == pytest.approx(2 / 4)
    assert a["h2d_bytes"] == 3 * 1024
    assert a["est_total_ms"] == pytest.approx(0.031)
    assert a["est_ms_per_token_decode"] == pytest.approx(0.0155) and a["est_ms_prefill_per_token"] is None
    assert b["est_ms_prefill_per_token"] == pytest.approx(0.00825) and b["est_ms_per_token_decode"] is None


def test_timed_metrics_per_layer_and_request(make_trace):
    trace = random_trace(make_trace, seed=3)
    r = replay_timed(trace, make_policy("lru"), 12, hand_cost(bandwidth=100.0))
    assert isinstance(r, TimedResult)
    row = summarize(trace, r)
    layers = per_layer(trace, r)
    reqs = per_request(trace, r)
    assert layers["hits"].sum() == r.hit_A.sum()
    assert layers["admissions"].sum() == row["admissions"] == r.copies_total
    assert sum(q["est_total_ms"] for q in reqs) == pytest.approx(row["est_total_ms"])
    assert sum(q["transfers"] for q in reqs) == row["transfers"]
    assert np.nansum(layers["est_ms"]) == pytest.approx(row["est_total_ms"])
    assert 0 < row["ready_fraction"] < 1
    assert row["hit_rate"] < row["slot_hit_rate"]


# ---- sensitivity scales ----------------------------------------------------------------------


def test_scales_move_times_in_the_expected_direction(make_trace):
    trace = random_trace(make_trace, seed=4, requests=4, tokens=30)
    base = hand_cost(cpu=np.linspace(0, 40, 5), gpu=np.linspace(0, 4, 5), latency=5.0, bandwidth=50.0)

    def run(policy, **scales):
        r = replay_timed(trace, make_policy(policy), 8, base.replace(**scales))
        return r.total_us, r.hit_A.sum()

    # static placement: no copies, the layer times are monotone in the CPU and GPU costs
    t0, _ = run("static_hindsight")
    assert run("static_hindsight", cpu_scale=2.0)[0] > t0 > run("static_hindsight", cpu_scale=0.5)[0]
    assert run("static_hindsight", gpu_scale=2.0)[0] >= t0 >= run("static_hindsight", gpu_scale=0.5)[0]
    assert run("static_hindsight", bandwidth_scale=0.5)[0] == t0
    # a demand policy: more bandwidth, more copies ready in time, fewer CPU fallbacks
    (slow, hits_slow), (mid, hits_mid), (fast, hits_fast) = (
        run("lru", bandwidth_scale=s) for s in (0.25, 1.0, 4.0)
    )
    assert hits_slow <= hits_mid <= hits_fast and hits_slow < hits_fast
    assert slow >= mid >= fast and slow > fast
    assert base.replace(bandwidth_scale=2.0).copy_us() == pytest.approx(5.0 + 1024 / 100)
    assert np.array_equal(base.replace(cpu_scale=3.0).cpu_table(), base.cpu_us_M * 3)


# ---- the cost model from a profile --------------------------------------------------------------


def test_cost_model_from_profile():
    profile = CostProfile.load(PROFILE)
    same = CostModel.from_profile(profile, profile.expert_bytes, 8)
    assert same.copy_us() == pytest.approx(profile.copy_us(profile.expert_bytes))
    assert same.cpu_us_M[0] == 0 and same.cpu_us_M[4] == pytest.approx(profile.cpu_expert_us(4))
    assert same.gpu_us_M[1] == pytest.approx(profile.cuda_expert_us(1))
    assert same.non_expert_us_per_layer == 0 and any("not modelled" in n for n in same.all_notes())
    big = CostModel.from_profile(profile, 2 * profile.expert_bytes, 8, non_expert_us_per_layer=50.0)
    assert big.copy_us() == pytest.approx(profile.copy_us(2 * profile.expert_bytes))
    np.testing.assert_allclose(big.cpu_us_M, 2 * same.cpu_us_M)
    np.testing.assert_allclose(big.gpu_us_M, 2 * same.gpu_us_M)
    assert not any("not modelled" in n for n in big.all_notes())
    assert any("scaled by 2" in n for n in big.notes)
    assert same.cpu_threads == profile.machine["threads"]

    no_gpu = CostProfile.from_dict({**json.loads(PROFILE.read_text()), "cuda": None})
    with pytest.warns(UserWarning, match="GPU expert time taken as 0"):
        cm = CostModel.from_profile(no_gpu, profile.expert_bytes, 4)
    assert not cm.gpu_us_M.any()
    with pytest.raises(MoecacheError, match="bandwidth_scale"):
        same.replace(bandwidth_scale=0)


def test_cost_model_must_cover_the_trace(make_trace):
    trace = make_trace([(0, 0, 0, [[0], [0], [0], [1]])], 1, 4)  # key 0 called with M = 3
    with pytest.raises(MoecacheError, match="tokens per expert call"):
        replay_timed(trace, make_policy("lru"), 1, hand_cost(cpu=(0, 1, 2), gpu=(0, 1, 2)))
    with pytest.raises(MoecacheError, match="bytes"):
        replay_timed(trace, make_policy("lru"), 1, hand_cost().replace(expert_bytes=7))


# ---- the real trace (smoke) -------------------------------------------------------------------


def test_real_trace_smoke(esft_law_trace):
    trace = esft_law_trace.subset_requests(np.arange(3))
    cost = CostModel.for_trace(CostProfile.load(PROFILE), trace)
    inst = replay_instant(trace, make_policy("lru"), 300)
    free = replay_timed(trace, make_policy("lru"), 300, cost.infinite_bandwidth())
    assert np.array_equal(free.hit_A, inst.hit_A)
    timed = replay_timed(trace, make_policy("lru"), 300, cost)
    row = summarize(trace, timed)
    assert 0 < row["hit_rate"] <= row["slot_hit_rate"] == pytest.approx(inst.hit_A.mean())
    assert row["est_ms_per_token"] > 0 and math.isfinite(row["est_tokens_per_s"])
    assert "not modelled" in row["cost_notes"]


def test_split_mode_waits_for_the_copies_that_land_before_the_cpu_would_finish(make_trace):
    """on_miss="split": one layer, LRU with 4 slots; cpu 6, gpu 1 per call, copy 10 us.
    t=0  [0,1,2]: three misses, three copies landing at 10, 20, 30. CPU alone 18; waiting for the
         first (lands 10, +1 on the GPU: 11) leaves 12 on the CPU: 12; for two: 21 against 6: worse.
         w = 1: the step takes 12.
    t=12 [0,1,2]: 0 hits, 1 is late (lands 20: 8 from now, +1 = 9) and 2 too (30): CPU 12 alone,
         waiting for 1 leaves 6 against 9: 9; for both: 19. w = 1: 9.
    Hits, copies and placements are on_miss="cpu"'s."""
    trace = make_trace([(0, i, 0, [[0, 1, 2]]) for i in range(2)], 1, 8)
    r = replay_timed(trace, make_policy("lru"), 4, hand_cost(), on_miss="split")
    assert r.step_us_V.tolist() == [12, 9]
    cpu = replay_timed(trace, make_policy("lru"), 4, hand_cost())
    assert cpu.step_us_V.tolist() == [18, 12]
    assert r.hit_A.tolist() == cpu.hit_A.tolist() == [False, False, False, True, False, False]
    assert r.copy_ready_us_C.tolist() == cpu.copy_ready_us_C.tolist() == [10, 20, 30]


def test_split_mode_leaves_everything_to_the_cpu_when_copies_are_slow(make_trace):
    """A copy of 1000 us never lands before the CPU's 6 us: on_miss="split" is on_miss="cpu"."""
    trace = make_trace([(0, i, 0, [[0, 1]]) for i in range(3)], 1, 8)
    slow = hand_cost(latency=992.0)
    split = replay_timed(trace, make_policy("lru"), 4, slow, on_miss="split")
    cpu = replay_timed(trace, make_policy("lru"), 4, slow)
    assert split.step_us_V.tolist() == cpu.step_us_V.tolist()


def test_replay_timed_refuses_an_unknown_on_miss(make_trace):
    trace = make_trace([(0, 0, 0, [[0]])], 1, 4)
    with pytest.raises(MoecacheError, match="on_miss='later'"):
        replay_timed(trace, make_policy("lru"), 1, hand_cost(), on_miss="later")


def _fast_cost(lag_quantiles_us=None, warmup_pause_us=None) -> CostModel:
    """A fast-loop profile (tests/runtime/helpers.split_profile: a copy 10 us, a missed expert 6 us on the
    CPU + 1 us per call, the operator 1 us per entry) with the publish lag's quantiles and the decoder's
    warm-up pauses, if given."""
    store = SimpleNamespace(hidden_size=4, expert_bytes=1024, num_experts=4)
    profile = split_profile(store, copy_us=10.0, cpu_us=6.0)
    if lag_quantiles_us is not None:
        profile["runtime"]["publish_lag"] = {"quantiles_us": list(lag_quantiles_us)}
    if warmup_pause_us is not None:
        profile["runtime"]["decode_warmup"] = {"pause_us": list(warmup_pause_us)}
    return CostModel.from_profile(CostProfile.from_dict(profile, source="fast profile"), 1024, 64)


@pytest.mark.parametrize(
    "lag,hits_at_1", [(None, [False, False]), (15.0, [True, False]), (25.0, [True, True])]
)
def test_a_deferred_visits_copies_land_within_the_publish_lag(make_trace, lag, hits_at_1):
    """The fast loop's deferred visit (module docstring, 7.), one layer, LRU with 4 slots, two decode
    steps [0, 1]: step 0 routes at 1 (the profile's 1 us visit row), misses both (CPU 6 + 6 + 1 = 13
    us) and visits at 14, its copies [14, 24] and [24, 34]; step 1's hits are those complete at its
    publication, 14 + the publish lag: none without a lag, key 0 at 15, both at 25."""
    trace = make_trace(decode_steps([[0, 1], [0, 1]]), 1, 4)
    cost = _fast_cost(None if lag is None else (lag, lag))
    r = replay_timed(trace, make_policy("lru"), 4, cost)
    assert r.copy_start_us_C.tolist() == [14, 24] and r.copy_ready_us_C.tolist() == [24, 34]
    assert r.route_us_V.tolist() == [1, 14 + (lag or 0)]
    assert r.hit_A.tolist() == [False, False, *hits_at_1]
    assert r.slot_A.tolist() == [False, False, True, True]


def test_the_decoders_warm_up_is_a_pause_the_copy_engine_runs_through(make_trace):
    """timed.py, 8.: the steps of the publish-lag test above, step 1 the decoder's second warm-up step
    (pauses [0, 30]): its publication moves from 14 to 44, after both copies land (24, 34), so both are
    hits; step 0 is unchanged and no step's duration holds the pause."""
    trace = make_trace(decode_steps([[0, 1], [0, 1]]), 1, 4)
    plain = replay_timed(trace, make_policy("lru"), 4, _fast_cost())
    paused = replay_timed(trace, make_policy("lru"), 4, _fast_cost(warmup_pause_us=(0.0, 30.0)))
    assert plain.route_us_V.tolist() == [1, 14] and paused.route_us_V.tolist() == [1, 44]
    assert plain.hit_A.tolist() == [False] * 4 and paused.hit_A.tolist() == [False, False, True, True]
    assert paused.copy_ready_us_C.tolist() == plain.copy_ready_us_C.tolist() == [24, 34]
    assert paused.step_us_V[0] == plain.step_us_V[0] and paused.step_us_V[1] < plain.step_us_V[1]
    assert paused.forward_us_F.sum() == paused.step_us_V.sum()


def test_the_warm_up_pauses_fall_on_the_first_requests_decode_steps(make_trace):
    """A run builds one decoder: its first request's first decode steps pay the pauses, each spread over
    that step's layer steps (2 layers here); its prefill and every later request pay none; a profile
    without the row, or of the transformers loop, none at all."""
    steps = [(0, 0, layer, [[0], [1]]) for layer in range(2)]  # request 0's prefill (2 tokens)
    steps += [(r, i, layer, [[0]]) for r in (0, 1) for i in (1, 2, 3) for layer in range(2)]
    trace = make_trace(steps, 2, 4)
    pause_V = _fast_cost(warmup_pause_us=(8.0, 4.0)).pause_V(trace)
    assert pause_V.tolist() == [0, 0, 4, 4, 2, 2] + [0] * 8
    assert not _fast_cost().pause_V(trace).any()
    fast = _fast_cost(warmup_pause_us=(8.0, 4.0))
    assert (
        not fast.replace(runtime=dataclasses.replace(fast.runtime, path="transformers")).pause_V(trace).any()
    )


def test_a_prefill_step_visits_at_its_routing(make_trace):
    """The fast loop's prefill is transformers' forward, whose layers visit at their routing: a prefill
    step's copies start at its routing (2: the visit row's 1 us per token) and the next step's hits are
    checked at its own routing, after the whole prefill step (its CPU half included), not at a
    publication."""
    trace = make_trace([(0, 0, 0, [[0, 1], [0, 1]]), (0, 1, 0, [[0, 1]])], 1, 4)
    r = replay_timed(trace, make_policy("lru"), 4, _fast_cost())
    assert r.copy_start_us_C.tolist() == [2, 12]
    assert r.route_us_V.tolist() == [2, r.step_us_V[0] + 1] and r.step_us_V[0] >= 22
    assert r.hit_A.tolist() == [False, False, True, True]


def test_the_publish_lags_sample_their_quantiles_evenly():
    """Step s's lag is the quantile function at frac((s + 1) x golden ratio): over consecutive steps the
    samples follow the measured distribution (here uniform on [0, 100]) and stay inside it."""
    lags = np.array([_lag_at(np.array([0.0, 100.0]), s) for s in range(1000)])
    assert lags.min() >= 0 and lags.max() <= 100
    assert abs(lags.mean() - 50) < 1 and abs(np.median(lags) - 50) < 1
    assert _lag_at(np.array([7.0, 7.0, 7.0]), 3) == 7.0 and _lag_at(np.zeros(0), 3) == 0.0
