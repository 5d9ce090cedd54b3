"""The fitting step of `moecache calibrate`: raw measurements in, the cost profile's derived fields out.

`moecache.calibration` measures (every timing through `calibration.time_calls`); the functions here only
compute, from what it measured, the fields the profile derives (docs/artifacts.md "The cost profile"):

- `non_expert_section`: `runtime.non_expert`'s per-layer and per-token figures from the step timings;
- `fit_non_expert_fast`: step=fast's non-expert time, the all-resident fast loop's steps less the expert
  path the simulator adds back for them (`expert_path_us`, `less_expert_path`);
- `fit_cpu_path_fast`: step=fast's CPU-path rows, the fast loop's own one-token calls per entry count and
  the isolated rows of more tokens scaled by `prefill_scale`;
- `cpu_step_excess`: step=fast's `runtime.cpu_step_excess`, the all-CPU run less what the simulator
  prices of it (`priced_all_cpu_us`, through the simulator's step formula).

Legend: L MoE layers, E experts, K top-k, N tokens of the forced routing, V layer steps.
"""

from __future__ import annotations

import numpy as np

from moecache import calibration as cal
from moecache.cost_profile import CostProfile, RuntimeCosts, cpu_path_fit
from moecache.errors import MoecacheError

CPU_LOG_MIN_CALLS = 5  # in-loop CPU-path calls of one entry count needed for its row (fit_cpu_path_fast)
PREFILL_SCALE_BOUNDS = (1.0 / 16, 16.0)  # prefill_scale's search interval: outside it, a wrong model
PREFILL_SCALE_ITERATIONS = 40  # bisection steps (geometric): the interval shrinks 2^40-fold in log


def timing_row(keys: dict, timing: cal.Timing) -> dict:
    """A profile row: `keys` and the timing's median, p10, p90 and repeats."""
    return {**keys, **timing.as_dict()}


def non_expert_section(layers: int, lengths: list[int], timed: list, decode_steps: int) -> dict:
    """The profile's `non_expert` from (prefill, decode) timings per prompt length (`lengths`, sorted)."""
    prefill, decode = timed[0]  # the shortest prompt's prefill, and the decode steps after it
    return {
        "moe_layers": layers,
        "prompt_tokens": lengths[0],
        "decode_steps": decode_steps,
        "prefill": prefill.as_dict(),
        "decode": decode.as_dict(),
        "decode_us_per_layer": decode.median_us / layers,
        "prefill_us_per_token_per_layer": prefill.median_us / (lengths[0] * layers),
        "prefill_points": [
            {"prompt_tokens": t, **pre.as_dict()} for t, (pre, _) in zip(lengths, timed, strict=True)
        ],
    }


def expert_path_us(costs: RuntimeCosts, tokens: int) -> float:
    """What the simulator adds to the non-expert time of a layer step of `tokens` tokens with every
    entry resident (moecache/sim/cost_model.py): the layer step's host cost (`visit_us`: for step=fast the
    manager's visit + commit, cost_profile._host_rows) and the operator at N = tokens x top_k resident
    entries (timed as CUDA graph replays for step=fast, as the fast loop runs it); no CPU half."""
    return float(costs.visit_us(tokens)) + float(costs.kernel_row_us(tokens)[tokens * costs.top_k])


def less_expert_path(timing: cal.Timing, layers: int, per_layer_us: float, what: str) -> cal.Timing:
    """`timing` of a whole step of `layers` MoE layers less `layers` x `per_layer_us` (every statistic
    shifted); a median left non-positive is refused."""
    minus = layers * per_layer_us
    if not timing.median_us - minus > 0:
        raise MoecacheError(
            f"calibrate: cost.runtime.step=fast: the all-resident {what} took {timing.median_us / layers:.1f}"
            f" us per MoE layer, not more than the {per_layer_us:.1f} us of expert path the simulator adds"
            " back for it (runtime.visit_hits + runtime.slot_moe): the non-expert time would be"
            f" {(timing.median_us - minus) / layers:.1f} us; re-run on a quiet machine, or time the expert"
            " path at this step's tokens (cost.runtime.kernel_tokens, cost.runtime.visit_tokens)"
        )
    return cal.Timing(timing.median_us - minus, timing.p10_us - minus, timing.p90_us - minus, timing.repeats)


def fit_non_expert_fast(
    section: dict, layers: int, lengths: list[int], measured: list, decode_steps: int
) -> dict:
    """step=fast's `non_expert`: the all-resident fast loop's (prefill, decode) timings per prompt length
    (`measured`, `lengths` sorted) less what the simulator adds back to every layer step of such a run
    (`expert_path_us`, from the runtime `section`'s own rows): the all-resident fast run is then priced
    as it was timed. `measured` keeps the loop's own times, `added_back_us_per_layer` what was taken off."""
    costs = RuntimeCosts.from_section(section, "calibrate")
    back = {t: expert_path_us(costs, t) for t in {1, *lengths}}  # per layer step of t tokens
    decode = less_expert_path(measured[0][1], layers, back[1], "decode step")  # after the shortest prompt
    timed = [
        (less_expert_path(pre, layers, back[t], f"{t}-token prefill"), decode)
        for t, (pre, _) in zip(lengths, measured, strict=True)
    ]
    ne = non_expert_section(layers, lengths, timed, decode_steps)
    ne["measured"] = {
        "decode": measured[0][1].as_dict(),
        "prefill_points": [
            {"prompt_tokens": t, **pre.as_dict()} for t, (pre, _) in zip(lengths, measured, strict=True)
        ],
    }
    ne["added_back_us_per_layer"] = {
        "decode": back[1],
        "prefill_points": [{"prompt_tokens": t, "us": back[t]} for t in lengths],
    }
    return ne


def fit_cpu_path_fast(
    log: list[tuple[int, int, int, tuple]], multi_rows: list[dict], prompt_tokens: int, runs: list[dict]
) -> tuple[list[dict], dict]:
    """step=fast's (cpu_path rows, cpu_path_prefill) from the fast loop's own CPU-path calls (`log`:
    (tokens, entries, ns, each expert's token count) per call, over the all-CPU and half-resident `runs`):
    - the one-token rows are those calls' medians per entry count (at least CPU_LOG_MIN_CALLS calls);
      they replace the isolated loop's M=1 rows, which time the calls back to back (on the H200 host,
      1,349 us for 6 experts against 1,698 in the all_cpu run: docs/benchmarks.md);
    - the isolated loop's rows of more tokens (`multi_rows`) are scaled by one factor, the one that
      prices the loops' prefill calls (several tokens per expert) right in the median (`prefill_scale`)."""
    by_entries: dict[int, list[float]] = {}
    for tokens, entries, ns, _ in log:
        if tokens == 1:
            by_entries.setdefault(entries, []).append(ns / 1e3)
    one_rows = [
        timing_row({"tokens_per_expert": 1, "experts": u, "timed": "fast_loop"}, cal.summarize(us))
        for u, us in sorted(by_entries.items())
        if len(us) >= CPU_LOG_MIN_CALLS
    ]
    if len(one_rows) < 2:
        raise MoecacheError(
            f"calibrate: cost.runtime.step=fast: the fast loop's CPU-path calls gave {len(one_rows)} entry counts"
            f" with {CPU_LOG_MIN_CALLS}+ calls ({ {u: len(v) for u, v in by_entries.items()} }); raise"
            " cost.runtime.cpu_path_decode_steps"
        )
    prefill = [(ns / 1e3, uses) for tokens, _, ns, uses in log if tokens > 1 and max(uses) > 1]
    scale = prefill_scale(multi_rows, one_rows, prefill)
    summary = {
        "calls": len(prefill),
        "scale": scale,
        "prompt_tokens": prompt_tokens,
        "timed": "fast_loop",
        "runs": runs,
    }
    if scale is None:
        return one_rows + multi_rows, summary
    return one_rows + [scaled_row(r, scale) for r in multi_rows], summary


def scaled_row(row: dict, scale: float) -> dict:
    """A CPU-path row with its times multiplied by `scale` (recorded as `scaled_to_fast_loop`)."""
    times = {k: row[k] * scale for k in ("median_us", "p10_us", "p90_us")}
    return row | times | {"scaled_to_fast_loop": scale}


def prefill_scale(
    multi_rows: list[dict], one_rows: list[dict], calls: list[tuple[float, tuple]]
) -> float | None:
    """The factor f on the rows of more than one token per expert under which the CPU-path model
    (`cost_profile.cpu_path_fit`: the call's cost + each expert's at its token count) prices the fast
    loop's prefill calls `calls` ([(us, each expert's tokens)]) right in the median: the median of
    (model - measured) / measured is 0 (bisection within PREFILL_SCALE_BOUNDS; it falls as f grows).
    None without such calls or rows, or when no f within the bounds does it."""
    if not calls or not multi_rows:
        return None

    def median_error(f: float) -> float:
        curve, call_us = cpu_path_fit(one_rows + [scaled_row(r, f) for r in multi_rows], "calibrate")
        errors = [
            (call_us + float(np.sum(curve(np.array(uses, np.float64)))) - us) / us for us, uses in calls
        ]
        return float(np.median(errors))

    lo, hi = PREFILL_SCALE_BOUNDS
    if median_error(lo) > 0 or median_error(hi) < 0:
        return None
    for _ in range(PREFILL_SCALE_ITERATIONS):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if median_error(mid) < 0 else (lo, mid)
    return (lo * hi) ** 0.5


def cpu_step_excess(section: dict, base: dict, rs: dict) -> dict:
    """step=fast's `runtime.cpu_step_excess`: what a layer step with CPU work costs in the fast loop
    beyond what the model prices, from the all-CPU run (the first of `section["cpu_path_prefill"]["runs"]`):
    per MoE layer, its decode step and its prefill less the same as the simulator prices them with the
    profile measured so far (`base` with this `section`: `priced_all_cpu_us`). On the H200 host the fast
    loop's host points ran 4-13x slower with the CPU path between them than the profile's visit rows
    price them (the manager's visit 43-78 us per visit in those runs against 6-10: docs/benchmarks.md).
    `raw_us` / `prefill_raw_us` keep the remainders, `decode_us` / `prefill_us` (what the simulator adds)
    are them clamped at 0: with them, the all-CPU run is priced as it was timed."""
    run = next(r for r in section["cpu_path_prefill"]["runs"] if r["slots"] == 0)
    layers = int(section["non_expert"]["moe_layers"])
    prompt = int(section["cpu_path_prefill"]["prompt_tokens"])
    prefill_us, decode_us = priced_all_cpu_us({**base, "runtime": section}, prompt, rs)
    raw = (run["decode"]["median_us"] - decode_us) / layers
    raw_prefill = (run["prefill"]["median_us"] - prefill_us) / layers
    return {
        "decode_us": max(raw, 0.0), "raw_us": raw, "prefill_us": max(raw_prefill, 0.0),
        "prefill_raw_us": raw_prefill, "timed": "fast_loop", "run_slots": 0,
    }  # fmt: skip


def priced_all_cpu_us(profile: dict, prompt: int, rs: dict) -> tuple[float, float]:
    """The all-CPU run as the simulator prices it with `profile`: its forced routing
    (`calibration.random_routing`, as `time_fast_steps` drew it), the prompt as one prefill step per
    layer and each later token a decode step, every access a miss, through the instant replay's step
    formula: (the prefill's us, a decode token's us: the median over the generation's tokens). `rs`:
    the profile's cost.runtime settings (the in-loop generations' length)."""
    from moecache.sim.cost_model import CostModel, instant_step_us
    from moecache.sim.shape import ModelShape
    from moecache.sim.trace_arrays import from_table
    from moecache.trace.esft_import import EsftArrays, esft_to_table
    from moecache.trace.schema import TraceMeta

    m = profile["runtime"]["model"]
    L, E, K = int(m["num_layers"]), int(m["num_experts"]), int(m["top_k"])
    per_run = cal.decode_steps_per_generation(int(rs["cpu_path_decode_steps"]), cal.in_loop_repeats(rs))
    shape = ModelShape(L, E, K, int(m["expert_bytes"]))
    ids_LNK, w_LNK = cal.random_routing(shape, prompt + per_run)  # time_fast_steps' routing (seed 0)
    meta = TraceMeta(L, E, K, int(m["expert_bytes"]), model="calibrate", source="random forcing")
    costs = CostProfile.from_dict(profile, "calibrate's profile so far")

    def step_us(tokens: slice, tokens_per_step: int) -> np.ndarray:
        arrays = EsftArrays(
            expert_ids=np.ascontiguousarray(ids_LNK[:, tokens].transpose(1, 0, 2)),
            gate_weights=np.ascontiguousarray(w_LNK[:, tokens].transpose(1, 0, 2)),
            seq_offsets=np.array([0, ids_LNK[:, tokens].shape[1]], np.int64),
        )
        table = esft_to_table(
            arrays, name="calibrate", run_id="calibrate", tokens_per_step=tokens_per_step, meta=meta
        )
        trace = from_table(table, meta)
        return instant_step_us(
            trace, np.zeros(trace.num_accesses, np.bool_), CostModel.for_trace(costs, trace)
        )

    prefill_V = step_us(slice(0, prompt), 0)  # one step per layer
    decode_V = step_us(slice(prompt, prompt + per_run), 1)  # per token, a step per layer (layer-major rows)
    return float(prefill_V.sum()), float(np.median(decode_V.reshape(-1, L).sum(axis=1)))
