"""Prefetch accounting of the replay drivers (replay.py, timed.py) and its metrics (metrics.py).

A prefetch is an admission of a key that the admitting layer step did not access. It is used when its
key is accessed while still holding that slot (timed mode: timely if the copy was complete then), and
unused when the key is evicted first or the trace ends. The prefetching policy here is local to this
file (not registered): `NextExpert0` prefetches expert 0 of the next layer at every layer step, evicting
in FIFO order of admission, and optionally admits the step's misses first (demand).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import pytest

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.sim.cost_model import CostModel
from moecache.sim.metrics import per_request, summarize
from moecache.sim.policy import Policy, make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.timed import replay_timed
from tests.sim.strategies import hand_cost as shared_hand_cost


@nb.njit(_nrt=False)
def _next_expert0_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    fifo, meta = state  # meta: [head, count, capacity, experts, layers, demand]
    head, count, cap, num_experts, num_layers, demand = meta[0], meta[1], meta[2], meta[3], meta[4], meta[5]
    if cap == 0:
        return 0, 0
    n_admit = 0
    n_evict = 0
    target = (key_U[0] // num_experts + 1) * num_experts  # expert 0 of the next layer
    for i in range(key_U.shape[0] + 1):
        if i < key_U.shape[0]:  # the step's misses first (demand), then the prefetch
            k = key_U[i]
            if not demand or hit_U[i]:
                continue
        else:
            k = target
            if k >= num_experts * num_layers or resident_G[k]:
                continue
            admitted = False  # resident_G is the residency before the step: look in its admissions
            for j in range(n_admit):
                if admit_out[j] == k:
                    admitted = True
            if admitted:
                continue
        if count == cap:  # evict the oldest admission
            victim = fifo[head]
            head = (head + 1) % cap
            count -= 1
            evict_out[n_evict] = victim  # even one admitted by this step: apply_step cancels the pair
            n_evict += 1
        fifo[(head + count) % cap] = k
        count += 1
        admit_out[n_admit] = k
        n_admit += 1
    meta[0] = head
    meta[1] = count
    return n_admit, n_evict


class NextExpert0(Policy):
    """Not registered: a test policy that prefetches expert 0 of the next layer (FIFO eviction)."""

    name = "next_expert0_test"
    defaults = {"demand": False}
    prefetches = True
    step = _next_expert0_step

    def init_state(self, trace, capacity: int) -> tuple:
        meta = [0, 0, capacity, trace.num_experts, trace.num_layers, int(self.params["demand"])]
        return np.zeros(max(capacity, 1), np.int64), np.array(meta, np.int64)


def hand_cost(cpu=(0, 20, 30, 40), gpu=(0, 1, 1.5, 2), **kw) -> CostModel:
    """Per expert call against M tokens; a copy takes 2 + 1024 / 128 = 10 us."""
    return shared_hand_cost(cpu=cpu, gpu=gpu, **kw)


# 3 layers x 4 experts (keys: layer 0 -> 0..3, layer 1 -> 4..7, layer 2 -> 8..11), decode, top-1.
# Token 0: keys 1, 4, 8; token 1: 0, 5, 8 (request a); token 2: 2, 6, 9 (request b).
TOKENS = [("a", 0, [1, 0, 0]), ("a", 1, [0, 1, 0]), ("b", 0, [2, 2, 1])]


def hand_trace(make_trace):
    steps = [(r, step, layer, [[e]]) for r, step, experts in TOKENS for layer, e in enumerate(experts)]
    return make_trace(steps, 3, 4)


def test_prefetch_used_unused_and_late_timed(make_trace):
    """Prefetch only, 1 slot: layer-0 steps prefetch key 4, layer-1 steps key 8 (evicting the other).
    CPU 20 us per miss, GPU 1 us per hit, copy 10 us, one FIFO engine.
    s0 L0 key 1  tr=0:   miss (20). prefetch c0 key 4 [0, 10].
    s1 L1 key 4  tr=20:  ready (10 <= 20): hit (1): c0 USED, timely, lead 20 - 0 = 20.
                         prefetch c1 key 8 evicts 4, whose slot the GPU uses until 21: c1 [21, 31].
    s2 L2 key 8  tr=21:  holds a slot but loading (31 > 21): CPU (20): c1 USED, late, lead 21 - 20 = 1.
    s3 L0 key 0  tr=41:  miss (20). prefetch c2 key 4 evicts 8: c2 [41, 51].
    s4 L1 key 5  tr=61:  miss (20). prefetch c3 key 8 evicts 4: c2 UNUSED. c3 [61, 71].
    s5 L2 key 8  tr=81:  hit (1): c3 USED, timely, lead 81 - 61 = 20.
    s6 L0 key 2  tr=82:  miss (20). prefetch c4 key 4 evicts 8: c4 [82, 92].
    s7 L1 key 6  tr=102: miss (20). prefetch c5 key 8 evicts 4: c4 UNUSED. c5 [102, 112].
    s8 L2 key 9  tr=122: miss (20). End: c5 still pending, UNUSED.
    6 prefetches, 3 used (2 timely), 3 unused -> accuracy 1/2, wasted 3 x 1024 B; lead median of
    (20, 1, 20) = 20. No copy is wasted (every evicted copy had completed)."""
    trace = hand_trace(make_trace)
    r = replay_timed(trace, NextExpert0(), 1, hand_cost())
    assert r.route_us_V.tolist() == [0, 20, 21, 41, 61, 81, 82, 102, 122]
    assert r.hit_A.tolist() == [False, True, False, False, False, True, False, False, False]
    assert r.slot_A.tolist() == [False, True, True, False, False, True, False, False, False]
    assert r.copy_key_C.tolist() == [4, 8, 4, 8, 4, 8]
    assert r.copy_start_us_C.tolist() == [0, 21, 41, 61, 82, 102]
    assert r.copy_ready_us_C.tolist() == [10, 31, 51, 71, 92, 112]
    assert r.copy_prefetch_C.all()
    assert r.copy_used_C.tolist() == [True, True, False, True, False, False]
    np.testing.assert_array_equal(r.copy_use_us_C, [20, 21, np.nan, 81, np.nan, np.nan])
    assert r.copy_timely_C.tolist() == [True, False, False, True, False, False]
    np.testing.assert_array_equal(r.copy_lead_us_C, [20, 1, np.nan, 20, np.nan, np.nan])
    assert (r.prefetches, r.prefetches_used) == (6, 3)
    assert r.prefetch_V.tolist() == [1, 1, 0, 1, 1, 0, 1, 1, 0]
    assert r.wasted_copies == 0

    row = summarize(trace, r)
    assert row["prefetches"] == 6 == row["admissions"]
    assert row["prefetch_accuracy"] == pytest.approx(0.5)
    assert row["prefetch_wasted_bytes"] == 3 * 1024
    assert row["prefetch_timely"] == pytest.approx(2 / 3)
    assert row["prefetch_lead_us_median"] == pytest.approx(20.0)
    assert [q["prefetches"] for q in per_request(trace, r)] == [4, 2]  # request a: s0, s1, s3, s4

    # the same placements in instant mode: an admission is resident from the next step, so every
    # used prefetch is a hit (s1, s2, s5); the unused ones are the same
    inst = replay_instant(trace, NextExpert0(), 1)
    assert np.array_equal(inst.hit_A, r.slot_A)
    assert (inst.prefetches, inst.prefetches_used) == (6, 3)
    row = summarize(trace, inst)
    assert row["prefetch_accuracy"] == pytest.approx(0.5) and row["prefetch_wasted_bytes"] == 3 * 1024
    assert row["prefetch_timely"] is None and row["prefetch_lead_us_median"] is None


def test_slower_copies_make_every_used_prefetch_late(make_trace):
    """A copy of 2 + 1024 / 8 = 130 us: c0 [0, 130] is still loading at s1 (tr=20); used but late.
    s1 evicts key 4 while its copy runs (a wasted copy, also the used prefetch c0). Placements and
    use do not depend on time: still 6 prefetches, 3 used (at s1, s2, s5), none timely."""
    trace = hand_trace(make_trace)
    r = replay_timed(trace, NextExpert0(), 1, hand_cost(bandwidth=8.0))
    assert (r.prefetches, r.prefetches_used) == (6, 3)
    assert not r.hit_A.any()
    assert r.copy_used_C.tolist() == [True, True, False, True, False, False]
    assert r.copy_use_us_C[0] == 20 and r.copy_ready_us_C[0] == 130
    row = summarize(trace, r)
    assert row["prefetch_timely"] == 0.0
    assert row["prefetch_accuracy"] == pytest.approx(0.5)
    assert row["wasted_copies"] >= 1


def test_demand_admissions_are_not_prefetches(make_trace):
    """Demand and prefetch, every key fits (12 slots): misses are admitted (keys 1, 0, 5, 2, 6, 9;
    key 4 and key 8 come as prefetches first, at s0 and s1), prefetches are admitted once each.
    Instant: key 4 hits at s1, key 8 at s2 and s5: both prefetches used, accuracy 1, nothing wasted."""
    trace = hand_trace(make_trace)
    r = replay_instant(trace, NextExpert0(demand=True), 12)
    assert r.admits_V.tolist() == [2, 1, 0, 1, 1, 0, 1, 1, 1]
    assert r.prefetch_V.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert (r.prefetches, r.prefetches_used) == (2, 2)
    row = summarize(trace, r)
    assert row["admissions"] == 8 and row["prefetches"] == 2
    assert row["prefetch_accuracy"] == 1.0 and row["prefetch_wasted_bytes"] == 0

    t = replay_timed(trace, NextExpert0(demand=True), 12, hand_cost())
    assert t.copy_key_C.tolist() == [1, 4, 8, 0, 5, 2, 6, 9]
    assert t.copy_prefetch_C.tolist() == [False, True, True, False, False, False, False, False]
    assert not t.copy_used_C[~t.copy_prefetch_C].any()
    assert math.isnan(t.copy_use_us_C[0])
    # c1 key 4: s0 tr=0, copies c0 [0, 10], c1 [10, 20]; s1 routes at 20 (s0 takes 20): timely, lead 20.
    # c2 key 8 is enqueued at s1 (tr=20, [20, 30]); s1 takes 1 (a hit): s2 routes at 21, late, lead 1.
    row = summarize(trace, t)
    assert (row["prefetches"], row["prefetch_accuracy"]) == (2, 1.0)
    assert row["prefetch_timely"] == 0.5
    assert row["prefetch_lead_us_median"] == pytest.approx((20 + 1) / 2)


def random_trace(make_trace, seed, requests=3, tokens=10, layers=3, experts=6, prefill=3):
    rng = np.random.default_rng(seed)
    steps = []
    for r in range(requests):
        for step, n in enumerate([prefill] + [1] * (tokens - prefill)):
            for layer in range(layers):
                steps.append(
                    (r, step, layer, [list(rng.choice(experts, 2, replace=False)) for _ in range(n)])
                )
    return make_trace(steps, layers, experts, 2)


def reference_prefetches(trace, policy, capacity) -> list[tuple[int, int | None]]:
    """Plain-Python oracle of the drivers' accounting: (enqueuing step, step of the first use or None)
    of every prefetch, the compiled policy step called from Python one layer step at a time (its
    same-step cancellations undone here: a listed victim that held no slot was admitted by the step)."""
    state = policy.init_state(trace, capacity)
    resident = np.zeros(trace.num_keys, np.bool_)
    admit, evict = np.empty(trace.num_keys, np.int32), np.empty(trace.num_keys, np.int32)
    pending: dict[int, int] = {}  # key -> its pending prefetch
    events: list[list] = []
    for s in range(trace.num_steps):
        a0, a1 = trace.start_V[s], trace.start_V[s + 1]
        keys = trace.key_A[a0:a1]
        for k in keys.tolist():
            if k in pending:
                events[pending.pop(k)][1] = s
        n_admit, n_evict = type(policy).step(
            state, keys, trace.uses_A[a0:a1], resident[keys], int(a0), trace.clock_V[s],
            trace.request_V[s], resident, admit, evict,
        )  # fmt: skip
        admitted = admit[:n_admit].tolist()
        for k in evict[:n_evict].tolist():
            if not resident[k]:
                admitted.remove(k)  # admitted and evicted by this step: the two cancel out
                continue
            resident[k] = False
            pending.pop(k, None)
        for k in admitted:
            resident[k] = True
            if k not in set(keys.tolist()):
                pending[k] = len(events)
                events.append([s, None])
    return [tuple(e) for e in events]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [1, 2, 5, 18])
def test_prefetch_accounting_equals_the_reference(make_trace, seed, capacity):
    trace = random_trace(make_trace, seed)
    for demand in (False, True):
        events = reference_prefetches(trace, NextExpert0(demand=demand), capacity)
        assert events, "the trace should make the policy prefetch"
        used = [u is not None for _, u in events]
        inst = replay_instant(trace, NextExpert0(demand=demand), capacity)
        assert (inst.prefetches, inst.prefetches_used) == (len(events), sum(used))
        t = replay_timed(trace, NextExpert0(demand=demand), capacity, hand_cost())
        assert t.copy_step_C[t.copy_prefetch_C].tolist() == [s for s, _ in events]
        assert t.copy_used_C[t.copy_prefetch_C].tolist() == used
        use_us = [t.route_us_V[u] if u is not None else np.nan for _, u in events]
        np.testing.assert_array_equal(t.copy_use_us_C[t.copy_prefetch_C], use_us)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [0, 1, 2, 5, 18])
def test_prefetch_counts_do_not_depend_on_bandwidth(make_trace, seed, capacity):
    """Placements, and so which prefetches are used, are the same at any bandwidth; at infinite
    bandwidth every used prefetch is timely."""
    trace = random_trace(make_trace, seed)
    for demand in (False, True):
        inst = replay_instant(trace, NextExpert0(demand=demand), capacity)
        assert 0 <= inst.prefetches_used <= inst.prefetches == inst.prefetch_V.sum()
        assert inst.prefetches <= inst.admits_V.sum()
        for cost in (hand_cost().infinite_bandwidth(), hand_cost(), hand_cost(bandwidth=1.0)):
            t = replay_timed(trace, NextExpert0(demand=demand), capacity, cost)
            assert (t.prefetches, t.prefetches_used) == (inst.prefetches, inst.prefetches_used)
            assert t.copy_prefetch_C.sum() == t.prefetches and t.copy_used_C.sum() == t.prefetches_used
            assert not (t.copy_used_C & ~t.copy_prefetch_C).any()
            assert np.array_equal(np.isnan(t.copy_use_us_C), ~t.copy_used_C)
            assert (t.copy_lead_us_C[t.copy_used_C] >= 0).all()
            row = summarize(trace, t)
            if cost.copy_us() == 0 and t.prefetches_used:
                assert row["prefetch_timely"] == 1.0
        if capacity == 0:
            assert inst.prefetches == 0


# a few demand policies (each compiles both drivers once per process, ~2 s): recency, counting, the
# offline bound and a static placement with free initial residents (not admissions, not prefetches)
DEMAND_POLICIES = ["lru", "lfu", "belady", "static_hindsight"]


@pytest.mark.parametrize("name", DEMAND_POLICIES)
def test_demand_policies_never_prefetch(make_trace, name):
    trace = random_trace(make_trace, 3)
    for capacity in (1, 4, 9):
        inst = replay_instant(trace, make_policy(name).bind_cost(hand_cost()), capacity)
        timed = replay_timed(trace, make_policy(name), capacity, hand_cost())
        for r in (inst, timed):
            assert (r.prefetches, r.prefetches_used) == (0, 0), name
            assert not r.prefetch_V.any()
            row = summarize(trace, r)
            assert (row["prefetches"], row["prefetch_wasted_bytes"]) == (0, 0)
            assert row["prefetch_accuracy"] is None
            assert row["prefetch_timely"] is None and row["prefetch_lead_us_median"] is None
        assert not timed.copy_prefetch_C.any() and not timed.copy_used_C.any()
        assert np.isnan(timed.copy_use_us_C).all()


def test_more_copies_than_accesses_retry_with_longer_copy_arrays(make_trace):
    """Demand and prefetch, 2 slots, 2 layers x 4 experts, top-1 decode, 100 tokens: every step misses
    (layer 0: keys 1, 2, 3 in turn; layer 1: keys 5, 6, 7) and admits its key, and most layer-0 steps
    also prefetch key 4: about 5 copies per 4 accesses, more than the first copy arrays (accesses + 16)
    hold, so the driver runs again with longer ones."""
    steps = [(0, i, layer, [[1 + (i + layer) % 3]]) for i in range(100) for layer in range(2)]
    trace = make_trace(steps, 2, 4)
    events = reference_prefetches(trace, NextExpert0(demand=True), 2)
    r = replay_timed(trace, NextExpert0(demand=True), 2, hand_cost())
    assert r.copies_total > trace.num_accesses + 16
    assert r.prefetches == len(events) > 0
    assert r.copy_used_C[r.copy_prefetch_C].tolist() == [u is not None for _, u in events]
    inst = replay_instant(trace, NextExpert0(demand=True), 2)
    assert (inst.prefetches, inst.prefetches_used) == (r.prefetches, r.prefetches_used)
    assert np.array_equal(inst.prefetch_V, r.prefetch_V)
