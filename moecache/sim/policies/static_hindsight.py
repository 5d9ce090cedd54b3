"""Hindsight static: the `capacity` keys most used by the very trace being replayed, resident from
the start free of charge, never changed (no admissions, no evictions).

A key's count is its uses summed over the whole trace (tokens selecting it); keys are ranked by
(-count, layer_id, expert_id), i.e. (-count, key): among equal counts the smaller key wins, and when
the capacity exceeds the number of used keys, unused keys fill the remaining slots in key order.
"""

from __future__ import annotations

import numpy as np

from moecache.sim.policies.lfu import key_counts
from moecache.sim.policy import Policy, register, static_step


def top_keys(count_G: np.ndarray, capacity: int) -> np.ndarray:
    """The `capacity` best keys by (-count, key), as int32."""
    order = np.lexsort((np.arange(len(count_G)), -count_G))
    return np.sort(order[:capacity]).astype(np.int32)


@register
class StaticHindsight(Policy):
    """Offline: `init_state` needs the whole trace to be replayed (its per-key counts), so this policy
    runs only in the simulator; the runtime refuses it (static_cold, or lfu with init_counts from an
    earlier trace, are the online statics)."""

    name = "static_hindsight"
    cold_start = False
    step = static_step
    offline = True  # init_state reads the future of the replayed trace
    state_fields = ("keys",)

    def init_state(self, trace, capacity: int) -> tuple:
        return (top_keys(key_counts(trace), capacity).astype(np.int64),)

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        return state[0].astype(np.int32)
