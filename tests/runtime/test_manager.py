"""The cache manager's state machine on the CPU stand-in device (the plan's "Correctness and
concurrency" list): capacities, deterministic placement, copies at admission, publication, non-blocking
fallback, safe slot reuse, session state, bad input.

Legend: T tokens, K top-k, E experts, L layers, S slots.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moecache.errors import MoecacheError
from moecache.runtime.device import StandinDevice
from moecache.runtime.experts_module import route_misses
from moecache.runtime.manager import CacheManager
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from tests.conftest import build_trace
from tests.runtime.helpers import manager, random_store, split_cost


def ids(*experts):
    return np.array([list(experts)], np.int64)


# ---- capacities --------------------------------------------------------------------------------


def test_capacity_zero_runs_everything_on_the_cpu():
    m = manager("lru", 0)
    assert m.pool.w13_SIH.shape[0] == 0
    for _ in range(3):
        r = m.visit(0, ids(1, 2))
        assert not r.hit_TK.any() and r.miss_experts.tolist() == [1, 2]
        assert len(r.admitted) == 0 and len(r.copies) == 0
    assert m.engine.copies_enqueued == 0


def test_capacity_partial_hits_after_the_copy():
    m = manager("lru", 2)
    first = m.visit(0, ids(1, 2))
    assert first.admitted.tolist() == [1, 2] and not first.hit_TK.any()
    second = m.visit(0, ids(1, 2))
    assert second.hit_TK.all() and second.miss_experts.tolist() == []
    third = m.visit(0, ids(3, 1))  # 3 evicts the least recent (2)
    assert third.hit_TK.tolist() == [[False, True]] and third.evicted.tolist() == [2]


@pytest.mark.parametrize("capacity", [16, "100%"])
def test_capacity_every_expert_never_evicts(capacity):
    m = manager("lru", capacity)  # 2 layers x 8 experts
    assert m.capacity == 16
    rng = np.random.default_rng(0)
    for _ in range(40):
        for layer in range(2):
            r = m.visit(layer, rng.choice(8, size=(1, 2), replace=False))
            assert len(r.evicted) == 0
    assert m.stats.evictions == 0 and m.stats.admissions == 16


# ---- deterministic placement -------------------------------------------------------------------


def test_ties_break_by_key_and_runs_repeat_exactly():
    runs = []
    for _ in range(2):
        m = manager("lfu", 1)
        r = m.visit(0, ids(3, 1))  # equal counts: the smaller key wins
        assert r.admitted.tolist() == [1]
        r = m.visit(0, ids(5, 6))  # a tie never replaces
        assert r.admitted.tolist() == [] and r.evicted.tolist() == []
        rng = np.random.default_rng(7)
        trail = []
        for _ in range(50):
            for layer in range(2):
                res = m.visit(layer, rng.choice(8, size=(1, 2), replace=False))
                trail.append((res.admitted.tolist(), res.evicted.tolist(), res.hit_TK.tolist()))
        runs.append(trail)
    assert runs[0] == runs[1]


def test_repeated_hits_make_no_further_copies():
    m = manager("lfu", 4)
    m.visit(0, ids(1, 2))
    copies = m.engine.copies_enqueued
    assert copies == 2
    for _ in range(20):
        r = m.visit(0, ids(2, 1))
        assert r.hit_TK.all() and len(r.copies) == 0
    assert m.engine.copies_enqueued == copies


def test_eviction_leaves_cpu_weights_bit_identical():
    store = random_store(L=2, E=8)
    before = store.flat_GB.clone()
    pointer = store.flat_GB.data_ptr()
    m = manager("lru", 2, store=store)
    rng = np.random.default_rng(1)
    for _ in range(200):
        for layer in range(2):
            m.visit(layer, rng.choice(8, size=(1, 2), replace=False))
    m.device.run()
    assert m.stats.evictions > 100
    assert store.flat_GB.data_ptr() == pointer and torch.equal(store.flat_GB, before)


# ---- copies, publication and fallback ----------------------------------------------------------


def test_copy_is_enqueued_at_admission_not_at_the_end_of_the_token():
    m = manager("lru", 2, mode="manual")
    r = m.visit(0, ids(1, 2))
    assert [c.key for c in r.copies] == [1, 2]
    assert all(c.enqueued_ns is not None and not c.ready_event.query() for c in r.copies)
    assert len(m.engine.stream.ops) > 0  # on the copy stream already, before the layer's kernels ran
    m.device.run(m.engine.stream)  # the copy stream alone completes them: no wait on the token
    assert all(c.ready_event.query() for c in r.copies)


def test_cpu_fallback_while_the_copy_is_in_flight_without_blocking():
    m = manager("lru", 2, mode="manual")
    m.visit(0, ids(1, 2))
    for _ in range(3):  # next tokens: the copy missed the deadline, the CPU runs the experts again
        r = m.visit(0, ids(1, 2))
        assert not r.hit_TK.any() and r.miss_experts.tolist() == [1, 2]
        assert len(r.admitted) == 0  # the policy counts them as holding slots: no second copy
    assert len(m.engine.stream.ops) > 0  # the manager never waited for (ran) the copies
    assert m.loading_L[0].keys() == {1, 2}


def test_publication_before_the_next_token_once_the_event_completed():
    m = manager("lru", 2, mode="manual")
    m.visit(0, ids(1, 2))
    m.device.run(m.engine.stream, max_ops=2)  # the first copy only (untimed, wait-free: the row, ready)
    r = m.visit(0, ids(1, 2))
    assert r.hit_TK.tolist() == [[True, False]]
    m.device.run()
    assert m.slot_of_LE[0].tolist() == r.snapshot_E.tolist()
    r = m.visit(0, ids(1, 2))
    assert r.hit_TK.all()
    m.device.run()
    assert m.slot_of_LE[0].tolist() == r.snapshot_E.tolist()
    assert r.snapshot_E[1] >= 0 and r.snapshot_E[2] >= 0


def test_prepare_publishes_and_the_visit_keeps_that_snapshot():
    m = manager("lru", 2, mode="manual")
    m.visit(0, ids(1, 2))
    row = m.prepare(0)  # nothing complete yet: the row the layer's kernels read has neither
    assert row.data_ptr() == m.slot_of_LE[0].data_ptr()
    m.device.run()  # the copies complete between prepare and visit: not published by this visit
    r = m.visit(0, ids(1, 2))
    assert not r.hit_TK.any() and r.miss_experts.tolist() == [1, 2]
    assert m.slot_of_LE[0].tolist() == r.snapshot_E.tolist()
    r = m.visit(0, ids(1, 2))  # the next visit (not prepared) publishes them
    assert r.hit_TK.all()


def test_executor_row_uploads_leave_the_row_in_staging_and_manager_uploads_resume():
    """row_uploads="executor": prepare writes the layer's staging row and enqueues no copy (the executor
    copies it); back to "manager", the row is uploaded again at the layer's next visit."""
    m = manager("lru", 2, mode="manual")
    m.visit(0, ids(1, 2))
    m.device.run()  # both copies complete
    m.row_uploads = "executor"
    m.prepare(0)  # publishes them into the staging row only
    assert m.device.pending() == 0
    want = m.published_LE[0].tolist()
    assert m.staging_row(0).tolist() == want and want[1] >= 0 and want[2] >= 0
    assert m.slot_of_LE[0].tolist() != want  # the device row waits for the executor's copy
    m.visit(0, ids(1, 2))
    m.slot_of_LE[0].copy_(m.staging_row(0))  # what segment B(0) does
    m.row_uploads = "manager"
    m.visit(0, ids(1, 2))
    m.device.run()
    assert m.slot_of_LE[0].tolist() == m.published_LE[0].tolist()
    with pytest.raises(
        MoecacheError, match=r"row_uploads='graph': expected one of \['manager', 'executor'\]"
    ):
        m.row_uploads = "graph"


def test_prepare_is_refused_for_waits_and_for_another_layers_visit():
    m = manager("lru", 2)
    m.prepare(0)
    with pytest.raises(MoecacheError, match=r"visit of layer 1 after prepare\(0\)"):
        m.visit(1, ids(1, 2))
    m.on_miss = "wait"
    with pytest.raises(MoecacheError, match="prepare"):
        m.prepare(1)


# ---- on_miss="split" ----------------------------------------------------------------------------


def split_manager(copy_us: float, cpu_us: float, capacity=4, mode="manual", wait_host_us=None):
    store = random_store()
    cost = split_cost(store, copy_us, cpu_us, wait_host_us=wait_host_us)
    return manager("lru", capacity, store=store, mode=mode, on_miss="split", cost=cost)


def test_split_waits_on_the_device_for_copies_that_land_before_the_cpu_would_finish():
    m = split_manager(copy_us=1.0, cpu_us=1e6)  # copies far cheaper than the CPU: wait for both
    r = m.visit(0, ids(1, 2))
    assert [c.key for c in r.waited] == [1, 2] and r.hit_TK.all() and r.miss_experts.tolist() == []
    assert not r.cache_hit_TK.any() and (r.cache_snapshot_E == -1).all()  # the cache's view: two misses
    assert m.stats.misses == 2 and m.stats.hits == 0 and m.stats.waited_copies == 2
    assert (m.stats.split_decisions, m.stats.split_waits) == (1, 1)  # its host time counted, per visit
    assert m.stats.split_decide_ns > 0 and m.stats.split_wait_ns > 0
    # the compute stream waits for the copies before the wait row's upload: nothing moves until they land
    assert m.enqueue_waits(r) is r.wait_slot_of_E
    m.device.run(m.compute)
    assert (m.wait_slot_of_LE[0] == -1).all()
    m.device.run()
    row = m.wait_slot_of_LE[0].tolist()
    assert row[1] == r.waited[0].slot and row[2] == r.waited[1].slot
    assert sum(s >= 0 for s in row) == 2
    assert m.pool.flat_SB[r.waited[0].slot].equal(m.store.flat_GB[1])  # the weights the wait call reads
    m.commit()
    nxt = m.visit(0, ids(1, 2))  # published as usual at the next visit: hits, no wait
    assert nxt.hit_TK.all() and nxt.waited == [] and nxt.cache_hit_TK is None


def test_split_leaves_misses_to_the_cpu_when_copies_are_slow():
    m = split_manager(copy_us=1e6, cpu_us=1.0)
    r = m.visit(0, ids(1, 2))
    assert r.waited == [] and not r.hit_TK.any() and r.miss_experts.tolist() == [1, 2]
    assert len(r.copies) == 2 and m.stats.waited_copies == 0  # admitted and copied all the same
    assert (m.stats.split_decisions, m.stats.split_waits, m.stats.split_wait_ns) == (1, 0, 0)


def test_split_weighs_a_waiting_visits_host_time():
    # a copy far cheaper than the CPU, but the visit's own wait costs more than the CPU part it saves
    m = split_manager(copy_us=1.0, cpu_us=100.0, wait_host_us=1e4)
    assert m.visit(0, ids(1, 2)).waited == [] and m.stats.waited_copies == 0
    m = split_manager(copy_us=1.0, cpu_us=100.0, wait_host_us=10.0)  # cheaper than the CPU: wait
    assert len(m.visit(0, ids(1, 2)).waited) == 2


def test_the_split_decision_is_compiled_once():
    """The manager's arguments have the types SplitCosts compiled `_decide` for at construction: no
    second compilation inside a run (~200 ms on the H200 host, in the step that pays it)."""
    from moecache.runtime.miss_split import _decide

    m = split_manager(copy_us=1.0, cpu_us=100.0)
    for _ in range(3):
        m.visit(0, ids(1, 2))
        m.commit()
    assert m.stats.split_decisions > 0 and len(_decide.signatures) == 1


def test_split_places_and_counts_exactly_as_cpu():
    """Where a miss runs changes nothing of the cache: admissions, evictions, hits, misses equal
    on_miss="cpu"'s over random routing at a small capacity."""
    rng = np.random.default_rng(3)
    routing = [(layer, rng.choice(8, size=(1, 2), replace=False)) for _ in range(30) for layer in range(2)]
    trails = {}
    for mode in ("cpu", "split"):
        store = random_store()
        m = manager("lru", 3, store=store, cost=split_cost(store, 1.0, 1e6))
        m.on_miss = mode
        trails[mode] = [
            (r.admitted.tolist(), r.evicted.tolist(), (r.cache_hit_TK if r.waited else r.hit_TK).tolist())
            for r in (m.visit(layer, x) for layer, x in routing)
        ]
        if mode == "split":
            assert m.stats.waited_copies > 0
    assert trails["split"] == trails["cpu"]


def test_split_needs_a_cost_model():
    with pytest.raises(MoecacheError, match='on_miss="split".*cost'):
        manager("lru", 4, on_miss="split")


def test_completed_copies_are_found_in_stream_order_with_few_queries():
    m = manager("lru", 6, mode="manual", top_k=3)
    copies = m.visit(0, ids(1, 2, 3)).copies
    queries = []
    for c in copies:
        query = c.ready_event.query
        c.ready_event.query = lambda query=query, key=c.key: queries.append(key) or query()
    m.device.run(m.engine.stream, max_ops=2)  # the first copy only (untimed: the row, ready)
    assert [c.key for c in m.engine.observe_in_order(copies)] == [1]
    assert queries == [3, 1, 2]  # the last first (incomplete), then in order to the first incomplete one
    m.device.run()
    queries.clear()
    copies[2].observe()  # the last one seen complete: every copy before it is too
    m.engine.completed_seq = copies[2].seq
    assert [c.key for c in m.engine.observe_in_order(copies[1:])] == [2, 3]
    assert queries == [3]  # copy 2 below the watermark: no query (3 was queried by observe above)
    fresh = m.visit(1, ids(4, 5, 6)).copies
    queries.clear()
    for c in fresh:
        query = c.ready_event.query
        c.ready_event.query = lambda query=query, key=c.key: queries.append(key) or query()
    m.device.run()
    assert [c.key for c in m.engine.observe_in_order(fresh)] == [12, 13, 14]
    assert queries == [14]  # the last one complete: one query for all


def test_copies_are_timed_only_while_the_logger_records():
    m = manager("lru", 4)
    r = m.visit(0, ids(1, 2))
    assert all(c.start_event is None for c in r.copies)  # the hot path: one event per copy
    m.device.run()
    r = m.visit(0, ids(1, 2))
    assert r.cache_fields(8)[0]["copy_duration_ns"] is None
    m.time_gpu = True  # what the validate recorder sets
    r = m.visit(1, ids(3, 4))
    m.device.run()
    assert all(c.observe() and c.start_event is not None and c.duration_ns >= 0 for c in r.copies)
    assert m.engine.timing
    m.time_gpu = False
    assert not m.engine.timing and not manager("lru", 4).engine.timing


def test_slot_of_E_keeps_its_address():
    m = manager("lru", 2)
    pointer = m.slot_of_LE.data_ptr()
    rows = {m.visit(layer, ids(layer, layer + 1)).slot_of_E.data_ptr() for layer in (0, 1) for _ in range(3)}
    assert m.slot_of_LE.data_ptr() == pointer and rows == {pointer, pointer + 8 * 4}


# ---- safe slot reuse (stress) ------------------------------------------------------------------


def stress(
    policy: str,
    capacity: int,
    *,
    seed: int,
    wait_on_last_use: bool = True,
    tokens: int = 300,
    fence: str | None = None,
):
    """Random routing, tiny capacity, streams run in random interleavings. After each visit a stand-in
    kernel is queued on the compute stream: at execution it reads each hit expert's slot through the
    device mapping row and compares the slot's weights with the store's. Returns (mismatches, stats).
    `fence="true"`: before each visit the compute stream runs to the end and the visit is told so
    (`compute_done=True`, as after a blocking routing read-back); `fence="false"`: told so without it."""
    L, E, K = 2, 5, 2
    store = random_store(L=L, E=E, H=4, inter=2, seed=seed)
    m = manager(policy, capacity, store=store, mode="manual", top_k=K)
    if not wait_on_last_use:  # the bug the test must catch: copies ignore the slots' last-use events
        enqueue = m.engine.enqueue
        m.engine.enqueue = lambda key, slot, after=None: enqueue(key, slot, None)
    rng = np.random.default_rng(seed)
    bad = []
    streams = [m.compute, m.engine.stream]

    def kernel(layer, ids_TK, hit_TK):
        def run():
            row = m.slot_of_LE[layer]
            for e in ids_TK[hit_TK].tolist():
                slot = int(row[e])
                key = layer * E + e
                if slot < 0 or not torch.equal(m.pool.w13_SIH[slot], store.w13_GIH[key]):
                    bad.append((layer, e, slot))
                elif not torch.equal(m.pool.w2_SHI[slot], store.w2_GHI[key]):
                    bad.append((layer, e, slot))

        return run

    for _ in range(tokens):
        for layer in range(L):
            ids_TK = rng.choice(E, size=(1, K), replace=False)
            if fence == "true":
                m.device.run(m.compute)
            r = m.visit(layer, ids_TK, compute_done=fence is not None)
            m.device.enqueue(m.compute, kernel(layer, ids_TK, r.hit_TK))
            m.commit()
            for _ in range(int(rng.integers(0, 4))):
                m.device.run(streams[int(rng.integers(0, 2))], max_ops=int(rng.integers(1, 12)))
    m.device.run()
    return bad, m.stats


@pytest.mark.parametrize("policy", ["lru", "lfu", "transition_prefetch"])
def test_a_slot_is_not_overwritten_while_queued_work_reads_it(policy):
    for seed in range(3):
        bad, stats = stress(policy, 6, seed=seed)
        assert bad == [], f"seed {seed}: kernels read overwritten slots {bad[:5]}"
        assert stats.hits > 50 and stats.copies > 20


def test_the_stress_test_catches_a_copy_that_ignores_last_use():
    found = sum(len(stress("lru", 6, seed=seed, wait_on_last_use=False)[0]) for seed in range(3))
    assert found > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_past_the_fence_slots_and_rows_are_reused_without_events(policy):
    for seed in range(3):
        bad, stats = stress(policy, 6, seed=seed, fence="true")
        assert bad == [] and stats.copies > 20
    m = manager(policy, 6, mode="manual")  # and no event at all: only a deferred copy records one
    for t in range(40):
        m.device.run(m.compute)
        m.visit(t % 2, np.array([[t % 7, (t + 3) % 8]]), compute_done=True)
        m.commit()
    assert m._covering.generation <= m.stats.deferred_copies and m.stats.publish_waits == 0


def test_the_stress_test_catches_a_fence_claimed_too_early():
    found = sum(len(stress("lru", 6, seed=seed, fence="false")[0]) for seed in range(3))
    assert found > 0


def test_a_copy_into_a_slot_this_visit_reads_waits_for_its_kernels():
    # capacity 2 < top-k 3: LRU evicts an expert this very visit runs on the GPU
    m = manager("lru", 2, mode="manual", top_k=3)
    m.visit(0, ids(1, 2, 3))  # admits 2, 3 (the last two)
    m.device.run()
    r = m.visit(0, ids(2, 3, 4))  # 2, 3 hit; 4 admitted, evicting 2 (read by this visit)
    assert r.hit_TK.tolist() == [[True, True, False]] and r.evicted.tolist() == [2]
    assert r.copies == [] and m.stats.deferred_copies == 1  # not enqueued before the kernels
    m.commit()
    assert [c.key for c in r.copies] == [4]


# ---- session state -----------------------------------------------------------------------------


def routing(seed: int, n: int, L: int = 2, E: int = 8, K: int = 2):
    rng = np.random.default_rng(seed)
    return [(layer, rng.choice(E, size=(1, K), replace=False)) for _ in range(n) for layer in range(L)]


def trail(m, visits):
    return [
        (r.admitted.tolist(), r.evicted.tolist(), r.hit_TK.tolist())
        for r in (m.visit(layer, i) for layer, i in visits)
    ]


@pytest.mark.parametrize("policy", ["lfu", "lru", "transition_prefetch"])
def test_export_import_continues_identically(policy):
    first, rest = routing(1, 30), routing(2, 30)
    a = manager(policy, 3)
    trail(a, first)
    exported = a.export_state()
    json.dumps({k: v for k, v in exported.items() if k not in ("state", "resident_keys")})
    b = manager(policy, 3)
    b.import_state(exported)
    assert trail(a, rest) == trail(b, rest)


@pytest.mark.parametrize("policy", ["lfu", "lru", "transition_prefetch"])
def test_the_compiled_entry_point_equals_the_dispatcher(policy):
    """After its first call the compiled visit skips numba's dispatcher (manager_visit.CompiledVisit);
    the same visits through the dispatcher every time give the same placements, and routing in any
    layout or integer type takes the same path."""
    visits = routing(6, 40)
    direct = manager(policy, 3)
    dispatched = manager(policy, 3)
    core = dispatched._core
    calls = []

    class Dispatched:
        def retype(self):
            pass

        def __call__(self, *args):
            calls.append(1)
            return core._dispatcher(*args)

    dispatched._core = Dispatched()
    strided = [(layer, np.asfortranarray(np.repeat(i, 2, axis=0))[:1]) for layer, i in visits]
    assert not strided[0][1].flags.c_contiguous
    narrow = [(layer, i.astype(np.int32)) for layer, i in visits]
    assert trail(direct, visits) == trail(dispatched, visits)
    assert direct._core._entry is not None and len(calls) == len(visits)
    direct.reset()
    assert direct._core._entry is None  # new state arrays: typed again at the next visit
    assert trail(direct, strided) == trail(manager(policy, 3), narrow) == trail(manager(policy, 3), visits)


def test_reset_equals_a_fresh_manager():
    visits = routing(3, 40)
    a = manager("lfu", 3)
    trail(a, routing(4, 25))
    a.reset()
    assert a.stats.visits == 50
    assert trail(a, visits) == trail(manager("lfu", 3), visits)


def test_warm_from_trace_equals_having_visited_it():
    visits = routing(5, 30)  # 30 tokens x 2 layers, one decode step per token
    steps = [(0, n // 2, layer, [i[0].tolist()]) for n, (layer, i) in enumerate(visits)]
    trace = build_trace(steps, num_layers=2, num_experts=8)
    warm = manager("lfu", 3)
    warm.warm_from_trace(trace)
    lived = manager("lfu", 3)
    trail(lived, visits)
    assert lived.stats.admissions == int(replay_instant(trace, make_policy("lfu"), 3).admits_V.sum())
    assert np.array_equal(warm.resident_G, lived.resident_G)
    for name in warm.state._fields:
        assert np.array_equal(getattr(warm.state, name), getattr(lived.state, name)), name
    after = routing(6, 20)
    assert [t[:2] for t in trail(warm, after)] == [t[:2] for t in trail(lived, after)]


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        (17, "more slots than experts"),
        (-1, "cannot be negative"),
        ("101%", "from 0% to 100%"),
        (2.0, "expected"),
    ],
)
def test_bad_capacity_is_one_line(capacity, message):
    with pytest.raises(MoecacheError, match=message) as info:
        manager("lru", capacity)
    assert "\n" not in str(info.value) and "gpu_expert_capacity" in str(info.value)


@pytest.mark.parametrize("policy", ["belady", "static_hindsight"])
def test_offline_policy_is_refused(policy):
    with pytest.raises(MoecacheError, match="offline") as info:
        manager(policy, 2)
    assert "\n" not in str(info.value)


def test_decision_json(tmp_path):
    store = random_store()
    path = tmp_path / "decision.json"
    path.write_text(json.dumps({"selected": {"policy": "lfu", "params": {"reset_per_request": True}}}))
    m = CacheManager.from_decision(path, store, StandinDevice(), 4, top_k=2)
    assert m.policy.name == "lfu" and m.policy.params["reset_per_request"] is True
    path.write_text(json.dumps({"selected": {"policy": "no_such_policy", "params": {}}}))
    with pytest.raises(MoecacheError, match="unknown policy 'no_such_policy'") as info:
        CacheManager.from_decision(path, store, StandinDevice(), 4, top_k=2)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    path.write_text(json.dumps({"baseline": {}}))
    with pytest.raises(MoecacheError, match="no `selected"):
        CacheManager.from_decision(path, store, StandinDevice(), 4, top_k=2)
    with pytest.raises(MoecacheError, match="cannot read"):
        CacheManager.from_decision(tmp_path / "missing.json", store, StandinDevice(), 4, top_k=2)


def test_unknown_policy_parameter_and_standin_mode():
    with pytest.raises(MoecacheError, match="unknown parameter"):
        manager("lru", 2, params={"window": 3})
    with pytest.raises(MoecacheError, match="stand-in device mode"):
        StandinDevice("sometimes")


# ---- the routing record's cache fields ---------------------------------------------------------


def test_cache_fields_fill_every_cache_column_of_the_record():
    from moecache.trace.schema import CACHE_COLUMNS

    m = manager("lru", 2, mode="manual")
    r = m.visit(0, np.array([[1, 2], [2, 3]]))
    rows = r.cache_fields(m.shape.num_experts)
    assert len(rows) == 2 and all(set(row) == set(CACHE_COLUMNS) for row in rows)
    first = rows[0]
    assert first["cache_hit"] == [False, False] and rows[1]["cache_hit"] == [False, False]
    assert first["admitted"] == r.admitted.tolist() and rows[1]["admitted"] == []
    assert first["copy_bytes"] == len(r.copies) * m.store.expert_bytes and first["copy_enqueued_ns"] > 0
    assert first["copy_ready_ns"] is None  # not seen complete yet
    m.device.run()
    r2 = m.visit(0, np.array([[2, 3]]))
    assert r.cache_fields(8)[0]["copy_ready_ns"] >= first["copy_enqueued_ns"]
    assert r2.cache_fields(8)[0]["resident_experts"] == sorted(int(k) for k in r.admitted)
    assert r2.cache_fields(8)[0]["cpu_duration_ns"] is None  # the executors fill these
    assert r2.cache_fields(8)[0]["cuda_duration_ns"] is None


def test_covers_says_whether_a_prepared_row_holds_every_entry():
    m = manager("lru", 4)
    m.visit(0, ids(1, 2))
    m.device.run()
    m.prepare(0)  # publishes 1 and 2
    assert m.prepared == 0
    assert m.covers(0, ids(1, 2)) and not m.covers(0, ids(1, 3))
    assert not m.covers(0, ids(1, 8)) and not m.covers(0, ids(-1, 2))  # outside 0..E-1: the visit refuses
    m.cancel_prepare()
    assert m.prepared is None


def test_prepared_hits_are_the_following_visits_hit_mask():
    m = manager("lru", 4)
    m.visit(0, ids(1, 2))
    m.device.run()
    m.prepare(0)  # publishes 1 and 2
    routing = ids(2, 3)
    want = m.prepared_hits(0, routing)
    assert m.prepared_hits(0, ids(1, 8)) is None and m.prepared_hits(0, ids(-1, 2)) is None
    # the fast loop's compiled host point computes the same mask (segments.py `_defer_visit`)
    got, n = np.zeros(routing.shape, np.bool_), routing.size
    scratch = (np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros_like(routing))
    assert route_misses(0, m.published_LE[0], routing, np.ones(routing.shape, np.float32), got, *scratch) == 1
    assert np.array_equal(got, want)
    assert np.array_equal(m.visit(0, routing).hit_TK, want) and want.tolist() == [[True, False]]


@pytest.mark.parametrize("bad", [8, -1])
def test_routing_outside_the_experts_is_refused_before_any_state_changes(bad):
    m = manager("lru", 3)
    m.visit(0, ids(1, 2))
    before = (m.stats.visits, m.resident_G.copy(), m.slot_of_G.copy(), m.published_LE.copy())
    with pytest.raises(MoecacheError, match=r"layer 1 routing: an expert id outside 0..7"):
        m.visit(1, ids(3, bad))
    after = (m.stats.visits, m.resident_G, m.slot_of_G, m.published_LE)
    assert before[0] == after[0] and all((b == a).all() for b, a in zip(before[1:], after[1:], strict=True))
    assert m.visit(1, ids(3, 4)).admitted.tolist() == [11, 12]  # the manager goes on as if it never came
