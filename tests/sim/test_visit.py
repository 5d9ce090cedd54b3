"""The per-policy layer-visit entry point (moecache/sim/visit.py), the drivers' disk cache (jit.py) and
the compiled step-time pass of instant mode (cost_model.py)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import namedtuple

import numba as nb
import numpy as np
import pytest

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.sim.cost_model import forward_index, instant_step_us
from moecache.sim.jit import cache_tag
from moecache.sim.policies.lru import LRU
from moecache.sim.policy import POLICIES, Policy, make_policy, register
from moecache.sim.replay import initial_resident_mask, replay_instant
from moecache.sim.shape import ModelShape
from moecache.sim.trace_arrays import DECODE
from moecache.sim.visit import bind_step, visit_entry
from tests.sim.strategies import hand_cost, skewed_trace

ONLINE = sorted(name for name, cls in POLICIES.items() if not cls.offline)


# this module's sizes of the shared skewed trace
random_trace = functools.partial(skewed_trace, requests=3, tokens=10, layers=3, experts=6, top_k=2, prefill=3)


def visit_by_visit(trace, policy, capacity):
    """hit_A, admissions and evictions per layer visit, calling the compiled `visit` from Python."""
    state = policy.named_state(policy.init_state(trace, capacity))
    resident_G = initial_resident_mask(policy, state, trace, capacity)
    held_capacity = np.array([int(resident_G.sum()), capacity], np.int64)
    visit = visit_entry(type(policy))
    admit_out, evict_out = np.empty(trace.num_keys, np.int32), np.empty(trace.num_keys, np.int32)
    hit_A = np.zeros(trace.num_accesses, np.bool_)
    admits, evicts = [], []
    for v in range(trace.num_steps):
        a0, a1 = int(trace.start_V[v]), int(trace.start_V[v + 1])
        hit_U = np.zeros(a1 - a0, np.bool_)
        n_admit, n_evict = visit(
            state, trace.key_A[a0:a1], trace.uses_A[a0:a1], a0, int(trace.clock_V[v]), int(trace.request_V[v]),
            resident_G, held_capacity, hit_U, admit_out, evict_out,
        )  # fmt: skip
        hit_A[a0:a1] = hit_U
        admits.append(n_admit)
        evicts.append(n_evict)
        assert held_capacity[0] == resident_G.sum() <= capacity
    return hit_A, admits, evicts


@pytest.mark.parametrize("name", ONLINE)
@pytest.mark.parametrize("capacity", [0, 1, 5, 18])
def test_visit_from_python_equals_the_compiled_replay(make_trace, policy_params, name, capacity):
    """The runtime's entry point, one visit per call, gives the instant replay's hits and placements."""
    trace = random_trace(make_trace)
    cost = hand_cost()
    params = policy_params(name, trace)
    hit_A, admits, evicts = visit_by_visit(trace, make_policy(name, **params).bind_cost(cost), capacity)
    replay = replay_instant(trace, make_policy(name, **params).bind_cost(cost), capacity)
    assert hit_A.tolist() == replay.hit_A.tolist()
    assert admits == replay.admits_V.tolist()
    assert evicts == replay.evicts_V.tolist()


@nb.njit
def _scripted_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    admit_S, evict_S = state
    for i in range(admit_S.shape[0]):
        admit_out[i] = admit_S[i]
    for i in range(evict_S.shape[0]):
        evict_out[i] = evict_S[i]
    return admit_S.shape[0], evict_S.shape[0]


class Scripted(Policy):
    """Not registered: every visit's step lists the same admissions and evictions (its parameters),
    as they are, so that apply_step's cancellations and checks can be seen on their own."""

    name = "scripted_test"
    defaults = {"admit": (), "evict": ()}
    step = _scripted_step

    def init_state(self, trace, capacity: int) -> tuple:
        return np.array(self.params["admit"], np.int32), np.array(self.params["evict"], np.int32)


def one_visit(policy, resident=(), capacity=8, key_U=()):
    """One compiled visit of `policy` (one layer of 12 experts) from `resident`: (net admissions, net
    evictions, residents after)."""
    shape = ModelShape(num_layers=1, num_experts=12, top_k=4, expert_bytes=1)
    num_keys = shape.num_keys
    state = policy.named_state(policy.init_state(shape, capacity))
    resident_G = np.zeros(num_keys, np.bool_)
    resident_G[list(resident)] = True
    held_capacity = np.array([len(resident), capacity], np.int64)
    key_U = np.array(key_U, np.int32)
    admit_out, evict_out = np.full(num_keys, -7, np.int32), np.full(num_keys, -7, np.int32)
    n_admit, n_evict = visit_entry(type(policy))(
        state, key_U, np.ones_like(key_U), 0, 0, 0, resident_G, held_capacity,
        np.zeros(len(key_U), np.bool_), admit_out, evict_out,
    )  # fmt: skip
    assert held_capacity[0] == resident_G.sum()
    residents = set(np.flatnonzero(resident_G).tolist())
    return admit_out[:n_admit].tolist(), evict_out[:n_evict].tolist(), residents


def test_apply_step_cancels_an_admission_the_same_step_evicts():
    """Key 1 held no slot before the visit and is listed as evicted: the step admitted it, so the two
    cancel out (no admission, no eviction); key 7's eviction is real."""
    got = one_visit(Scripted(admit=(1, 2, 3), evict=(7, 1)), resident={7, 9}, capacity=4)
    assert got == ([2, 3], [7], {2, 3, 9})


def test_apply_step_keeps_the_order_of_the_admissions_it_does_not_cancel():
    """Cancelling removes the FIRST admission of the key and moves the later ones up (list.remove, as
    tests/sim/reference.py::cancel_or_evict does): the copies are queued in the step's order."""
    assert one_visit(Scripted(admit=(1, 2, 3, 4), evict=(2,)))[0] == [1, 3, 4]
    assert one_visit(Scripted(admit=(1, 2, 3, 4, 5), evict=(4, 1)))[0] == [2, 3, 5]
    assert one_visit(Scripted(admit=(5, 6, 5), evict=(5,)))[0] == [6, 5]  # first occurrence only


def test_apply_step_lets_a_key_evicted_and_admitted_again_keep_its_slot():
    """Key 7 held a slot and the step evicted it, then admitted it again (a prefetch of a key a demand
    admission had just evicted): it keeps its slot, no eviction and no copy; key 9's eviction is real
    and the other evictions keep their order."""
    got = one_visit(Scripted(admit=(1, 7, 2), evict=(9, 7, 8)), resident={7, 8, 9}, capacity=3)
    assert got == ([1, 2], [9, 8], {1, 2, 7})


def test_lru_with_more_misses_than_slots_admits_in_router_order():
    """Capacity 3, one step of four misses 0..3: LRU admits 0, 1, 2, then 3 evicts 0 (admitted by the
    same step: cancelled). Net: 1, 2, 3 in router order, nothing evicted."""
    assert one_visit(make_policy("lru"), capacity=3, key_U=(0, 1, 2, 3)) == ([1, 2, 3], [], {1, 2, 3})


@pytest.mark.parametrize(
    "admit, evict, resident, error",
    [
        ((1,), (2,), (), "evicted a key that holds no slot"),
        ((), (3,), (), "evicted a key that holds no slot"),
        ((), (7, 7), (7,), "evicted a key twice in one step"),
        ((1,), (1, 1), (), "evicted a key twice in one step"),
        ((1, 1), (1, 1), (), "evicted a key twice in one step"),
        ((7,), (), (7,), "admitted a key that already holds a slot"),
        ((1, 1), (), (), "admitted a key that already holds a slot"),
        ((1, 2, 3), (), (7,), "holds more keys than the capacity"),
    ],
)
def test_apply_step_refuses_a_broken_step(admit, evict, resident, error):
    with pytest.raises(ValueError, match=error):
        one_visit(Scripted(admit=admit, evict=evict), resident=set(resident), capacity=3)


def test_every_registered_policy_has_its_own_named_state():
    classes = [cls.state_class() for cls in POLICIES.values()]
    assert len(set(classes)) == len(classes)
    lru = LRU.state_class()
    assert lru._fields == ("prev_G", "next_G", "meta")
    assert lru.__qualname__ == "LRU.State" and LRU.State is lru  # found again by name (pickle)


def test_every_registered_policy_state_has_its_own_dispatch_fingerprint(make_trace, policy_params):
    """numba's dispatcher recognises argument types by fingerprint (type name, field names and
    dtypes), not by class: two policies sharing one would make every visit of the second take numba's
    slow type resolution (lfu_decay and lrfu have the same fields and dtypes, static_cold and
    static_layers the same one field). numba._dispatcher.compute_fingerprint is its C function."""
    from numba._dispatcher import compute_fingerprint

    trace = random_trace(make_trace)
    seen = {}
    for name, cls in POLICIES.items():
        policy = cls(**policy_params(name, trace)).bind_cost(hand_cost())
        state = policy.named_state(policy.init_state(trace, 3))
        seen.setdefault(compute_fingerprint(state), []).append(name)
    assert [names for names in seen.values() if len(names) > 1] == []


def test_a_state_class_takes_one_step():
    other = namedtuple("Other", "a")

    @nb.njit
    def step_a(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
        return 0, 0

    @nb.njit
    def step_b(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
        return 0, 0

    bind_step(other, step_a)
    bind_step(other, step_a)  # the same step again is fine
    with pytest.raises(ValueError, match="already bound to another step"):
        bind_step(other, step_b)


def test_a_registered_policy_must_name_its_state():
    class Nameless(Policy):
        name = "nameless_test"
        step = LRU.step

    with pytest.raises(ValueError, match="must declare its state_fields"):
        register(Nameless)
    assert "nameless_test" not in POLICIES


def test_named_state_refuses_a_state_of_another_length(make_trace):
    trace = random_trace(make_trace)
    with pytest.raises(ValueError, match="init_state returned 2 members, State has 3"):
        make_policy("lru").named_state(LRU().init_state(trace, 2)[:2])


def test_only_registered_policies_are_cached_on_disk():
    assert cache_tag(LRU) == "moecache.sim.policies.lru.LRU"

    class Unregistered(LRU):
        pass

    assert cache_tag(Unregistered) is None


CACHE_PROBE = """
import json, sys
import numpy as np
import moecache.sim.jit as jit
if sys.argv[1] != "same":
    jit.source_fingerprint.cache_clear()
    jit.source_fingerprint = lambda: "an edited simulator"
from moecache.sim.policy import make_policy
from moecache.sim.replay import _replay_instant, replay_instant
from moecache.sim.trace_arrays import TraceArrays
trace = TraceArrays(
    num_layers=1, num_experts=4, top_k=1, expert_bytes=1, request_ids=("r",),
    layer_V=np.zeros(3, np.int32), request_V=np.zeros(3, np.int32), step_V=np.arange(3, dtype=np.int32),
    tokens_V=np.ones(3, np.int32), phase_V=np.ones(3, np.int8), clock_V=np.arange(3, dtype=np.int64),
    start_V=np.arange(4, dtype=np.int64), key_A=np.array([1, 1, 2], np.int32), uses_A=np.ones(3, np.int32),
)
policy = make_policy("lru")
hits = replay_instant(trace, policy, 1).hit_A.tolist()
stats = jit.bound(_replay_instant, type(policy)).stats
print(json.dumps({"hits": hits, "cache_hits": sum(stats.cache_hits.values()),
                  "cache_misses": sum(stats.cache_misses.values())}))
"""


def probe(cache_dir, fingerprint: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, fingerprint], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_a_second_process_loads_the_driver_instead_of_compiling_it(tmp_path):
    """numba's disk cache serves the per-policy driver to a fresh process, and a changed source
    fingerprint (an edit anywhere in moecache/sim) makes it compile again."""
    first = probe(tmp_path, "same")
    assert first == {"hits": [False, True, False], "cache_hits": 0, "cache_misses": 1}
    assert probe(tmp_path, "same") == {"hits": [False, True, False], "cache_hits": 1, "cache_misses": 0}
    assert probe(tmp_path, "edited") == {"hits": [False, True, False], "cache_hits": 0, "cache_misses": 1}


def numpy_step_us(trace, hit_A, cost):
    """The vectorised formula the compiled pass replaced (np.bincount sums), as the oracle."""
    step_A = np.repeat(np.arange(trace.num_steps), np.diff(trace.start_V))
    gpu_V = np.bincount(
        step_A, np.where(hit_A, cost.gpu_table()[trace.uses_A], 0.0), minlength=trace.num_steps
    )
    cpu_V = np.bincount(
        step_A, np.where(hit_A, 0.0, cost.cpu_table()[trace.uses_A]), minlength=trace.num_steps
    )
    return cost.non_expert_V(trace) + np.maximum(gpu_V, cpu_V)


@pytest.mark.parametrize("non_expert", [(0.0, None), (7.5, None), (7.5, 0.3)])
def test_instant_step_times_are_bit_identical_to_the_vectorised_formula(make_trace, non_expert):
    trace = random_trace(make_trace, seed=3, prefill=4)
    assert (trace.phase_V != DECODE).any() and (trace.uses_A > 1).any()
    cost = hand_cost(non_expert_us_per_layer=non_expert[0], non_expert_us_per_prefill_token=non_expert[1])
    hit_A = replay_instant(trace, make_policy("lru"), 5).hit_A
    assert hit_A.any() and not hit_A.all()
    assert instant_step_us(trace, hit_A, cost).tobytes() == numpy_step_us(trace, hit_A, cost).tobytes()


def test_forward_index(make_trace):
    trace = random_trace(make_trace, requests=2, tokens=3, layers=2, prefill=1)
    fwd_V, first_F = forward_index(trace)
    assert fwd_V.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert first_F.tolist() == [0, 2, 4, 6, 8, 10]
    assert fwd_V.dtype == first_F.dtype == np.int64
