"""Timed replay: the plan's timeline with one copy engine, measured costs and CPU fallback.

Legend: V layer visits, A accesses, G global expert keys, C copies (one per admission), F forward steps.

The time model (docs/simulator.md, "Timed mode"). Forward steps run back to back, their MoE layers
in order; a layer step starts at t and routes at tr = t + non_expert (attention, router and the rest
precede the MoE block; non_expert is 0 unless configured, see cost_model.py):
1. a key holding a slot is a hit only if its copy is complete (ready_G <= tr); a key whose copy is
   still in flight is a miss served by the CPU (no waiting). Hits run on the GPU, misses on the CPU,
   in parallel; each expert call costs its own table entry at M = uses (decode: M = 1; prefill steps
   are one batched call per expert): the step takes non_expert + max(sum gpu(M) of hits,
   sum cpu(M) of misses), and its GPU work ends at tr + sum gpu(M) of hits.
2. the policy's `step` runs exactly as in instant mode and sees every key that holds a slot, copy
   complete or not, as resident (so placements equal instant mode's at any bandwidth; only which
   resident keys are usable differs). Evictions free slots, admissions take them.
3. every admission enqueues one copy at tr on the single copy engine, FIFO:
   start = max(tr, engine_free, slot_free), ready = start + latency + expert_bytes / bandwidth,
   engine_free = ready. slot_free: an admission takes a slot that is already safe if there is one
   (never used, or its last GPU user finished by tr); otherwise one freed by this step's eviction of
   a key the step just ran on the GPU, safe at the end of the step's GPU work. Queued copies are never
   cancelled: evicting a key whose copy is not complete wastes that copy (it still occupies the
   engine). Initial residents (static policies, warm Belady) are ready at time 0 at no cost.
4. an admission of a key the step did not access is a prefetch. Its copy is pending until the key is
   next accessed while it still holds the slot (the prefetch is used then; timely if the copy was
   complete at that routing time) or until the key is evicted (unused).
5. `on_miss="wait"` models the runtime's on_miss="wait" (synchronous on-demand copies, the lru_sync
   baseline): the step's copies into safe slots are enqueued first and the step waits for them
   (wait = last ready - tr); the misses they admitted then run on the GPU with the hits, the other
   misses on the CPU; the step takes non_expert + wait + max (or, serial, the sum) of the two halves.
   Copies into slots freed by the step's own GPU work are enqueued after that work (the runtime's
   deferred copies) and their misses stay on the CPU. Hits and misses are counted as the cache was
   when the step began (hit_A), as the runtime counts them.
6. `on_miss="split"` models the runtime's on_miss="split" (moecache/sim/miss_split.py): the step's
   misses whose copy is in flight (late ones, then its own admissions into safe slots, in the order
   their copies land) are candidates; `split_waits` picks how many of the first ones wait for their
   copy and run on the device (one more operator call over their entries, after the last of them
   lands) while the CPU runs the other misses: the step takes non_expert + max (serial: the sum) of
   the CPU part and max(hits' kernel, last waited copy's landing + that call). The host's share (the
   profile's runtime.split_host, where calibrate measured it): a step with candidates pays the
   decision (split_decide_us), a waiting one also its wait (split_wait_us: the stream's wait, the wait
   row, the wait call), which `split_waits` weighs.
7. the fast decode loop's deferred visit (`CostModel.defer_V`: a profile measured in the fast loop,
   on_miss="cpu", decode steps; the prefill is transformers' forward, whose layers visit at their
   routing as above; moecache/runtime/segments.py): the runtime runs a layer's visit (policy, copies)
   at the next host point, after the layer's CPU half, and then publishes the next layer's completed
   copies. The visit of step s happens at v = tr + the step's CPU time (tr without misses; a copy
   still loading then is wasted); its j-th copy reaches the engine after j + 1 enqueues (v + (j + 1)
   x copy_host_us), and step s + 1's hits are those whose copy is complete at its publication, h_{s+1}
   = v + admissions x copy_host_us + the publish lag (the host's work between the last enqueue and the
   publication: the commit, the forced rows, the prepare; route_us_V holds h). The lag is the
   profile's measured distribution (`CostModel.publish_lag_Q`), step s taking its quantile at the
   probability frac((s + 1) x golden ratio), so consecutive steps sample it evenly and the replay
   stays deterministic. A prefetch for the next layer is usable by it only where its copy lands within
   that host time (one copy, ~120 us on an H100, against a lag of about as much).
8. the fast loop's decoder warm-up (`CostModel.pause_V`: a profile measured in the fast loop): a run's
   decoder runs its first decode steps eagerly and then captures its graphs, so those steps of the
   run's first request take longer than the rest (runtime.decode_warmup; on DeepSeek-V2-Lite's shape
   on an H100, 55-80 ms each against 12-25 ms steps). That time is a pause before the
   step's layer steps: the clock and the next publication move on by it, the copy engine keeps
   copying, and no step's duration holds it (validate leaves the warm-up gaps out of time per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.cost_model import CostModel, forward_index
from moecache.sim.jit import bound
from moecache.sim.miss_split import ON_MISS_CODES, split_waits
from moecache.sim.policy import Policy
from moecache.sim.replay import ReplayResult, check_capacity, initial_resident_mask
from moecache.sim.trace_arrays import TraceArrays
from moecache.sim.visit import apply_step


@dataclass
class TimedResult(ReplayResult):
    """A timed replay. `hit_A` counts only usable hits (copy complete); `slot_A` every access whose
    key held a slot (equal to instant mode's hit_A)."""

    slot_A: np.ndarray  # bool
    step_us_V: np.ndarray  # float64: duration of each layer step
    route_us_V: np.ndarray  # float64: when each layer step's hits are checked (its routing time; 7.: h)
    forward_us_F: np.ndarray  # float64: duration of each forward step (sum of its layer steps)
    first_F: np.ndarray  # int64: first layer step of each forward step
    copy_key_C: np.ndarray  # int32: admitted key of each copy, in enqueue order
    copy_step_C: np.ndarray  # int64: layer step that enqueued it
    copy_start_us_C: np.ndarray  # float64: when the engine starts it
    copy_ready_us_C: np.ndarray  # float64: when it completes
    copy_wasted_C: np.ndarray  # bool: its key was evicted before the copy completed
    copy_ready_next_C: np.ndarray  # bool: complete by the next visit of the key's layer
    copy_has_next_C: np.ndarray  # bool: the key's layer is visited again after the copy's step
    copy_prefetch_C: np.ndarray  # bool: a prefetch (its key was not accessed by the enqueuing step)
    copy_used_C: np.ndarray  # bool: a prefetch whose key was accessed while holding its slot
    copy_use_us_C: np.ndarray  # float64: routing time of that first use (NaN: never used)
    cpu_fallbacks: int  # accesses executed on the CPU (misses, including keys still loading)
    cpu_fallback_selections: int  # the same weighted by uses (token selections)
    cost: CostModel | None = None

    @property
    def copies_total(self) -> int:
        return int(self.copy_key_C.shape[0])

    @property
    def copies_ready_next_visit(self) -> int:
        return int(self.copy_ready_next_C.sum())

    @property
    def copies_with_next_visit(self) -> int:
        return int(self.copy_has_next_C.sum())

    @property
    def wasted_copies(self) -> int:
        return int(self.copy_wasted_C.sum())

    @property
    def total_us(self) -> float:
        return float(self.step_us_V.sum())

    @property
    def copy_timely_C(self) -> np.ndarray:
        """bool: a used prefetch whose copy was complete at its first use (a hit, not a CPU fallback)."""
        return self.copy_used_C & (self.copy_ready_us_C <= self.copy_use_us_C)

    @property
    def copy_lead_us_C(self) -> np.ndarray:
        """float64: first use - enqueue routing time of each copy (NaN: not a used prefetch)."""
        return self.copy_use_us_C - self.route_us_V[self.copy_step_C]


GOLDEN = 0.6180339887498949  # the low-discrepancy sequence of the publish lags' probabilities (7.)


@nb.njit(cache=True, nogil=True)
def _lag_at(lag_Q, s):
    """Step s's publish lag (7.): the quantile function through lag_Q (evenly spaced probabilities) at
    the probability frac((s + 1) * GOLDEN), a deterministic sequence that covers [0, 1) evenly over
    consecutive steps. 0.0 for an empty lag_Q."""
    n = lag_Q.shape[0]
    if n < 2:
        return lag_Q[0] if n else 0.0
    x = ((s + 1) * GOLDEN) % 1.0 * (n - 1)
    i = min(int(x), n - 2)
    return lag_Q[i] + (x - i) * (lag_Q[i + 1] - lag_Q[i])


# Compiled once per policy by `bound` (jit.py): the policy is the type of `state`, and every layer
# visit goes through visit.apply_step, as in instant mode.
def _replay_timed(
    state, key_A, uses_A, start_V, clock_V, request_V, resident_G, capacity,
    cpu_us_M, gpu_us_M, non_expert_V, copy_us, kernel_off_V, kernel_us_X, cpu_call_us, cpu_excess_V, serial, miss_mode,
    defer_V, copy_host_us, publish_lag_Q, pause_V, split_decide_us, split_wait_us, hit_A, slot_A, admits_V, evicts_V, step_us_V, route_us_V, prefetch_V,
    copy_key_C, copy_step_C, copy_start_C, copy_ready_C, copy_wasted_C, copy_prefetch_C, copy_used_C,
    copy_use_C, admit_buf, evict_buf, ready_G, copy_of_G, gpu_step_G, seen_G, pending_G, uses_G,
    cand_key_J, cand_ready_J, cand_cpu_J, gpu_wait_W,
):  # fmt: skip
    """Returns (copies, CPU fallback selections, prefetches, prefetches used); copies = -1 when the
    copy arrays are too short (the caller retries with longer ones: arrays reassigned inside the loop
    would cost reference counting on every iteration). Scratch per key: admit_buf, evict_buf (int32),
    ready_G (float64, zeros: copy completion of keys holding a slot), copy_of_G (int64, -1: the key's
    latest copy), gpu_step_G (int64, -1: last step that ran the key on the GPU), seen_G (int64, -1:
    last step that accessed the key), pending_G (int64, -1: the key's pending prefetch copy), uses_G
    (int64: the key's uses in the step that last accessed it); on_miss="split"'s candidates (cand_*_J,
    gpu_wait_W: one more entry). miss_mode: ON_MISS_CODES (0 cpu, 1 wait, 2 split); defer_V (bool per
    step): the fast loop's deferred visit (module docstring, 7.; on_miss="cpu", decode steps only);
    pause_V (us per step): host time before the step that is not its own (8.).
    With kernel rows (kernel_off_V not empty: a profile's runtime step, cost_model.py) the GPU time is
    the operator's row at the step's usable resident entries, a step with a miss on the CPU adds
    cpu_call_us + cpu_excess_V[s] (the profile's CPU-step excess of its phase: CostModel.cpu_excess_V)
    to its CPU time, and `serial` adds the two halves instead of taking their max. Every admission adds
    `copy_host_us` of host time (its copy's enqueue) to its step."""
    fused = kernel_off_V.shape[0] > 0
    wait = miss_mode == 1
    split = miss_mode == 2
    num_keys = resident_G.shape[0]
    num_steps = start_V.shape[0] - 1
    cap_C = copy_key_C.shape[0]
    n_copies = 0
    held = 0
    for k in range(num_keys):
        held += resident_G[k]
    safe_slots = capacity - held  # free slots whose last GPU user has finished
    t = 0.0
    host = 0.0  # 7.: the publication of this step's hits, after the previous step's deferred visit
    host_set = False  # whether `host` is that point: the previous step deferred its visit
    engine_free = 0.0
    cpu_fallback_sel = 0
    n_prefetch = 0
    n_used = 0
    n_pending = 0  # prefetches neither used nor evicted yet: demand policies skip the bookkeeping
    for s in range(num_steps):
        a0 = start_V[s]
        a1 = start_V[s + 1]
        if pause_V[s] > 0.0:  # 8.: the host is away; copies go on
            t += pause_V[s]
            host += pause_V[s]
        tr = t + non_expert_V[s]
        defer = defer_V[s]
        check = host if defer and host_set else tr  # hits: copies complete by then
        gpu = 0.0
        cpu = 0.0
        entries = 0
        misses = 0
        n_cand = 0  # on_miss="split": this step's misses whose copy is in flight (late ones first)
        for a in range(a0, a1):
            k = key_A[a]
            m = uses_A[a]
            held_k = resident_G[k]
            slot_A[a] = held_k
            seen_G[k] = s
            uses_G[k] = m
            if n_pending > 0 and pending_G[k] >= 0:  # a prefetched key accessed while it holds the slot
                c = pending_G[k]
                copy_used_C[c] = True  # used (timely if its copy is complete: ready_G[k] <= check)
                copy_use_C[c] = check
                pending_G[k] = -1
                n_pending -= 1
                n_used += 1
            if held_k and ready_G[k] <= check:
                hit_A[a] = True
                gpu += gpu_us_M[m]
                entries += m
                gpu_step_G[k] = s
            else:
                hit_A[a] = False
                cpu += cpu_us_M[m]
                misses += 1
                cpu_fallback_sel += m
                if split and held_k:  # late: its copy is still in flight
                    cand_key_J[n_cand] = k
                    n_cand += 1
        cpu_misses = cpu  # the misses' CPU cost, no call cost
        # when the step's visit runs (its evictions, its copies enqueued): at its routing, or (7.) after
        # its CPU half, which is the next step's host point
        visit_t = tr
        if defer and misses > 0:
            visit_t = tr + cpu_misses + (cpu_call_us + cpu_excess_V[s] if fused else 0.0)
        # the hits' GPU work ends here: the eviction's busy-slot test (with wait, the copies' below)
        gpu_end = tr + (kernel_us_X[kernel_off_V[s] + entries] if fused else gpu)
        n_admit, n_evict, held = apply_step(
            state, key_A[a0:a1], uses_A[a0:a1], slot_A[a0:a1], a0, clock_V[s], request_V[s], resident_G,
            held, capacity, admit_buf, evict_buf,
        )  # fmt: skip
        busy_slots = 0  # freed by this step but used by its GPU work: safe at gpu_end
        for j in range(n_evict):
            k = evict_buf[j]
            if ready_G[k] > visit_t:  # still loading: the copy is wasted
                copy_wasted_C[copy_of_G[k]] = True
            if n_pending > 0 and pending_G[k] >= 0:  # a pending prefetch evicted unused
                pending_G[k] = -1
                n_pending -= 1
            if gpu_step_G[k] == s and gpu_end > tr:
                busy_slots += 1
            else:
                safe_slots += 1
        wait_us = 0.0
        if wait:  # 5.: the step waits for its copies into safe slots (the first ones admitted)
            free = engine_free
            n_wait = min(n_admit, safe_slots)
            for j in range(n_wait):
                k = admit_buf[j]
                free = max(tr, free) + copy_us
                if seen_G[k] == s:  # this step's miss, run on the device once its copy landed
                    m = uses_G[k]
                    cpu -= cpu_us_M[m]
                    gpu += gpu_us_M[m]
                    entries += m
                    misses -= 1
            if n_wait > 0:
                wait_us = free - tr
        if fused:
            gpu = kernel_us_X[kernel_off_V[s] + entries]
            if misses > 0:
                cpu += cpu_call_us + cpu_excess_V[s]
        if wait:
            gpu_end = tr + wait_us + gpu
        if split:  # late candidates evicted by this step are no longer in flight for it
            kept = 0
            for j in range(n_cand):
                k = cand_key_J[j]
                if resident_G[k]:
                    cand_key_J[kept] = k
                    cand_ready_J[kept] = ready_G[k]
                    kept += 1
            n_cand = kept
        n_pf = 0
        host_set = defer
        for j in range(n_admit):
            k = admit_buf[j]
            # 7.: a deferred visit's copies reach the engine one enqueue (copy_host_us) after another
            start = max(visit_t + (j + 1) * copy_host_us if defer else visit_t, engine_free)
            if safe_slots > 0:
                safe_slots -= 1
                if split and seen_G[k] == s:  # a miss of this step into a safe slot: a candidate
                    cand_key_J[n_cand] = k
                    cand_ready_J[n_cand] = start + copy_us
                    n_cand += 1
            else:
                busy_slots -= 1
                start = max(start, gpu_end)
            ready = start + copy_us
            engine_free = ready
            ready_G[k] = ready
            if n_copies == cap_C:
                return -1, 0, 0, 0
            copy_key_C[n_copies] = k
            copy_step_C[n_copies] = s
            copy_start_C[n_copies] = start
            copy_ready_C[n_copies] = ready
            copy_wasted_C[n_copies] = False
            prefetch = seen_G[k] != s  # not accessed by this step
            copy_prefetch_C[n_copies] = prefetch
            copy_used_C[n_copies] = False
            copy_use_C[n_copies] = np.nan
            if prefetch:
                pending_G[k] = n_copies
                n_pf += 1
            copy_of_G[k] = n_copies
            n_copies += 1
        safe_slots += busy_slots  # safe by the next step: it starts after this step's GPU work
        if defer:  # 7.: the next step's publication, after the last enqueue and the rest of the host point
            host = visit_t + n_admit * copy_host_us + _lag_at(publish_lag_Q, s)
        split_host_us = 0.0
        if split and n_cand > 0:
            for j in range(1, n_cand):  # in landing order (insertion sort: a handful of candidates)
                r, k = cand_ready_J[j], cand_key_J[j]
                i = j - 1
                while i >= 0 and cand_ready_J[i] > r:
                    cand_ready_J[i + 1], cand_key_J[i + 1] = cand_ready_J[i], cand_key_J[i]
                    i -= 1
                cand_ready_J[i + 1], cand_key_J[i + 1] = r, k
            cand_cpu = 0.0
            waited_entries = 0
            for j in range(n_cand):
                m = uses_G[cand_key_J[j]]
                cand_cpu_J[j] = cpu_us_M[m]
                cand_cpu += cpu_us_M[m]
                cand_ready_J[j] -= tr
                waited_entries += m
                gpu_wait_W[j + 1] = (
                    kernel_us_X[kernel_off_V[s] + waited_entries] if fused else gpu_wait_W[j] + gpu_us_M[m]
                )
            w = split_waits(
                cand_ready_J, cand_cpu_J, gpu_wait_W, n_cand, misses - n_cand, cpu_misses - cand_cpu,
                cpu_call_us if fused else 0.0, gpu, serial, split_wait_us,
            )  # fmt: skip
            split_host_us = split_decide_us
            if w > 0:
                split_host_us += split_wait_us
                cpu = cpu_misses
                for j in range(w):
                    cpu -= cand_cpu_J[j]
                misses -= w
                if fused and misses > 0:
                    cpu += cpu_call_us + cpu_excess_V[s]
                gpu = max(gpu, cand_ready_J[w - 1] + gpu_wait_W[w])
        step_us = (
            non_expert_V[s] + wait_us + split_host_us + (gpu + cpu if serial else max(gpu, cpu))
            + copy_host_us * n_admit
        )  # fmt: skip
        n_prefetch += n_pf
        n_pending += n_pf
        admits_V[s] = n_admit
        evicts_V[s] = n_evict
        prefetch_V[s] = n_pf
        step_us_V[s] = step_us
        route_us_V[s] = check
        t += step_us
    return n_copies, cpu_fallback_sel, n_prefetch, n_used


@nb.njit(cache=True, nogil=True)
def _next_visit(
    layer_V, num_layers, num_experts, key_C, step_C, ready_C, route_us_V, has_next_C, ready_next_C
):
    """Per copy: is the key's layer visited after the copy's step, and was the copy complete by the
    routing time of that next visit. One backward pass over steps and copies (copies are in step order)."""
    next_L = np.full(num_layers, -1, np.int64)  # next step of each layer after the current position
    c = key_C.shape[0] - 1
    for s in range(layer_V.shape[0] - 1, -1, -1):
        while c >= 0 and step_C[c] == s:
            nxt = next_L[key_C[c] // num_experts]
            if nxt >= 0:
                has_next_C[c] = True
                ready_next_C[c] = ready_C[c] <= route_us_V[nxt]
            c -= 1
        next_L[layer_V[s]] = s


def replay_timed(
    trace: TraceArrays, policy: Policy, capacity: int, cost: CostModel, *, on_miss: str = "cpu"
) -> TimedResult:
    """Replay `trace` through `policy` with `capacity` GPU slots on the timeline of `cost`; `on_miss`
    the runtime's setting: "cpu", "wait" (a step waits for its own admissions' copies, module
    docstring 5.) or "split" (6.)."""
    if on_miss not in ON_MISS_CODES:
        raise MoecacheError(f"timed replay: on_miss={on_miss!r}: expected one of {list(ON_MISS_CODES)}")
    check_capacity(trace, capacity)
    cost.check_trace(trace)
    if policy.cost is None:
        policy.bind_cost(cost)
    state = policy.init_state(trace, int(capacity))
    resident_G = initial_resident_mask(policy, state, trace, capacity)
    s, a = trace.num_steps, trace.num_accesses
    # Every entry is written by the (last, complete) run of the kernel: no need to zero them.
    hit_A = np.empty(a, np.bool_)
    slot_A = np.empty(a, np.bool_)
    admits_V = np.empty(s, np.int32)
    evicts_V = np.empty(s, np.int32)
    step_us_V = np.empty(s, np.float64)
    route_us_V = np.empty(s, np.float64)
    prefetch_V = np.empty(s, np.int32)
    kernel_off_V, kernel_us_X = cost.kernel_tables(trace)
    cpu_us_M = cost.cpu_step_table() if cost.runtime is not None else cost.cpu_table()
    cap_C = a + 16  # demand policies admit at most one copy per miss; others may retry longer
    while True:
        key_C, step_C = np.empty(cap_C, np.int32), np.empty(cap_C, np.int64)
        k = trace.num_keys
        scratch = (
            *(np.empty(k, np.int32), np.empty(k, np.int32), np.zeros(k)),
            *(np.full(k, -1, np.int64) for _ in range(4)),  # copy_of_G, gpu_step_G, seen_G, pending_G
            np.zeros(k, np.int64),  # uses_G
            np.empty(k, np.int64),
            np.empty(k),
            np.empty(k),
            np.zeros(k + 1),  # split's candidates
        )
        start_C, ready_C, wasted_C = np.empty(cap_C), np.empty(cap_C), np.empty(cap_C, np.bool_)
        prefetch_C, used_C, use_C = np.empty(cap_C, np.bool_), np.empty(cap_C, np.bool_), np.empty(cap_C)
        try:
            n_copies, fallback_sel, prefetches, used = bound(_replay_timed, type(policy))(
                policy.named_state(state), trace.key_A, trace.uses_A, trace.start_V, trace.clock_V,
                trace.request_V, resident_G, int(capacity), cpu_us_M, cost.gpu_table(),
                cost.non_expert_V(trace), float(cost.copy_us()), kernel_off_V, kernel_us_X,
                cost.cpu_call_us(), cost.cpu_excess_V(trace), cost.serial, ON_MISS_CODES[on_miss],
                cost.defer_V(trace, on_miss), float(cost.copy_host_us()), cost.publish_lag_Q(),
                cost.pause_V(trace), *cost.split_host_us(),
                hit_A, slot_A, admits_V, evicts_V, step_us_V, route_us_V, prefetch_V,
                key_C, step_C, start_C, ready_C, wasted_C, prefetch_C, used_C, use_C, *scratch,
            )  # fmt: skip
        except ValueError as exc:
            raise MoecacheError(f"policy {policy.label()} at capacity {capacity}: {exc}") from exc
        if n_copies >= 0:
            break
        cap_C *= 4
        state = policy.init_state(trace, int(capacity))
        resident_G = initial_resident_mask(policy, state, trace, capacity)
    # Trim; copy (to free the long buffers) only when most of them is unused.
    trim = (lambda x: x[:n_copies].copy()) if 2 * n_copies < cap_C else (lambda x: x[:n_copies])
    key_C, step_C, start_C, ready_C, wasted_C, prefetch_C, used_C, use_C = map(
        trim, (key_C, step_C, start_C, ready_C, wasted_C, prefetch_C, used_C, use_C)
    )
    has_next, ready_next = np.zeros(n_copies, np.bool_), np.zeros(n_copies, np.bool_)
    _next_visit(
        trace.layer_V,
        trace.num_layers,
        trace.num_experts,
        key_C,
        step_C,
        ready_C,
        route_us_V,
        has_next,
        ready_next,
    )
    fwd_V, first_F = forward_index(trace)
    forward_us_F = np.bincount(fwd_V, step_us_V, minlength=len(first_F))
    return TimedResult(
        policy=policy.label(),
        capacity=int(capacity),
        hit_A=hit_A,
        admits_V=admits_V,
        evicts_V=evicts_V,
        slot_A=slot_A,
        step_us_V=step_us_V,
        route_us_V=route_us_V,
        forward_us_F=forward_us_F,
        first_F=first_F,
        copy_key_C=key_C,
        copy_step_C=step_C,
        copy_start_us_C=start_C,
        copy_ready_us_C=ready_C,
        copy_wasted_C=wasted_C,
        copy_ready_next_C=ready_next,
        copy_has_next_C=has_next,
        copy_prefetch_C=prefetch_C,
        copy_used_C=used_C,
        copy_use_us_C=use_C,
        cpu_fallbacks=a - int(np.count_nonzero(hit_A)),
        cpu_fallback_selections=int(fallback_sel),
        cost=cost,
        prefetches=int(prefetches),
        prefetches_used=int(used),
        prefetch_V=prefetch_V,
    )
