"""The real manager, driven over a real routing trace with every copy complete before the next visit,
makes exactly the hits, admissions and evictions of the simulator's instant replay.

Trace: DeepSeek-V2-Lite routing from ../shared/data/traces (ESFT intent), the first requests only,
one decode step per token (as `moecache import-trace` converts it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.trace_arrays import from_table
from moecache.trace.esft_import import esft_to_table, load_esft_npz
from moecache.trace.schema import TraceMeta
from tests.runtime.helpers import manager, random_store

ESFT = (Path(__file__).resolve().parents[2] / "../shared/data/traces/deepseek-v2-lite-esft").resolve()
NPZ = ESFT / "esft_intent_routing.npz"
L, E, K = 26, 64, 6
REQUESTS = 6


@pytest.fixture(scope="module")
def esft():
    if not NPZ.is_file():
        pytest.skip(f"{NPZ} is not here")
    arrays = load_esft_npz(NPZ, num_layers=L, num_experts=E, top_k=K)
    end = int(arrays.seq_offsets[REQUESTS])
    sub = type(arrays)(arrays.expert_ids[:end], arrays.gate_weights[:end], arrays.seq_offsets[: REQUESTS + 1])
    meta = TraceMeta(L, E, K, 17301504, model="deepseek-v2-lite", source="esft")
    table = esft_to_table(sub, name="esft_intent", run_id="esft_intent", tokens_per_step=1, meta=meta)
    return sub, from_table(table, meta, name="esft_intent")


@pytest.fixture(scope="module")
def store():
    return random_store(L, E, H=4, inter=2)


CASES = [
    ("lru", {}, 300),
    ("lfu", {}, 300),
    ("lfu", {"reset_per_request": True}, 200),
    ("static_cold", {}, 500),
    ("transition_prefetch", {}, 300),
]


@pytest.mark.parametrize(("policy", "params", "capacity"), CASES)
def test_manager_matches_instant_replay(esft, store, policy, params, capacity):
    arrays, trace = esft
    expected = replay_instant(trace, make_policy(policy, **params), capacity)
    m = manager(policy, capacity, store=store, top_k=K, params=params)
    hits = admissions = evictions = 0
    offsets = arrays.seq_offsets
    for r in range(arrays.num_sequences):
        m.begin_request()
        for t in range(int(offsets[r]), int(offsets[r + 1])):
            for layer in range(L):
                result = m.visit(layer, arrays.expert_ids[t, layer][None, :])
                hits += K - len(result.miss_experts)
                admissions += len(result.admitted)
                evictions += len(result.evicted)
    assert trace.num_accesses == m.a0
    assert (hits, admissions, evictions) == (
        int(expected.hit_A.sum()),
        int(expected.admits_V.sum()),
        int(expected.evicts_V.sum()),
    )
    assert hits > 0 and (policy == "static_cold" or admissions > 0)
    # every resident slot holds its expert's weights, bit for bit
    m.device.run()
    for key in np.flatnonzero(m.slot_of_G >= 0).tolist():
        slot = int(m.slot_of_G[key])
        assert np.array_equal(m.pool.w13_SIH[slot].numpy(), store.w13_GIH[key].numpy())


def test_a_policy_that_weighs_costs_runs_the_replays_visits(esft, store):
    """impact (it reads the cost model: CPU, GPU and copy time) in the manager with the replay's own cost
    model: the same hits, admissions and evictions; without one the manager refuses it in one line."""
    from moecache.cost_profile import CostProfile
    from moecache.errors import MoecacheError
    from moecache.sim.cost_model import CostModel

    arrays, trace = esft
    bundled = (
        Path(__file__).resolve().parents[2]
        / "moecache/data/cost_profiles/h200_qwen3_6_35b_a3b_2026-11-30.json"
    )
    cost = CostModel.for_trace(CostProfile.load(bundled), trace)
    expected = replay_instant(trace, make_policy("impact").bind_cost(cost), 300)
    with pytest.raises(MoecacheError, match="policy impact weighs measured costs"):
        manager("impact", 300, store=store, top_k=K)
    m = manager("impact", 300, store=store, top_k=K, cost=cost)
    hits = admissions = evictions = 0
    for r in range(arrays.num_sequences):
        m.begin_request()
        for t in range(int(arrays.seq_offsets[r]), int(arrays.seq_offsets[r + 1])):
            for layer in range(L):
                result = m.visit(layer, arrays.expert_ids[t, layer][None, :])
                hits += K - len(result.miss_experts)
                admissions += len(result.admitted)
                evictions += len(result.evicted)
    assert (hits, admissions, evictions) == (
        int(expected.hit_A.sum()), int(expected.admits_V.sum()), int(expected.evicts_V.sum())
    )  # fmt: skip
    assert hits > 0 and admissions > 0


def test_lfu_from_initial_counts_of_an_earlier_trace(esft, store, tmp_path):
    """The online static-like baseline: lfu whose counters start from another trace's counts."""
    import pyarrow.parquet as pq

    arrays, trace = esft
    law = load_esft_npz(ESFT / "esft_law_routing.npz", num_layers=L, num_experts=E, top_k=K)
    end = int(law.seq_offsets[3])
    law = type(law)(law.expert_ids[:end], law.gate_weights[:end], law.seq_offsets[:4])
    meta = TraceMeta(L, E, K, 17301504, model="deepseek-v2-lite", source="esft")
    prior = tmp_path / "trace.parquet"
    pq.write_table(esft_to_table(law, name="law", run_id="law", tokens_per_step=1, meta=meta), prior)
    params = {"init_counts": str(prior)}
    expected = replay_instant(trace, make_policy("lfu", **params), 300)
    m = manager("lfu", 300, store=store, top_k=K, params=params)
    for r in range(arrays.num_sequences):
        m.begin_request()
        for t in range(int(arrays.seq_offsets[r]), int(arrays.seq_offsets[r + 1])):
            for layer in range(L):
                m.visit(layer, arrays.expert_ids[t, layer][None, :])
    assert (m.stats.hits, m.stats.admissions, m.stats.evictions) == (
        int(expected.hit_A.sum()),
        int(expected.admits_V.sum()),
        int(expected.evicts_V.sum()),
    )
