"""Instant-mode replay: infinite bandwidth, zero latency; an admitted expert is resident from the
next step. The compiled loop is written once and compiled once per policy (jit.py, visit.py).

Legend: V layer visits, A accesses, G global expert keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.jit import bound
from moecache.sim.policy import Policy
from moecache.sim.trace_arrays import TraceArrays
from moecache.sim.visit import apply_step


@dataclass
class ReplayResult:
    """Per-access hits and per-step placement changes of one (trace, policy, capacity) replay."""

    policy: str
    capacity: int
    hit_A: np.ndarray  # bool
    admits_V: np.ndarray  # int32: keys admitted (copies enqueued) at each layer step
    evicts_V: np.ndarray  # int32
    # Prefetches: admissions of keys the admitting step did not access. A prefetch is used when its key
    # is accessed while still holding that slot (instant mode: a hit); evicted (or still pending at the
    # end of the trace) first, it is unused. Keyword-only, with defaults, so that results built by hand
    # (and the positional fields of TimedResult) are unaffected.
    prefetches: int = field(default=0, kw_only=True)
    prefetches_used: int = field(default=0, kw_only=True)
    prefetch_V: np.ndarray | None = field(default=None, kw_only=True)  # int32: prefetches of each step


def _replay_instant(
    state, key_A, uses_A, start_V, clock_V, request_V, resident_G, capacity, hit_A, admits_V, evicts_V,
    prefetch_V, admit_buf, evict_buf, seen_G, pending_G,
):  # fmt: skip
    """Returns (prefetches, prefetches used). Compiled once per policy (`bound`, jit.py): the policy
    is the type of `state`. Every layer visit goes through visit.apply_step. Scratch per key:
    admit_buf, evict_buf (int32), seen_G (int64, -1: last step that accessed the key), pending_G
    (int64, -1: index of the key's pending prefetch, i.e. admitted without being accessed and not
    yet accessed or evicted)."""
    num_keys = resident_G.shape[0]
    held = 0
    for k in range(num_keys):
        held += resident_G[k]
    n_prefetch = 0
    n_used = 0
    n_pending = 0  # prefetches neither used nor evicted yet: demand policies skip the bookkeeping
    for s in range(start_V.shape[0] - 1):
        a0 = start_V[s]
        a1 = start_V[s + 1]
        for a in range(a0, a1):
            k = key_A[a]
            hit_A[a] = resident_G[k]
            seen_G[k] = s
        if n_pending > 0:
            for a in range(a0, a1):
                k = key_A[a]
                if pending_G[k] >= 0:  # a prefetched key accessed while it (still) holds the slot: used
                    pending_G[k] = -1
                    n_pending -= 1
                    n_used += 1
        n_admit, n_evict, held = apply_step(
            state, key_A[a0:a1], uses_A[a0:a1], hit_A[a0:a1], a0, clock_V[s], request_V[s], resident_G,
            held, capacity, admit_buf, evict_buf,
        )  # fmt: skip
        if n_pending > 0:
            for j in range(n_evict):
                k = evict_buf[j]
                if pending_G[k] >= 0:  # a pending prefetch evicted unused
                    pending_G[k] = -1
                    n_pending -= 1
        n_pf = 0
        for j in range(n_admit):
            k = admit_buf[j]
            if seen_G[k] != s:  # not accessed by this step: a prefetch
                pending_G[k] = n_prefetch + n_pf
                n_pf += 1
        n_prefetch += n_pf
        n_pending += n_pf
        admits_V[s] = n_admit
        evicts_V[s] = n_evict
        prefetch_V[s] = n_pf
    return n_prefetch, n_used


def check_capacity(trace: TraceArrays, capacity: int) -> None:
    if not isinstance(capacity, int | np.integer) or capacity < 0 or capacity > trace.num_keys:
        raise MoecacheError(
            f"capacity={capacity}: must be an integer from 0 to the number of expert keys "
            f"({trace.num_layers} layers x {trace.num_experts} experts = {trace.num_keys})"
        )


def initial_resident_mask(policy: Policy, state: tuple, trace: TraceArrays, capacity: int) -> np.ndarray:
    resident_G = np.zeros(trace.num_keys, np.bool_)
    initial = policy.initial_residents(state, trace, capacity)
    if len(initial) > capacity:
        raise MoecacheError(
            f"policy {policy.label()} starts with {len(initial)} residents > capacity {capacity}"
        )
    resident_G[initial] = True
    return resident_G


def replay_instant(trace: TraceArrays, policy: Policy, capacity: int) -> ReplayResult:
    check_capacity(trace, capacity)
    state = policy.init_state(trace, int(capacity))
    resident_G = initial_resident_mask(policy, state, trace, capacity)
    return replay_from(trace, policy, state, resident_G, capacity)


def replay_from(
    trace: TraceArrays, policy: Policy, state: tuple, resident_G: np.ndarray, capacity: int
) -> ReplayResult:
    """Replay `trace` from the given policy state and residency (both updated in place): the instant
    replay's loop, also how the runtime's manager warms its cache from a trace."""
    hit_A = np.zeros(trace.num_accesses, np.bool_)
    admits_V = np.zeros(trace.num_steps, np.int32)
    evicts_V = np.zeros(trace.num_steps, np.int32)
    prefetch_V = np.zeros(trace.num_steps, np.int32)
    k = trace.num_keys
    try:
        prefetches, used = bound(_replay_instant, type(policy))(
            policy.named_state(state), trace.key_A, trace.uses_A, trace.start_V, trace.clock_V, trace.request_V,
            resident_G, int(capacity), hit_A, admits_V, evicts_V, prefetch_V,
            np.empty(k, np.int32), np.empty(k, np.int32), np.full(k, -1, np.int64), np.full(k, -1, np.int64),
        )  # fmt: skip
    except ValueError as exc:
        raise MoecacheError(f"policy {policy.label()} at capacity {capacity}: {exc}") from exc
    return ReplayResult(
        policy.label(),
        int(capacity),
        hit_A,
        admits_V,
        evicts_V,
        prefetches=int(prefetches),
        prefetches_used=int(used),
        prefetch_V=prefetch_V,
    )
