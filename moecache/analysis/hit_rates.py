"""What caching can achieve on a trace: LRU and cumulative LFU hit rates and the offline-optimal
(Belady) bound at every capacity, in instant mode (infinite bandwidth: a pure ranking measure).

The replays are the simulator's (moecache/sim), the same policies the sweep and the runtime use.
"""

from __future__ import annotations

import pyarrow as pa

from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.trace_arrays import TraceArrays

# name in the table -> (policy, parameters). The warm Belady with bypass starts from the best initial
# placement and may decline to cache: no policy of the registry can beat it (docs/simulator.md).
POLICIES = {
    "lru": ("lru", {}),
    "lfu": ("lfu", {"reset_per_request": False}),
    "belady": ("belady", {"warm": True, "bypass": True}),
}


def hit_rate_table(trace: TraceArrays, capacities: list[int]) -> pa.Table:
    """trace, policy, capacity, hit_rate (hits / accesses) for every policy of POLICIES."""
    rows = []
    for name, (policy, params) in POLICIES.items():
        for capacity in capacities:
            result = replay_instant(trace, make_policy(policy, **params), capacity)
            hits = int(result.hit_A.sum())
            rows.append(
                {
                    "trace": trace.name,
                    "policy": name,
                    "capacity": int(capacity),
                    "hit_rate": hits / trace.num_accesses if trace.num_accesses else None,
                }
            )
    return pa.Table.from_pylist(rows)
