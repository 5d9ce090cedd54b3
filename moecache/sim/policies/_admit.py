"""What several policies' steps share: undoing an admission whose key the same step then evicts."""

from __future__ import annotations

import numba as nb


@nb.njit(cache=True, inline="always")
def cancel_or_evict(admit_out, n_admit, evict_out, n_evict, admitted_at_G, a0, victim):
    """Record the eviction of `victim`, or, when this same step admitted it (admitted_at_G[victim] ==
    a0, the step's first access index), drop that admission: the two cancel out and no copy is made.
    Returns (n_admit, n_evict)."""
    if admitted_at_G[victim] == a0:
        at = 0
        for j in range(n_admit):  # no `break`: numba prunes reference counting only in simple loops
            if admit_out[j] == victim:
                at = j
        admit_out[at] = admit_out[n_admit - 1]
        n_admit -= 1
    else:
        evict_out[n_evict] = victim
        n_evict += 1
    return n_admit, n_evict
