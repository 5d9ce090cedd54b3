"""Online policies start from the model's shape alone: `init_state(ModelShape, capacity)` gives the
state `init_state(trace, capacity)` gives for a trace of that shape (the runtime has no trace)."""

from __future__ import annotations

import numpy as np
import pytest

import moecache.sim.policies  # noqa: F401  (registers every policy)
from moecache.cost_profile import CostProfile
from moecache.errors import MoecacheError
from moecache.sim.inputs import BUNDLED_PROFILES
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.shape import ModelShape
from moecache.sim.sweep import CostSettings, cost_model
from tests.conftest import build_trace

ONLINE = sorted(name for name, cls in POLICIES.items() if not cls.offline)
# State members sized by the replayed trace's accesses (a memory bound, not a behaviour).
TRACE_SIZED = {"lfu_window": {"ring_key", "ring_uses", "ring_t"}}


@pytest.fixture(scope="module")
def trace():
    rng = np.random.default_rng(0)
    steps = [
        (0, t, layer, [rng.choice(6, 2, replace=False).tolist()]) for t in range(20) for layer in range(3)
    ]
    return build_trace(steps, num_layers=3, num_experts=6, top_k=2)


@pytest.mark.parametrize("name", ONLINE)
def test_online_state_from_the_shape_equals_the_state_from_a_trace(name, trace, policy_params):
    profile = next(BUNDLED_PROFILES.glob("*.json"))
    cost = cost_model(trace, CostProfile.load(profile), CostSettings())
    shape = ModelShape.of(trace)
    assert shape.num_keys == trace.num_keys
    params = policy_params(name, trace)
    from_shape = make_policy(name, **params).bind_cost(cost)
    from_trace = make_policy(name, **params).bind_cost(cost)
    a = from_shape.named_state(from_shape.init_state(shape, 5))
    b = from_trace.named_state(from_trace.init_state(trace, 5))
    assert a._fields == b._fields
    for field in a._fields:
        if field not in TRACE_SIZED.get(name, ()):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert np.array_equal(
        from_shape.initial_residents(a, shape, 5), from_trace.initial_residents(b, trace, 5)
    )


def test_hindsight_split_needs_the_trace():
    with pytest.raises(MoecacheError, match="split=entropy is a hindsight split"):
        make_policy("lru_per_layer", split="entropy").init_state(ModelShape(3, 6, 2, 0), 5)


def test_model_shape_refuses_nonsense():
    with pytest.raises(MoecacheError, match="top_k 7 > num_experts 6"):
        ModelShape(3, 6, 7, 0)
    with pytest.raises(MoecacheError, match="num_layers must be a positive integer"):
        ModelShape(0, 6, 2, 0)
