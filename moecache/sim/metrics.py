"""Metrics of one replay: the sweep row (`summarize`), per layer and per request. The counts come
from one compiled pass per grouping (aggregate.py), the times from the forward steps' times.

Definitions (docs/simulator.md, "Metrics"):
- hit_rate: hits / accesses (an access is one distinct expert of a layer step); token_hit_rate: the
  same weighted by uses (token selections). In timed mode a hit needs its copy complete.
- transfers = admissions (one copy per admission; initial residents of static policies and warm
  Belady are free), h2d_bytes = transfers * the trace's expert_bytes.
- cpu_fallbacks: accesses executed on the CPU (misses, in timed mode also keys still loading);
  cpu_fallback_selections: the same weighted by uses.
- ready_fraction (timed only): copies complete by the next visit of their key's layer / copies whose
  layer is visited again; wasted_copies (timed only): copies whose key was evicted before they completed.
- prefetches: admissions of keys the admitting step did not access. A prefetch is used when its key
  is accessed while still holding that slot, unused when the key is evicted first or the trace ends.
  prefetch_accuracy = used / prefetches (null without prefetches); prefetch_wasted_bytes = unused
  prefetches * expert_bytes. Timed only: prefetch_timely = used prefetches whose copy was complete at
  the first use / used prefetches; prefetch_lead_us_median = median over used prefetches of (routing
  time of the first use - routing time of the enqueuing step). Demand policies: 0 prefetches, nulls.
- est_*: from the layer-step times. Timed mode: the timeline's. Instant mode with a CostModel: the same
  layer formula with free copies (non_expert + max(GPU time of hits, CPU time of misses)); without a
  CostModel: null. Per token = time of the forward steps / their tokens; decode and prefill apart.
  Non-expert time counts only if the CostModel sets it (`cost_notes` says when it does not).
"""

from __future__ import annotations

import numpy as np

from moecache.sim.aggregate import group_sums
from moecache.sim.cost_model import CostModel, forward_index, forward_tokens, instant_step_us
from moecache.sim.replay import ReplayResult
from moecache.sim.timed import TimedResult
from moecache.sim.trace_arrays import DECODE, PREFILL, TraceArrays


def _ratio(num, den) -> float | None:
    return float(num) / float(den) if den else None


def _per_token(us: float, tokens: int) -> tuple[float | None, float | None]:
    """(ms per token, tokens per second); None where undefined (no tokens, or zero time)."""
    if not tokens:
        return None, None
    return us / 1e3 / tokens, (tokens / (us / 1e6) if us > 0 else None)


def _forward_us(
    trace: TraceArrays, result: ReplayResult, cost: CostModel | None
) -> tuple[np.ndarray | None, np.ndarray]:
    """(time of every forward step or None, first layer step of every forward step). An instant
    result keeps the last answer (summarize, per_request and per_block all ask for it)."""
    if isinstance(result, TimedResult):
        return result.forward_us_F, result.first_F
    cached = result.__dict__.get("_forward_us")
    if cached is not None and cached[0] is trace and cached[1] is cost:
        return cached[2], cached[3]
    fwd_V, first_F = forward_index(trace)
    us_F = None
    if cost is not None:
        step_us_V = instant_step_us(trace, result.hit_A, cost)
        us_F = np.bincount(fwd_V, step_us_V, minlength=len(first_F))
    result.__dict__["_forward_us"] = (trace, cost, us_F, first_F)  # references keep the `is` test valid
    return us_F, first_F


def _cost_of(result: ReplayResult, cost: CostModel | None) -> CostModel | None:
    return result.cost if isinstance(result, TimedResult) and result.cost is not None else cost


TIME_COLUMNS = (
    "est_total_ms",
    "est_ms_per_token",
    "est_tokens_per_s",
    "est_ms_per_token_decode",
    "est_tokens_per_s_decode",
    "est_ms_prefill_per_token",
    "est_prefill_tokens_per_s",
)


def _time_table(
    trace: TraceArrays, us_F: np.ndarray | None, first_F: np.ndarray, by_request: bool
) -> list[dict]:
    """The est_* columns for the whole trace (one dict) or per request (one dict each), from the
    forward steps' times (None: no estimate)."""
    n = len(trace.request_ids) if by_request else 1
    if us_F is None:
        return [dict.fromkeys(TIME_COLUMNS) for _ in range(n)]
    tokens_F = forward_tokens(trace, first_F).astype(np.float64)
    phase_F = trace.phase_V[first_F]
    group_F = trace.request_V[first_F] if by_request else np.zeros(len(first_F), np.int64)
    sums = {}
    for part, sel in (("all", None), ("decode", phase_F == DECODE), ("prefill", phase_F == PREFILL)):
        w_us = us_F if sel is None else us_F * sel
        w_tok = tokens_F if sel is None else tokens_F * sel
        sums[part] = (np.bincount(group_F, w_us, minlength=n), np.bincount(group_F, w_tok, minlength=n))
    rows = []
    for i in range(n):
        ms, tps = _per_token(float(sums["all"][0][i]), int(sums["all"][1][i]))
        ms_d, tps_d = _per_token(float(sums["decode"][0][i]), int(sums["decode"][1][i]))
        ms_p, tps_p = _per_token(float(sums["prefill"][0][i]), int(sums["prefill"][1][i]))
        rows.append(
            dict(
                zip(
                    TIME_COLUMNS,
                    (float(sums["all"][0][i]) / 1e3, ms, tps, ms_d, tps_d, ms_p, tps_p),
                    strict=True,
                )
            )
        )
    return rows


def _prefetch_columns(trace: TraceArrays, result: ReplayResult) -> dict:
    """The prefetch columns of one sweep row (module docstring)."""
    n, used = result.prefetches, result.prefetches_used
    timely = lead = None
    if isinstance(result, TimedResult) and used:
        timely = _ratio(np.count_nonzero(result.copy_timely_C), used)
        lead = float(np.median(result.copy_lead_us_C[result.copy_used_C]))
    return {
        "prefetches": n,
        "prefetch_accuracy": _ratio(used, n),
        "prefetch_wasted_bytes": (n - used) * trace.expert_bytes,
        "prefetch_timely": timely,
        "prefetch_lead_us_median": lead,
    }


def summarize(trace: TraceArrays, result: ReplayResult, cost: CostModel | None = None) -> dict:
    """The metric columns of one sweep row (the caller adds trace, workload, policy, params, capacity,
    capacity_fraction and the cost scales). Timed results carry their own CostModel; for an instant
    result, `cost` (if any) gives the est_* columns with free copies."""
    hit_A, uses_A = result.hit_A, trace.uses_A
    accesses = trace.num_accesses
    hits = int(np.count_nonzero(hit_A))
    selections = int(uses_A.sum(dtype=np.int64))
    # every use is 1 when selections == accesses (decode-only traces): then hit selections = hits
    hit_selections = hits if selections == accesses else int(uses_A[hit_A].sum(dtype=np.int64))
    admissions = int(result.admits_V.sum(dtype=np.int64))
    timed = isinstance(result, TimedResult)
    cost = _cost_of(result, cost)
    row = {
        "accesses": accesses,
        "selections": selections,
        "tokens": trace.num_tokens,
        "hit_rate": _ratio(hits, accesses),
        "token_hit_rate": _ratio(hit_selections, selections),
        "h2d_bytes": admissions * trace.expert_bytes,
        "transfers": admissions,
        "admissions": admissions,
        "evictions": int(result.evicts_V.sum(dtype=np.int64)),
        "cpu_fallbacks": accesses - hits,
        "cpu_fallback_selections": selections - hit_selections,
        "slot_hit_rate": _ratio(np.count_nonzero(result.slot_A), accesses) if timed else None,
        "ready_fraction": (
            _ratio(result.copies_ready_next_visit, result.copies_with_next_visit) if timed else None
        ),
        "wasted_copies": result.wasted_copies if timed else None,
        **_prefetch_columns(trace, result),
    }
    row.update(_time_table(trace, *_forward_us(trace, result, cost), by_request=False)[0])
    row["cost_notes"] = "; ".join(cost.all_notes()) if cost is not None else None
    return row


def per_layer(trace: TraceArrays, result: ReplayResult) -> dict[str, np.ndarray]:
    """Arrays indexed by layer_id: accesses, hits, hit_rate, selections, token_hit_rate, admissions,
    evictions; timed results add slot_rate, ready_fraction (copies by their key's layer) and est_ms."""
    n = trace.num_layers
    timed = isinstance(result, TimedResult)
    sums = group_sums(trace, result, trace.layer_V, n, result.step_us_V if timed else None)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {
            "layer": np.arange(n),
            "accesses": sums.accesses,
            "hits": sums.hits,
            "hit_rate": sums.hits / sums.accesses,
            "selections": sums.selections,
            "token_hit_rate": sums.hit_selections / sums.selections,
            "admissions": sums.admissions,
            "evictions": sums.evictions,
        }
        if timed:
            out["slot_rate"] = sums.slots / sums.accesses
            layer_C = result.copy_key_C // trace.num_experts
            ready = np.bincount(layer_C, result.copy_ready_next_C, minlength=n)
            out["ready_fraction"] = ready / np.bincount(layer_C, result.copy_has_next_C, minlength=n)
            out["est_ms"] = sums.step_us / 1e3
    return out


def per_request(trace: TraceArrays, result: ReplayResult, cost: CostModel | None = None) -> list[dict]:
    """One dict per request (trace order): request_id, tokens, accesses, hit rates, transfers,
    h2d_bytes, cpu_fallbacks, prefetches (admissions of keys the step did not access), ready_fraction
    (timed) and the est_* time columns."""
    r = len(trace.request_ids)
    sums = group_sums(trace, result, trace.request_V, r)
    accesses, hits, admits = sums.accesses, sums.hits, sums.admissions
    us_F, first_F = _forward_us(trace, result, _cost_of(result, cost))
    tokens = np.bincount(trace.request_V[first_F], forward_tokens(trace, first_F), minlength=r).astype(
        np.int64
    )
    timed = isinstance(result, TimedResult)
    if timed:
        req_C = trace.request_V[result.copy_step_C]
        ready_C = np.bincount(req_C, result.copy_ready_next_C, minlength=r)
        has_next_C = np.bincount(req_C, result.copy_has_next_C, minlength=r)
    times = _time_table(trace, us_F, first_F, by_request=True)
    prefetch_V = result.prefetch_V
    prefetches = (
        np.bincount(trace.request_V, prefetch_V, minlength=r).astype(np.int64)
        if prefetch_V is not None
        else np.zeros(r, np.int64)
    )
    rows = []
    for i, request_id in enumerate(trace.request_ids):
        row = {
            "request_id": request_id,
            "tokens": int(tokens[i]),
            "accesses": int(accesses[i]),
            "hit_rate": _ratio(hits[i], accesses[i]),
            "token_hit_rate": _ratio(sums.hit_selections[i], sums.selections[i]),
            "transfers": int(admits[i]),
            "admissions": int(admits[i]),
            "evictions": int(sums.evictions[i]),
            "h2d_bytes": int(admits[i]) * trace.expert_bytes,
            "cpu_fallbacks": int(accesses[i] - hits[i]),
            "prefetches": int(prefetches[i]),
            "ready_fraction": _ratio(ready_C[i], has_next_C[i]) if timed else None,
        }
        row.update(times[i])
        rows.append(row)
    return rows


def block_index(trace: TraceArrays, block_forward_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block_V, request_B, block_B): every layer step's block, and each block's request and index
    within its request. A block is `block_forward_steps` consecutive forward steps of one request
    (the last block of a request may be shorter); blocks are numbered in trace order."""
    if block_forward_steps < 1:
        raise ValueError(f"block_forward_steps={block_forward_steps}: must be at least 1")
    fwd_V, first_F = forward_index(trace)
    request_F = trace.request_V[first_F]
    new_request_F = np.ones(len(first_F), bool)
    new_request_F[1:] = request_F[1:] != request_F[:-1]
    start_F = np.maximum.accumulate(np.where(new_request_F, np.arange(len(first_F)), 0))
    within_F = (np.arange(len(first_F)) - start_F) // block_forward_steps  # block within the request
    new_block_F = new_request_F.copy()
    new_block_F[1:] |= within_F[1:] != within_F[:-1]
    block_F = np.cumsum(new_block_F) - 1
    return block_F[fwd_V], request_F[new_block_F], within_F[new_block_F]


def per_block(
    trace: TraceArrays, result: ReplayResult, block_forward_steps: int, cost: CostModel | None = None
) -> dict[str, np.ndarray]:
    """Arrays indexed by block (see block_index): request, block, tokens, accesses, hits, transfers,
    h2d_bytes and est_us (the forward steps' time; NaN without a time estimate). Summed over the
    blocks they give the trace's totals, which is what a bootstrap over requests or blocks resamples."""
    block_V, request_B, within_B = block_index(trace, block_forward_steps)
    n = len(request_B)
    sums = group_sums(trace, result, block_V, n)
    us_F, first_F = _forward_us(trace, result, _cost_of(result, cost))
    block_F = block_V[first_F]
    return {
        "request": request_B.astype(np.int64),
        "block": within_B.astype(np.int64),
        "tokens": np.bincount(block_F, forward_tokens(trace, first_F), minlength=n).astype(np.int64),
        "accesses": sums.accesses,
        "hits": sums.hits,
        "transfers": sums.admissions,
        "h2d_bytes": sums.admissions * trace.expert_bytes,
        "est_us": np.bincount(block_F, us_F, minlength=n) if us_F is not None else np.full(n, np.nan),
    }
