"""The cache manager's layer visit as ONE compiled call (moecache/runtime/manager.py's hot path).

Routing in, placement changes out, every array of the manager's bookkeeping updated in place:
1. the routing's distinct experts in order of first selection (token by token, router order within a
   token), their uses, their published slots, the hit mask of every entry and the misses;
2. misses whose copy is still in flight counted late (once per copy);
3. the policy's visit: the same `apply_step` as the simulator's replays (moecache/sim/visit.py);
4. the slots this visit's kernels read get this visit as their last reader;
5. evictions forget their slot (to the free stack, or, if this visit's own kernels read it, to the
   freed-busy stack), clear their published entry (the row is marked dirty) and report whether their
   copy was still in flight (a wasted copy: the caller drops it);
6. admissions take a free slot, else a slot freed by this visit's eviction of an expert its own kernels
   read (flag ADMIT_DEFERRED: the copy follows those kernels, at commit); such slots left over go to the
   free stack (their last reader is this visit: a later copy into one waits for it).
The caller (Python) then enqueues the copies (each after its slot's last reader: the manager's
`_slot_free_after`, the one place that rule lives) and keeps the Copy objects and the loading set. One
call because each call into compiled code from Python costs ~0.05 us per array argument and ~1 us for
the policy's state: a visit split over several calls, with Python bookkeeping between them, would pay
that several times per layer.

Legend: T tokens, K top-k, E experts, L layers, G global keys, U a visit's distinct experts, S slots.
"""

from __future__ import annotations

from numba import typeof

from moecache.sim.jit import bound
from moecache.sim.visit import apply_step

ADMIT_DEFERRED = 1  # flag_out[j] of an admission whose copy must follow this visit's own kernels
BAD_ROUTING = -1  # the visit's first result when the routing holds an id outside 0..E-1
# counts_X (int64): keys holding a slot, capacity, free slots on the stack, slots freed busy (scratch)
HELD, CAPACITY, FREE = 0, 1, 2
# tally_X (int64): the manager's running totals, kept here so the hot path adds them up without Python
TALLY = ("visits", "hits", "misses", "admissions", "evictions", "late_copies", "wasted_copies")


def _manager_visit(
    state, ids_TK, layer, serial, a0, clock, request, stamp_E, pos_E, key_U, uses_U, slot_U, miss_U,
    hit_U, hit_TK, snapshot_E, resident_G, loading_G, late_G, counts_X, admit_out, evict_out, slot_out,
    flag_out, slot_of_G, published_LE, dirty_L, free_S, freed_S, last_read_S, tally_X,
):  # fmt: skip
    """One visit of `layer` (module docstring) at visit `serial`. Returns (U, misses, admissions,
    evictions, late, wasted); the keys are key_U[:U], miss_U[:misses] (expert ids), admit_out[:admissions]
    with slot_out / flag_out, evict_out[:evictions] with flag_out[G + j] = 1 for a wasted copy; U =
    BAD_ROUTING (the rest 0) for an expert id outside 0..E-1, before any state changed. The counts are
    also added to tally_X (TALLY's order, hits = U - misses). Raises ValueError naming the policy's
    broken rule."""
    E = published_LE.shape[1]
    G = resident_G.shape[0]
    row_E = published_LE[layer]
    base = layer * E
    U = 0
    n_miss = 0
    for t in range(ids_TK.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = ids_TK[t, k]
            if e < 0 or e >= E:
                return BAD_ROUTING, 0, 0, 0, 0, 0
            slot = row_E[e]
            hit_TK[t, k] = slot >= 0
            if stamp_E[e] == serial:
                uses_U[pos_E[e]] += 1
                continue
            stamp_E[e] = serial
            pos_E[e] = U
            key_U[U] = base + e
            uses_U[U] = 1
            if slot < 0:
                miss_U[n_miss] = e
                n_miss += 1
            else:
                slot_U[U - n_miss] = slot
            U += 1
    for e in range(E):
        snapshot_E[e] = row_E[e]
    n_late = 0
    for i in range(n_miss):
        key = base + miss_U[i]
        if loading_G[key] and not late_G[key]:
            late_G[key] = True
            n_late += 1
    for i in range(U):
        hit_U[i] = resident_G[key_U[i]]
    n_admit, n_evict, held = apply_step(
        state, key_U[:U], uses_U[:U], hit_U[:U], a0, clock, request, resident_G, counts_X[HELD],
        counts_X[CAPACITY], admit_out, evict_out,
    )  # fmt: skip
    counts_X[HELD] = held
    for i in range(U - n_miss):  # the slots this visit's kernels read
        last_read_S[slot_U[i]] = serial
    n_free = counts_X[FREE]
    n_freed = 0
    n_wasted = 0
    for j in range(n_evict):
        key = evict_out[j]
        slot = slot_of_G[key]
        slot_of_G[key] = -1
        kl = key // E
        if published_LE[kl, key - kl * E] >= 0:
            published_LE[kl, key - kl * E] = -1
            dirty_L[kl] = True
        flag_out[G + j] = 1 if loading_G[key] else 0
        n_wasted += flag_out[G + j]
        loading_G[key] = False
        late_G[key] = False
        if last_read_S[slot] == serial:
            freed_S[n_freed] = slot
            n_freed += 1
        else:
            free_S[n_free] = slot
            n_free += 1
    for j in range(n_admit):
        key = admit_out[j]
        if n_free > 0:
            n_free -= 1
            slot = free_S[n_free]
            flag_out[j] = 0
        elif n_freed > 0:
            n_freed -= 1
            slot = freed_S[n_freed]
            flag_out[j] = ADMIT_DEFERRED
        else:
            raise ValueError("policy admitted a key with no slot free")
        slot_of_G[key] = slot
        slot_out[j] = slot
    for i in range(n_freed):  # freed by this visit and not taken: free, read by this visit's kernels
        free_S[n_free] = freed_S[i]
        n_free += 1
    counts_X[FREE] = n_free
    tally_X[0] += 1
    tally_X[1] += U - n_miss
    tally_X[2] += n_miss
    tally_X[3] += n_admit
    tally_X[4] += n_evict
    tally_X[5] += n_late
    tally_X[6] += n_wasted
    return U, n_miss, n_admit, n_evict, n_late, n_wasted


class CompiledVisit:
    """`_manager_visit` of one policy class (cached on disk for registered policies), callable as
    `visit(*args)`. Calling a numba dispatcher costs ~1.5 us here before any work: it types every
    argument (the policy's state, a named tuple, most of it) to pick the compiled version. The arguments
    of a manager's visits always have the same types, so after the first call through the dispatcher
    the compiled version's entry point is called directly (0.5 us), until `retype()`: the caller
    replaced an argument by one that may differ in type (a new policy state). The caller keeps the
    argument types fixed otherwise (the routing a C-contiguous int64 [T, K] array)."""

    def __init__(self, policy_cls: type):
        self._dispatcher = bound(_manager_visit, policy_cls)
        self._entry = None

    def retype(self) -> None:
        self._entry = None

    def __call__(self, *args):
        if self._entry is not None:
            return self._entry(*args)
        out = self._dispatcher(*args)
        compiled = self._dispatcher.overloads.get(tuple(typeof(a) for a in args))
        self._entry = getattr(compiled, "entry_point", None)
        return out
