"""Static whole layers (llama.cpp `--n-cpu-moe N` style): the routed experts of the last
floor(capacity / num_experts) MoE layers resident from the start free of charge, never changed; every
expert of the first layers stays on the CPU. A capacity that is not a whole number of layers leaves its
remainder (capacity mod num_experts slots) unused: the placement is by whole layers, at the same memory
as `capacity` slots at most. With N = num_layers - floor(capacity / num_experts) this is exactly
`--n-cpu-moe N`; capacity 0 is `--cpu-moe`, capacity num_layers * num_experts every expert resident.
Online: it reads only the model's shape.
"""

from __future__ import annotations

import numpy as np

from moecache.sim.policy import Policy, register, static_step


def resident_layers(num_layers: int, num_experts: int, capacity: int) -> int:
    """Whole MoE layers that fit in `capacity` slots (at most all of them)."""
    return min(capacity // num_experts, num_layers)


@register
class StaticLayers(Policy):
    name = "static_layers"
    cold_start = False
    step = static_step
    state_fields = ("keys",)

    def init_state(self, trace, capacity: int) -> tuple:
        L, E = trace.num_layers, trace.num_experts
        first_key = (L - resident_layers(L, E, capacity)) * E
        return (np.arange(first_key, L * E, dtype=np.int64),)

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        return state[0].astype(np.int32)
