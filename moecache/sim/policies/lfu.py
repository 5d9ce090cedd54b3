"""Cumulative LFU (the plan's): keep the experts used by the most tokens so far.

At every step the counts of all the step's keys (hits and misses) first grow by their uses; then the
step's misses are considered in rank order, best first, rank key (-count, layer_id, expert_id), i.e.
(-count, key). While slots are free a miss is admitted; once full, the victim is the resident with
the greatest rank key (lowest count; among equal counts the largest key), and a miss replaces it
only when its count is strictly greater than the victim's (so a tie never causes a transfer), the
victim being found again after each replacement. Parameters: `reset_per_request` sets the counters
back to their initial values (zero, or `init_counts`) whenever the request index changes (residency
is kept); `init_counts` (a canonical trace Parquet file or a trace artifact folder) initialises the
counters with that trace's per-key uses. Residents sit in an indexed min-heap (`_heap`), top = victim.

`note_use`, `settle` (and `insert_ranked`, `sort_ranked`, `admit_ranked`) and `frequency_arrays` are
shared with the other frequency policies.
"""

from __future__ import annotations

from pathlib import Path

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policies import _heap
from moecache.sim.policies._params import trace_file
from moecache.sim.policy import Policy, register

# Steps are compiled with `_nrt=False`: they allocate nothing, and numba then emits no reference
# counting for their array arguments and state. With it, numba increfs and decrefs every array of
# the state at each call (atomic operations, ~10 ns each, more than the step's own work) whenever
# it cannot prune them, which happens as soon as the step calls a compiled function or has a
# slightly irregular control flow. Helpers are inlined at the numba IR level.


@nb.njit(cache=True, inline="always")
def insert_ranked(miss, nm, prio, k):
    """Insert key k into miss[:nm], kept best first (greater priority, then smaller key); returns nm + 1."""
    j = nm
    while j > 0 and _heap.before(prio, miss[j - 1], k):
        miss[j] = miss[j - 1]
        j -= 1
    miss[j] = k
    return nm + 1


@nb.njit(cache=True, inline="always")
def sort_ranked(miss, nm, prio):
    """Sort miss[:nm] best first: greater priority, then smaller key (insertion sort: nm is small)."""
    for i in range(1, nm):
        k = miss[i]
        j = i
        while j > 0 and _heap.before(prio, miss[j - 1], k):
            miss[j] = miss[j - 1]
            j -= 1
        miss[j] = k


@nb.njit(cache=True, inline="always")
def admit_ranked(heap, pos, prio, n, cap, miss, nm, admit_out, evict_out):
    """Admit the ranked misses miss[:nm] into free slots, then replace victims while a miss's priority
    is strictly greater than the victim's. Returns (new heap size, n_admit, n_evict).

    A victim is never a key admitted by this same step: such a key ranks at least as well as every
    later miss, so no later miss beats it."""
    na = 0
    ne = 0
    j = 0
    while j < nm:  # no `break` (see _heap)
        m = miss[j]
        j += 1
        if n < cap:
            n = _heap.push(heap, pos, prio, n, m)
        elif n > 0 and prio[m] > prio[heap[0]]:
            evict_out[ne] = _heap.replace_top(heap, pos, prio, n, m)
            ne += 1
        else:
            j = nm  # later misses rank no better: none of them beats the victim either
            continue
        admit_out[na] = m
        na += 1
    return n, na, ne


@nb.njit(cache=True, inline="always")
def note_use(heap, pos, prio, n, miss, nm, best, k):
    """After prio[k] grew by the step's uses of k: restore the heap order if k is held, else add k
    to the step's misses miss[:nm] and raise `best` (start: -1) to the greatest priority of a miss
    (all priorities are >= 0). Returns (nm, best)."""
    p = pos[k]
    if p >= 0:
        if 2 * p + 1 < n:  # not a leaf
            _heap.sift_down(heap, pos, prio, n, p)
    else:
        miss[nm] = k
        nm += 1
        best = max(best, prio[k])
    return nm, best


@nb.njit(cache=True, inline="always")
def settle(heap, pos, prio, n, cap, miss, nm, best, admit_out, evict_out):
    """Admissions and evictions for the step's misses (from note_use). Returns (n, n_admit, n_evict)."""
    na = 0
    ne = 0
    # Once full, the best miss usually does not beat the victim: then nothing changes.
    if nm > 0 and (n < cap or (n > 0 and best > prio[heap[0]])):
        sort_ranked(miss, nm, prio)
        n, na, ne = admit_ranked(heap, pos, prio, n, cap, miss, nm, admit_out, evict_out)
    return n, na, ne


@nb.njit(_nrt=False)  # no reference counting (see above)
def lfu_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    count_G, heap, pos_G, init_G, miss, meta = state  # meta: [held, capacity, last request, reset]
    n = meta[0]
    if meta[3] != 0 and request != meta[2]:
        for k in range(count_G.shape[0]):
            count_G[k] = init_G[k]
        _heap.heapify(heap, pos_G, count_G, n)
    meta[2] = request
    nm = 0
    best = -1
    for i in range(key_U.shape[0]):
        k = key_U[i]
        count_G[k] += uses_U[i]
        nm, best = note_use(heap, pos_G, count_G, n, miss, nm, best, k)
    n, na, ne = settle(heap, pos_G, count_G, n, meta[1], miss, nm, best, admit_out, evict_out)
    meta[0] = n
    return na, ne


@nb.njit(cache=True, nogil=True)
def _count_uses(key_A, uses_A, count_G):
    for a in range(key_A.shape[0]):
        count_G[key_A[a]] += uses_A[a]


def key_counts(trace) -> np.ndarray:
    """Uses per key (int64 [num_keys]) of a TraceArrays."""
    count_G = np.zeros(trace.num_keys, np.int64)
    _count_uses(trace.key_A, trace.uses_A, count_G)
    return count_G


def load_init_counts(path, trace, what: str = "lfu init_counts") -> np.ndarray:
    """Per-key uses of the trace at `path` (trace_file), which must have the same layers and experts as
    `trace`; `what` names the parameter in errors."""
    from moecache.sim.trace_arrays import load_trace

    p = trace_file(path, what)
    prior = load_trace(p)
    if (prior.num_layers, prior.num_experts) != (trace.num_layers, trace.num_experts):
        raise MoecacheError(
            f"{what}={p}: trace has {prior.num_layers} layers x {prior.num_experts} experts, "
            f"the replayed trace {trace.num_layers} x {trace.num_experts}"
        )
    return key_counts(prior)


def frequency_arrays(num_keys: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """heap, pos (-1: not held) and the ranked-miss scratch buffer of a frequency policy."""
    return (
        np.zeros(max(capacity, 1), np.int64),
        np.full(num_keys, -1, np.int64),
        np.zeros(num_keys, np.int64),
    )


@register
class LFU(Policy):
    name = "lfu"
    step = lfu_step
    state_fields = ("count_G", "heap", "pos_G", "init_G", "miss", "meta")
    defaults = {"reset_per_request": False, "init_counts": None}

    def __init__(self, **params):
        super().__init__(**params)
        if not isinstance(self.params["reset_per_request"], bool | np.bool_):
            raise MoecacheError(
                f"policy lfu: reset_per_request must be true or false, got {self.params['reset_per_request']!r}"
            )
        init = self.params["init_counts"]
        if init is not None and not isinstance(init, str | Path):
            raise MoecacheError(f"policy lfu: init_counts must be null or a path, got {init!r}")
        if init is not None:
            trace_file(init, "policy lfu: init_counts")

    def init_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        if self.params["init_counts"] is None:
            init_G = np.zeros(n, np.int64)
        else:  # loaded once per policy instance and model shape (a sweep replays many capacities)
            shape = (trace.num_layers, trace.num_experts)
            cached = self.__dict__.setdefault("_init_counts", {})
            if shape not in cached:
                cached[shape] = load_init_counts(self.params["init_counts"], trace)
            init_G = cached[shape]
        heap, pos_G, miss = frequency_arrays(n, capacity)
        meta = np.array([0, capacity, -1, int(bool(self.params["reset_per_request"]))], np.int64)
        return init_G.copy(), heap, pos_G, init_G, miss, meta
