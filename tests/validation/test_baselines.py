"""The baselines' mechanisms: static_layers (llama.cpp --n-cpu-moe) holds exactly the last whole layers,
in the simulator and the runtime; the manager's on_miss="wait" (synchronous on-demand copies) runs an
admitted miss on the device in the same visit while the counters and the logged cache_hit stay the
cache's; late copies are counted once; the hindsight placement installs exactly the top keys.

Legend: L layers, E experts, T tokens, K top-k, G global keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moecache.errors import MoecacheError
from moecache.sim.policy import make_policy
from moecache.sim.policy_spec import PolicySpec
from moecache.sim.replay import replay_instant
from moecache.sim.shape import ModelShape
from moecache.validation.baselines import STRATEGIES, build, check_names, hindsight_keys, install_hindsight
from tests.conftest import build_trace
from tests.runtime.helpers import manager, random_store

L, E = 4, 8


@pytest.mark.parametrize(("capacity", "layers"), [(0, 0), (7, 0), (8, 1), (15, 1), (16, 2), (31, 3), (32, 4)])
def test_static_layers_holds_exactly_the_last_whole_layers(capacity, layers):
    policy = make_policy("static_layers")
    shape = ModelShape(L, E, 2, 64)
    state = policy.named_state(policy.init_state(shape, capacity))
    want = np.arange((L - layers) * E, L * E)
    assert np.array_equal(policy.initial_residents(state, shape, capacity), want)
    m = manager("static_layers", capacity, store=random_store(L=L, E=E))  # the runtime: the same set
    resident_LE = m.published_LE >= 0
    assert resident_LE[L - layers :].all() and not resident_LE[: L - layers].any()


def test_static_layers_replays_in_the_simulator_with_hits_only_in_its_layers():
    steps = [(0, s, layer, [[s % E, (s + 1) % E]]) for s in range(6) for layer in range(L)]
    trace = build_trace(steps, L, E)
    result = replay_instant(trace, make_policy("static_layers"), 2 * E)  # layers 2 and 3 resident
    hit_LS = result.hit_A.reshape(6, L, 2).transpose(1, 0, 2)  # every access of layers 2, 3 hits
    assert hit_LS[2:].all() and not hit_LS[:2].any()
    assert result.admits_V.sum() == 0 and result.evicts_V.sum() == 0


def test_on_miss_wait_runs_the_admitted_miss_on_the_device_in_the_same_visit():
    waits = manager("lru", 4, mode="manual")
    waits.on_miss = "wait"
    ids_TK = np.array([[1, 2]])
    r = waits.visit(0, ids_TK)
    waits.commit()
    assert r.cache_hit_TK.tolist() == [[False, False]]  # the cache had neither
    assert r.hit_TK.tolist() == [[True, True]] and r.miss_experts.size == 0  # both ran on the device
    assert waits.stats.misses == 2 and waits.stats.hits == 0 and waits.stats.waited_copies == 2
    assert [f["cache_hit"] for f in r.cache_fields(8)] == [[False, False]]
    assert r.cache_fields(8)[0]["resident_experts"] == []
    # the slot the device row points at holds the expert's weights once the compute stream runs
    waits.device.run()
    slots = r.snapshot_E[[1, 2]]
    assert torch.equal(waits.pool.flat_SB[slots[0]], waits.store.flat_GB[1])
    assert torch.equal(waits.slot_of_LE[0], torch.from_numpy(r.snapshot_E))  # the row this visit ran
    cpu = manager("lru", 4, mode="manual")  # the default: the same visit runs both on the CPU
    r = cpu.visit(0, ids_TK)
    assert r.hit_TK.tolist() == [[False, False]] and r.miss_experts.tolist() == [1, 2]
    assert cpu.stats.waited_copies == 0


def test_on_miss_refuses_an_unknown_mode():
    m = manager("lru", 2)
    with pytest.raises(MoecacheError, match="on_miss='gpu'"):
        m.on_miss = "gpu"


def test_a_copy_still_in_flight_at_its_next_use_is_late_once():
    m = manager("lru", 4, mode="manual")  # copies complete only when the test runs the device
    m.visit(0, np.array([[1, 2]]))
    m.commit()
    m.visit(0, np.array([[1, 3]]))  # 1 still loading: late; 3 a fresh miss
    m.commit()
    m.visit(0, np.array([[1, 2]]))  # 1 and 2 still loading: 2 late now, 1 counted already
    m.commit()
    assert m.stats.late_copies == 2
    m.device.run()
    r = m.visit(0, np.array([[1, 2]]))
    assert r.hit_TK.all() and m.stats.late_copies == 2


def test_hindsight_placement_holds_exactly_the_most_used_keys():
    count_G = np.zeros(2 * 8, np.int64)
    count_G[[3, 9, 12, 14]] = [5, 7, 7, 1]
    keys = hindsight_keys(count_G, 3)
    assert keys.tolist() == [3, 9, 12]
    m = manager("static_cold", 3)
    install_hindsight(m, keys)
    assert np.flatnonzero(m.published_LE.reshape(-1) >= 0).tolist() == [3, 9, 12]
    r = m.visit(1, np.array([[1, 4]]))  # key 9 = layer 1 expert 1 hits, 12 = expert 4 hits
    assert r.hit_TK.tolist() == [[True, True]] and r.admitted.size == 0
    with pytest.raises(MoecacheError, match="static_cold manager"):
        install_hindsight(manager("lru", 3), keys)


def test_strategies_are_checked_and_a_hindsight_selection_runs_as_the_placement():
    assert check_names(list(STRATEGIES)) == list(STRATEGIES)
    with pytest.raises(MoecacheError, match="unknown strategy 'belady'"):
        check_names(["selected", "belady"])
    made = {s.name: s for s in build(list(STRATEGIES), PolicySpec.of("static_hindsight"))}
    assert made["selected"].hindsight and made["selected"].policy.name == "static_cold"
    assert made["lru_sync"].on_miss == "wait" and made["n_cpu_moe"].policy.name == "static_layers"
    assert build(["selected"], PolicySpec.of("lru"))[0].policy == PolicySpec.of("lru")
