"""Cold static: the first `capacity` keys in (layer_id, expert_id) order, i.e. keys 0 .. capacity-1,
resident from the start free of charge, never changed. No ties: the order is total.
"""

from __future__ import annotations

import numpy as np

from moecache.sim.policy import Policy, register, static_step


@register
class StaticCold(Policy):
    name = "static_cold"
    cold_start = False
    step = static_step
    state_fields = ("keys",)

    def init_state(self, trace, capacity: int) -> tuple:
        return (np.arange(capacity, dtype=np.int64),)

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        return state[0].astype(np.int32)
