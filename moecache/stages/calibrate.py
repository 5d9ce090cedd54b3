"""`moecache calibrate`: measure this machine's expert, copy and runtime costs; write a cost-profile artifact.

Synthetic experts of the model's shape (see `resolve_shape`) are timed on the CPU (and on CUDA when the
run's device is a GPU), and host-to-device copies from pinned and pageable memory. Then (`cost.runtime`,
schema 2) what the runtime itself costs, through its own code paths (moecache/runtime/experts_module.py)
on a synthetic store of the model's shape and on the run's device (CUDA, else the CPU stand-in): the
slot-pool operator, the CPU path, the manager's visit, the copy engine, and the non-expert time of the
model itself (built or loaded like `moecache generate` does; without weights, e.g. an `architecture`-only
model config, that part is null and says why). The artifact id covers the cost settings, the shape, the
model config (when the runtime is measured) and the machine (CPU and GPU model, torch version, threads),
so a profile measured elsewhere never stands in for this machine's.

`cost_profile.json` (schema 2; `moecache.cost_profile.CostProfile` loads it, and schema 1, which lacks
`runtime`):
    schema_version  2
    shape           {hidden_size, moe_intermediate_size, params, expert_bytes (of `dtype`), source}
    dtype           the model's weight dtype (the headline and the one-expert copy use it)
    machine         {cpu_model, cpu_count, gpu_model, torch, cuda, threads, llc_bytes, gpu_l2_bytes, loadavg_1m,
                     host_loop: a fixed Python loop's timing (`calibration.time_host_loop`)}
    cpu             [{dtype, tokens_per_call, median_us, p10_us, p90_us, repeats, pool_experts, threads}]
    cuda            same rows, timed with CUDA events around one eager expert call (its kernel launches
                    included: what a per-expert loop pays), or null when the run had no GPU
    h2d             {pinned: [{bytes, median_us, p10_us, p90_us, repeats, gbps}], pageable: [...],
                     fit: {latency_us, gbps} (pinned), expert_bytes} or null when the run had no GPU
    settings        {repeats, warmup, tokens_per_call, dtypes, copy_sizes_bytes}
    runtime         null (cost.runtime.enabled=false) or, all times in microseconds, rows {.., median_us,
                    p10_us, p90_us, repeats}:
      model         {name, num_layers, num_experts, top_k, hidden_size, moe_intermediate_size, dtype,
                     expert_bytes}: the shape every runtime row was measured at
      execution     {path: the loop the non-expert time was measured in (cost.runtime.step: "transformers"
                     or "fast"), overlap: "serial" (the runtime's step runs the CPU half after the GPU
                     half: the stand-in; cost_model.py) or "parallel" (CUDA), device: "cuda" or "standin"}
      cpu_backend, cpu_threads   the CPU path's executor (CpuExperts) as offload builds it
      store_experts, slots       the synthetic store's experts and the slot pool's slots
      slot_moe      [{tokens, entries, ..}]: one `ExpertsRuntime._gpu_part` call (slot_moe on CUDA, CUDA
                    events; its torch reference on the stand-in, wall time) for `entries` resident entries
      host_timed    how slot_moe, cpu_path and layer_call were timed: "in_model" (the stand-in with the
                    model at hand: each call inside the model's forward at its MoE layers, as the runtime
                    runs it, in the cost.runtime.step loop; `calibration.time_in_model`) or "loop" (calls
                    back to back; CUDA, or no model)
      cpu_path      [{tokens_per_expert, experts, ..}]: one `ExpertsRuntime._cpu_part` call (gather,
                    CpuExperts.run, result back to x's device), wall time; with step=fast and a model,
                    the one-token rows (`timed: "fast_loop"`) are the fast loop's own CPU-path calls
                    (all-CPU and half-resident runs, `_cpu_path_fast`), and the rows of more tokens
                    are scaled (`scaled_to_fast_loop`) by the factor that prices those runs' prefill
                    calls right in the median; the call cost the simulator uses is the smallest M's
                    intercept (a decode step's call)
      cpu_path_prefill  {calls, scale (null: no prefill call or no multi-token row), prompt_tokens
                    (cost.runtime.cpu_path_prompt_tokens), timed: "fast_loop", runs: [{slots, prefill,
                    decode}] the two runs' own step timings} (step=fast with a model): that factor and
                    what it rests on
      visit         [{tokens, copies_per_visit, ..}]: one `CacheManager.visit` + `commit` (policy lru, a
                    quarter of E slots: most visits admit, and enqueue those copies)
      visit_hits    [{tokens, ..}]: the same with every expert resident (static_cold at E slots: no
                    admission); step=fast prices a layer step's host cost as this plus, per admission,
                    (visit - visit_hits) / copies_per_visit (cost_profile.RuntimeCosts.copy_host_us)
      layer_call    [{tokens, ..}]: one whole experts-module call (`ExpertsRuntime.run`) with its two halves
                    stubbed: the visit plus the module's own work (read-back, split, combine); the
                    simulator's per-layer-step host cost of step=transformers where present (else `visit`)
      copy_engine   {expert_bytes, single, batch: {copies, ..}, per_copy_us = batch median / copies}:
                    `TransferEngine.enqueue` from the pinned store to the ready event seen complete, or
                    null without CUDA
      split_host    {decide_us, wait_us, decisions, waits, policy, capacity, timed: "fast_loop"} (step=fast
                    with a model; else absent): on_miss="split"'s host time in the fast loop itself, the
                    offloaded model under lru at 25% with on_miss="split" weighing this profile's other
                    rows, decoding under random forced routing (`_split_host_fast`): per visit that
                    weighed candidates, the decision; per visit that waited, its wait row, the compute
                    stream's wait and the wait call's launch (null where no visit waited)
      cpu_step_excess  {decode_us, raw_us, prefill_us, prefill_raw_us, timed: "fast_loop", run_slots: 0}
                    (step=fast with a model): the all-CPU run's decode layer step, and its prefill per
                    layer, less what the simulator prices of them (`_cpu_step_excess`); the simulator
                    adds decode_us to a decode step with CPU work, prefill_us to such a prefill step
      non_expert    {moe_layers, prompt_tokens (the shortest of cost.runtime.prompt_tokens), decode_steps,
                    prefill, decode, decode_us_per_layer = decode median / moe_layers,
                    prefill_us_per_token_per_layer = prefill median / (prompt_tokens x moe_layers),
                    prefill_points: [{prompt_tokens, median_us, ..}] one per prompt length}, or null
                    with `non_expert_reason`. step=transformers: the model, its routed experts returning
                    zeros (after reading the routing back, as the runtime does), through `generate`.
                    step=fast: the model offloaded with every expert resident in moecache's fast decode
                    loop, as `moecache validate validate.loop=fast` runs it (random forced routing), less
                    per layer step what the simulator adds back for it (visit_hits, else visit, + slot_moe at
                    N = tokens x top_k; a non-positive result is refused); plus `measured` {decode,
                    prefill_points}: the loop's own times, and `added_back_us_per_layer` {decode,
                    prefill_points: [{prompt_tokens, us}]}: what was taken off
    measured_at     UTC time, ISO 8601
    measure_s       wall seconds the measurements took
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from moecache import calibration as cal
from moecache.artifacts import artifact_id, write_json_atomic
from moecache.config import to_container
from moecache.cost_profile import PROFILE_FILE, CostProfile, RuntimeCosts, cpu_path_fit
from moecache.cost_profile import SCHEMA_VERSION as PROFILE_SCHEMA
from moecache.env_info import cpu_model
from moecache.errors import MoecacheError
from moecache.stages.base import StageResult, prepare, reusable, store_for, torch_device

STAGE = "calibrate"
SCHEMA_VERSION = PROFILE_SCHEMA  # the artifact's schema is the profile's


# How the runtime's layer step combines its halves (moecache/runtime/experts_module.py,
# moecache/runtime/segments.py): on CUDA the CPU half's inputs are on the host before the GPU half is
# enqueued, so the CPU misses are computed while the resident experts run, in both decode loops and the
# fast loop's prefill ("parallel", moecache/sim/cost_model.py); on the CPU stand-in the operator is host
# work run first, then the CPU path ("serial").
def runtime_overlap(cuda: bool) -> str:
    """How the measured execution path combines a layer step's GPU and CPU halves (above)."""
    return "parallel" if cuda else "serial"


def _first_set(*candidates: tuple[str, object]) -> tuple[str, object] | None:
    for where, value in candidates:
        if value is not None:
            return where, value
    return None


def resolve_shape(cfg: DictConfig) -> tuple[cal.ExpertShape, str, str]:
    """(shape, weight dtype name, where the shape came from), without touching the model's weight path.

    cost.shape.* wins; else model.architecture.*; else model.build.overrides.* (the tiny test model).
    """
    want = cfg.cost.get("shape") or {}
    model = cfg.get("model") or {}
    arch = model.get("architecture") or {}
    overrides = (model.get("build") or {}).get("overrides") or {}
    dims, sources = {}, set()
    for key in ("hidden_size", "moe_intermediate_size"):
        found = _first_set(
            ("cost.shape", want.get(key)),
            ("model.architecture", arch.get(key)),
            ("model.build.overrides", overrides.get(key)),
        )
        if found is None:
            raise MoecacheError(
                f"calibrate: no expert shape: cost.shape.{key} is null and the model config has neither"
                f" architecture.{key} nor build.overrides.{key} (set cost.shape.{key}=N)"
            )
        sources.add(found[0])
        dims[key] = int(found[1])
    # model.dtype may be "auto" (the checkpoint's own), which needs the weights: fall back to cost.dtypes[0].
    model_dtype = model.get("dtype")
    dtype_found = _first_set(
        ("cost.shape", want.get("dtype")),
        ("model.architecture", arch.get("dtype")),
        ("model", model_dtype if model_dtype != "auto" else None),
    )
    dtype = str(dtype_found[1]) if dtype_found else str(cfg.cost.dtypes[0])
    try:
        cal.dtype_of(dtype)
    except ValueError as exc:
        where = dtype_found[0] + ".dtype" if dtype_found else "cost.dtypes[0]"
        raise MoecacheError(f"calibrate: {where}: {exc} (set cost.shape.dtype)") from exc
    return cal.ExpertShape(**dims), dtype, "+".join(sorted(sources))


def _settings(cfg: DictConfig) -> dict:
    settings = to_container(cfg.cost)
    settings.pop("shape", None)
    runtime = settings.get("runtime") or {}
    if runtime.get("enabled") and runtime.get("step") not in cal.STEP_FUNCTIONS:
        raise MoecacheError(
            f"calibrate: cost.runtime.step={runtime.get('step')!r}: expected one of {sorted(cal.STEP_FUNCTIONS)}"
        )
    if not settings["tokens_per_call"] or not settings["dtypes"]:
        raise MoecacheError("calibrate: cost.tokens_per_call and cost.dtypes must not be empty")
    if int(settings["repeats"]) < 1:
        raise MoecacheError(f"calibrate: cost.repeats must be at least 1, got {settings['repeats']}")
    for name in settings["dtypes"]:
        try:
            cal.dtype_of(name)
        except ValueError as exc:
            raise MoecacheError(f"calibrate: cost.dtypes: {exc}") from exc
    return settings


@contextmanager
def _threads(n: int | None) -> Iterator[int]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _machine(device: str, threads: int) -> dict:
    gpu = torch.device(device) if device.startswith("cuda") else None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_model": torch.cuda.get_device_name(gpu) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None,
        "threads": threads,
    }


def _pool_size(settings: dict, expert_bytes: int, cache_bytes: int) -> int:
    if settings.get("num_pool_experts"):
        return int(settings["num_pool_experts"])
    cap = int(settings["max_pool_bytes"])
    free = cal.available_memory_bytes()
    if free:
        cap = min(cap, free // 2)
    if settings.get("pool_bytes"):
        return max(2, min(int(settings["pool_bytes"]), cap) // expert_bytes)
    return cal.pool_experts(expert_bytes, cache_bytes, cap)


class _Progress:
    """A rich progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int | None):
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty())
        self._task = self._bar.add_task("calibrate", total=total)

    def __enter__(self):
        self._bar.start()
        return self

    def __exit__(self, *exc):
        self._bar.stop()

    def step(self, what: str) -> None:
        self._bar.update(self._task, advance=1, description=what)


def _expert_rows(
    settings: dict, shape: cal.ExpertShape, device: str, cache_bytes: int, threads: int, timer, bar
) -> list[dict]:
    rows = []
    for name in settings["dtypes"]:
        dtype = cal.dtype_of(name)
        num = _pool_size(settings, shape.bytes(dtype), cache_bytes)
        pool = cal.make_pool(shape, num, dtype, device)
        position = 0
        for tokens in settings["tokens_per_call"]:
            bar.step(f"{device} expert {name} M={tokens}")
            timing = timer(
                pool, int(tokens), int(settings["repeats"]), int(settings["warmup"]), start=position
            )
            position += int(settings["repeats"]) + int(settings["warmup"])
            row = {"dtype": name, "tokens_per_call": int(tokens), **timing.as_dict(), "pool_experts": num}
            rows.append(row | {"threads": threads} if device == "cpu" else row)
        del pool
    return rows


def _h2d(settings: dict, expert_bytes: int, device: torch.device, bar) -> dict:
    sizes = sorted({int(s) for s in settings["copy_sizes_bytes"]} | {expert_bytes})
    result: dict = {"expert_bytes": expert_bytes}
    for kind in ("pinned", "pageable"):
        rows = []
        for nbytes in sizes:
            bar.step(f"h2d {kind} {nbytes / cal.MiB:.3g} MiB")
            timing = cal.time_h2d_copy(
                nbytes, kind == "pinned", int(settings["repeats"]), int(settings["warmup"]), device
            )
            rows.append({"bytes": nbytes, **timing.as_dict(), "gbps": cal.gbps(nbytes, timing.median_us)})
        result[kind] = rows
    latency_us, gbps = cal.fit_latency_bandwidth([(r["bytes"], r["median_us"]) for r in result["pinned"]])
    result["fit"] = {"latency_us": latency_us, "gbps": gbps}
    return result


# ---- the runtime's own costs (schema 2) -------------------------------------------------------------


def _model_weights(cfg: DictConfig) -> str | None:
    """Why the model group gives no model to run (None: it does: a checkpoint path or a tiny build)."""
    from moecache.models.random_full import is_random

    model = cfg.get("model") or {}
    if is_random(to_container(model)):  # random weights built in memory (models/random_full.py)
        return None
    if OmegaConf.is_missing(model, "path") or (model.get("path") is None and not model.get("build")):
        return (
            "model.path is not set (an architecture-only model config): the non-expert time needs the model"
        )
    return None


def _architecture_shape(cfg: DictConfig) -> dict:
    """The runtime shape from model.architecture (no weights to load)."""
    arch = (cfg.get("model") or {}).get("architecture") or {}
    need = ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size")
    missing = [k for k in need if arch.get(k) is None]
    if missing:
        raise MoecacheError(
            f"calibrate: the runtime costs need the model's shape: model.architecture lacks {missing} and"
            " model.path is not set (set them, or cost.runtime.enabled=false)"
        )
    return {k: int(arch[k]) for k in need}


def _runtime_device(device: str):
    from moecache.runtime.device import CudaDevice, StandinDevice

    if device.startswith("cuda"):
        return CudaDevice(torch.device(device).index)
    return StandinDevice("before_visit")


def _timing_rows(keys: dict, timing: cal.Timing) -> dict:
    return {**keys, **timing.as_dict()}


def _non_expert_zeroed(loaded, runtime, shape: cal.RuntimeShape, rs: dict, vocab: int, step) -> dict:
    """cost.runtime.step=transformers: the model with its routed experts returning zeros (ZeroExperts),
    its prefills and decode steps timed through `step` (module docstring, `non_expert`)."""
    rdev = runtime.device
    # On the stand-in the model runs behind the runtime's operator (its time subtracted), whose cache
    # pressure a run's model work pays (docs/simulator.md); on CUDA that work is the device's.
    spent_s = None if rdev.is_cuda else [0.0]
    work = None if rdev.is_cuda else cal.resident_operator_work(runtime, shape)
    layers = cal.zero_experts(loaded.adapter, work, spent_s)
    lengths = sorted({int(t) for t in rs["prompt_tokens"]})
    repeats, warmup = int(rs["repeats"]), int(rs["warmup"])
    timed = [
        cal.time_model_steps(
            loaded.model,
            prompt_tokens=t,
            decode_steps=int(rs["decode_steps"]),
            repeats=max(3, repeats // 4),
            warmup=min(warmup, 1),
            vocab_size=vocab,
            step=step,
            spent_s=spent_s,
        )  # fmt: skip
        for t in lengths
    ]
    return _non_expert_section(layers, lengths, timed, int(rs["decode_steps"]))


def _non_expert_section(layers: int, lengths: list[int], timed: list, decode_steps: int) -> dict:
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


def _expert_path_us(costs: RuntimeCosts, tokens: int) -> float:
    """What the simulator adds to the non-expert time of a layer step of `tokens` tokens with every
    entry resident (moecache/sim/cost_model.py): the layer step's host cost (`visit_us`: for step=fast the
    manager's visit + commit, cost_profile._host_rows) and the operator at N = tokens x top_k resident
    entries (timed as CUDA graph replays for step=fast, as the fast loop runs it); no CPU half."""
    return float(costs.visit_us(tokens)) + float(costs.kernel_row_us(tokens)[tokens * costs.top_k])


def _less_expert_path(timing: cal.Timing, layers: int, per_layer_us: float, what: str) -> cal.Timing:
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


def _all_resident(model, device: str, rs: dict):
    """`model` offloaded as `moecache validate` offloads it (capacity 0, static_cold), then reconfigured
    as its all_resident run: every expert resident from the start (static_cold at all experts)."""
    from moecache.offloading import offload_model

    offload_model(
        model, capacity=0, policy="static_cold", device=device, cpu_backend=rs["cpu_backend"],
        cpu_threads=rs.get("cpu_threads"),
    )  # fmt: skip
    model.moecache.reconfigure(capacity="100%", policy="static_cold")
    return model


def _non_expert_fast(loaded, section: dict, rs: dict, device: str, vocab: int) -> tuple[dict, object]:
    """cost.runtime.step=fast: the all-resident model in moecache's fast decode loop, as validate's fast
    runs pay it (`calibration.time_fast_steps`), less what the simulator adds back to every layer step of
    such a run (`_expert_path_us`, from the section's own rows): the all-resident fast run is predicted
    exactly, by construction. `measured` keeps the loop's own times. The model is offloaded (returned,
    for `_cpu_path_fast`): last."""
    costs = RuntimeCosts.from_section(section, "calibrate")
    layers = len(loaded.adapter.moe_layers())
    loaded.adapter = None  # offload drops the model's experts: no other reference may keep them
    gc.collect()
    model = _all_resident(loaded.model, device, rs)
    lengths = sorted({int(t) for t in rs["prompt_tokens"]})
    repeats, warmup = int(rs["repeats"]), int(rs["warmup"])
    measured = [
        cal.time_fast_steps(
            model,
            prompt_tokens=t,
            decode_steps=int(rs["decode_steps"]),
            repeats=max(3, repeats // 4),
            warmup=min(warmup, 1),
            vocab_size=vocab,
        )  # fmt: skip
        for t in lengths
    ]
    back = {t: _expert_path_us(costs, t) for t in {1, *lengths}}  # per layer step of t tokens
    decode = _less_expert_path(measured[0][1], layers, back[1], "decode step")  # after the shortest prompt
    timed = [
        (_less_expert_path(pre, layers, back[t], f"{t}-token prefill"), decode)
        for t, (pre, _) in zip(lengths, measured, strict=True)
    ]
    ne = _non_expert_section(layers, lengths, timed, int(rs["decode_steps"]))
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
    return ne, model


def _in_loop_repeats(rs: dict) -> int:
    """Timed generations of each in-loop run (`_cpu_path_fast`, `_split_host_fast`)."""
    return max(3, int(rs["repeats"]) // 4)


CPU_LOG_MIN_CALLS = 5  # in-loop CPU-path calls of one entry count needed for its row (_cpu_path_fast)


def _cpu_path_fast(model, rs: dict, vocab: int, multi_rows: list[dict]) -> tuple[list[dict], dict]:
    """cost.runtime.step=fast: the CPU path priced by the fast loop's own calls, where the runs make
    them (between the segments' replays, copies and GPU work around them): the offloaded model with
    every expert on the CPU (validate's all_cpu), then with the first half of every layer's experts
    resident (a fixed placement: calls of 1..K entries), under random forced routing
    (`calibration.time_fast_steps`), each call's host time the loop's own CPU-path timer
    (ExpertsTaps.cpu_log). Returns (the cpu_path rows, the `cpu_path_prefill` summary):
    - the one-token rows are those calls' medians per entry count; they replace the isolated loop's
      M=1 rows, which time the calls back to back (on the H200 host, 1,349 us for 6 experts against
      1,698 in the all_cpu run: docs/benchmarks.md);
    - the isolated loop's rows of more tokens (`multi_rows`) are scaled by one factor, the one that
      prices the loops' prefill calls (several tokens per expert) right in the median
      (`_prefill_scale`)."""
    from moecache.validation.baselines import install_hindsight

    shape = model.moecache.manager.shape
    L, E = shape.num_layers, shape.num_experts
    keep = E // 2
    half_G = (np.arange(L)[:, None] * E + np.arange(keep)[None, :]).reshape(-1).astype(np.int64)
    prompt = int(rs["cpu_path_prompt_tokens"])
    log: list[tuple[int, int, int, tuple]] = []
    runs = []
    for slots in (0, len(half_G)):
        session = model.moecache.reconfigure(capacity=slots, policy="static_cold")
        if slots:
            install_hindsight(session.manager, half_G)
        prefill, decode = cal.time_fast_steps(
            model, prompt_tokens=prompt, decode_steps=int(rs["cpu_path_decode_steps"]),
            repeats=_in_loop_repeats(rs), warmup=1, vocab_size=vocab, cpu_log=log,
        )  # fmt: skip
        runs.append({"slots": slots, "prefill": prefill.as_dict(), "decode": decode.as_dict()})
    by_entries: dict[int, list[float]] = {}
    for tokens, entries, ns, _ in log:
        if tokens == 1:
            by_entries.setdefault(entries, []).append(ns / 1e3)
    one_rows = [
        _timing_rows({"tokens_per_expert": 1, "experts": u, "timed": "fast_loop"}, cal.summarize(us))
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
    scale = _prefill_scale(multi_rows, one_rows, prefill)
    summary = {
        "calls": len(prefill),
        "scale": scale,
        "prompt_tokens": prompt,
        "timed": "fast_loop",
        "runs": runs,
    }
    if scale is None:
        return one_rows + multi_rows, summary
    return one_rows + [_scaled_row(r, scale) for r in multi_rows], summary


def _cpu_step_excess(section: dict, base: dict, rs: dict) -> dict:
    """cost.runtime.step=fast: what a layer step with CPU work costs in the fast loop beyond what the
    model prices (the profile's runtime.cpu_step_excess), from the all-CPU run (`_cpu_path_fast`'s
    first): per MoE layer, its decode step and its prefill less the same as the simulator prices them
    with the profile measured so far (`base` with this `section`: `_priced_all_cpu_us`). On the H200
    host the fast loop's host points ran 4-13x slower with the CPU path between them than the profile's
    visit rows price them (the manager's visit 43-78 us per visit in those runs against 6-10:
    docs/benchmarks.md). `raw_us` / `prefill_raw_us` keep the remainders, `decode_us` / `prefill_us`
    (what the simulator adds) are them clamped at 0: with them, the all-CPU run is predicted exactly, as
    the all-resident one is."""
    run = next(r for r in section["cpu_path_prefill"]["runs"] if r["slots"] == 0)
    layers = int(section["non_expert"]["moe_layers"])
    prompt = int(section["cpu_path_prefill"]["prompt_tokens"])
    prefill_us, decode_us = _priced_all_cpu_us({**base, "runtime": section}, prompt, rs)
    raw = (run["decode"]["median_us"] - decode_us) / layers
    raw_prefill = (run["prefill"]["median_us"] - prefill_us) / layers
    return {
        "decode_us": max(raw, 0.0), "raw_us": raw, "prefill_us": max(raw_prefill, 0.0),
        "prefill_raw_us": raw_prefill, "timed": "fast_loop", "run_slots": 0,
    }  # fmt: skip


def _priced_all_cpu_us(profile: dict, prompt: int, rs: dict) -> tuple[float, float]:
    """The all-CPU run as the simulator prices it with `profile`: its forced routing
    (`calibration.random_routing`, as `time_fast_steps` drew it), the prompt as one prefill step per
    layer and each later token a decode step, every access a miss, through the instant replay's step
    formula: (the prefill's us, a decode token's us, the median over the generation's tokens)."""
    from moecache.sim.cost_model import CostModel, instant_step_us
    from moecache.sim.shape import ModelShape
    from moecache.sim.trace_arrays import from_table
    from moecache.trace.esft_import import EsftArrays, esft_to_table
    from moecache.trace.schema import TraceMeta

    m = profile["runtime"]["model"]
    L, E, K = int(m["num_layers"]), int(m["num_experts"]), int(m["top_k"])
    per_run = cal.decode_steps_per_generation(int(rs["cpu_path_decode_steps"]), _in_loop_repeats(rs))
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


def _scaled_row(row: dict, scale: float) -> dict:
    times = {k: row[k] * scale for k in ("median_us", "p10_us", "p90_us")}
    return row | times | {"scaled_to_fast_loop": scale}


def _prefill_scale(multi_rows: list[dict], one_rows: list[dict], calls: list[tuple[float, tuple]]):
    """The factor f on the rows of more than one token per expert under which the CPU-path model
    (`cost_profile.cpu_path_fit`: the call's cost + each expert's at its token count) prices the fast
    loop's prefill calls `calls` ([(us, each expert's tokens)]) right in the median: the median of
    (model - measured) / measured is 0 (bisection; it falls as f grows). None without such calls or rows."""
    if not calls or not multi_rows:
        return None

    def median_error(f: float) -> float:
        curve, call_us = cpu_path_fit(one_rows + [_scaled_row(r, f) for r in multi_rows], "calibrate")
        errors = [
            (call_us + float(np.sum(curve(np.array(uses, np.float64)))) - us) / us for us, uses in calls
        ]
        return float(np.median(errors))

    lo, hi = 1.0 / 16, 16.0
    if median_error(lo) > 0 or median_error(hi) < 0:  # outside [1/16, 16]: not a scale, a wrong model
        return None
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if median_error(mid) < 0 else (lo, mid)
    return (lo * hi) ** 0.5


SPLIT_HOST_POLICY, SPLIT_HOST_CAPACITY = "lru", "25%"  # _split_host_fast's cache: most misses admitted


def _split_host_fast(model, section: dict, base: dict, rs: dict, vocab: int) -> dict:
    """cost.runtime.step=fast: on_miss="split"'s own host time, in the fast loop (the profile's
    runtime.split_host, module docstring): the offloaded model reconfigured to SPLIT_HOST_POLICY at
    SPLIT_HOST_CAPACITY with on_miss="split" weighing the profile measured so far (`base` with this
    `section`: the decisions are the ones a run with this profile makes), decoding under random forced
    routing (`calibration.time_fast_steps`) over cost.runtime.cpu_path_decode_steps decode steps; the
    manager's split counters over the timed generations (ManagerStats.split_*)."""
    profile = CostProfile.from_dict({**base, "runtime": section}, "calibrate's profile so far")
    session = model.moecache.reconfigure(
        capacity=SPLIT_HOST_CAPACITY, policy=SPLIT_HOST_POLICY, on_miss="split", cost_profile=profile
    )
    stats = session.manager.stats
    start: dict[str, int] = {}

    def timed_start() -> None:
        start.update(
            (k, getattr(stats, k))
            for k in ("split_decisions", "split_decide_ns", "split_waits", "split_wait_ns")
        )

    cal.time_fast_steps(
        model, prompt_tokens=int(rs["cpu_path_prompt_tokens"]), decode_steps=int(rs["cpu_path_decode_steps"]),
        repeats=_in_loop_repeats(rs), warmup=1, vocab_size=vocab, timed_start=timed_start,
    )  # fmt: skip
    decisions = stats.split_decisions - start["split_decisions"]
    waits = stats.split_waits - start["split_waits"]
    return {
        "decide_us": (stats.split_decide_ns - start["split_decide_ns"]) / decisions / 1e3
        if decisions
        else None,
        "wait_us": (stats.split_wait_ns - start["split_wait_ns"]) / waits / 1e3 if waits else None,
        "decisions": decisions,
        "waits": waits,
        "policy": SPLIT_HOST_POLICY,
        "capacity": SPLIT_HOST_CAPACITY,
        "timed": "fast_loop",
    }


def measure_runtime(
    cfg: DictConfig,
    rs: dict,
    device: str,
    cache_bytes: int,
    max_pool_bytes: int,
    bar,
    step=None,
    base: dict | None = None,
) -> dict:
    """The profile's `runtime` section (module docstring). `step`: the decode loop of the non-expert
    time (step=transformers) and of the stand-in's in-model timings (default: cost.runtime.step from
    calibration.STEP_FUNCTIONS). `base`: the profile's other sections (measure's), for step=fast's
    split_host row (weighed with the whole profile); without it the row is not measured."""
    from moecache.models import load_model

    step = step or cal.STEP_FUNCTIONS[rs["step"]]
    repeats, warmup = int(rs["repeats"]), int(rs["warmup"])
    reason = _model_weights(cfg)
    non_expert = None
    if reason is None:
        loaded = load_model(cfg.model, cfg.output_root, device)
        arch = loaded.adapter.describe()
        dtype = loaded.adapter.dtype
        vocab = int(loaded.model.config.get_text_config().vocab_size)
    else:
        loaded = None
        arch = _architecture_shape(cfg)
        model_dtype = (cfg.get("model") or {}).get("dtype")
        dtype = cal.dtype_of(model_dtype if model_dtype not in (None, "auto") else "bfloat16")
    shape = cal.RuntimeShape(
        int(arch["num_experts"]), int(arch["top_k"]), int(arch["hidden_size"]),
        int(arch["moe_intermediate_size"]), dtype,
    )  # fmt: skip
    rdev = _runtime_device(device)
    e, k = shape.num_experts, shape.top_k
    if e < 2 * k:
        raise MoecacheError(f"calibrate: the runtime costs need num_experts >= 2 x top_k, got E={e}, K={k}")
    # As many slots as leave top_k experts outside the pool (a step's misses need them): a long step's
    # resident entries then spread over nearly all E experts, as an all-resident prefill's do (the
    # operator's cost grows with the distinct experts it visits, not only with its entries).
    slots = e - k
    # The run's own store when it is small (its cache behaviour), else a pool larger than the cache.
    cold = cal.pool_experts(shape.expert_bytes(), cache_bytes, max_pool_bytes)
    store_experts = max(e, min(int(arch["num_layers"]) * e, cold))
    runtime = cal.synthetic_runtime(
        shape, store_experts, slots, rdev, cpu_threads=rs.get("cpu_threads"), cpu_backend=rs["cpu_backend"]
    )
    if loaded is not None and rs["step"] == "transformers":
        bar.step("runtime non-expert time")
        non_expert = _non_expert_zeroed(loaded, runtime, shape, rs, vocab, step)
    # On the stand-in the operator, the CPU path and the layer call are host work whose cost depends on
    # what ran before them: timed inside the model's forward where the model is at hand (a tight loop
    # finds their code and data in the core's caches; docs/simulator.md). CUDA: the loop, as before.
    in_model = loaded is not None and not rdev.is_cuda
    model_args, rw = ((loaded.model, loaded.adapter) if in_model else ()), (repeats, warmup)
    kw = {"vocab_size": vocab, "step": step} if in_model else {}
    kernel_rows = []
    for tokens in rs["kernel_tokens"]:
        for entries in cal.entries_grid(int(tokens), k, slots):
            bar.step(f"runtime slot_moe T={tokens} N={entries}")
            if in_model:
                timing = cal.time_slot_moe_in_model(
                    *model_args, runtime, shape, int(tokens), entries, *rw, **kw
                )
            else:
                timing = cal.time_slot_moe(
                    runtime, shape, int(tokens), entries, repeats, warmup, graphs=rs["step"] == "fast"
                )
            kernel_rows.append(_timing_rows({"tokens": int(tokens), "entries": entries}, timing))
    cpu_rows = []
    for m in rs["cpu_tokens_per_expert"]:
        for u in sorted({1, k}):
            bar.step(f"runtime cpu path M={m} U={u}")
            if in_model:
                timing = cal.time_cpu_path_in_model(*model_args, runtime, shape, int(m), u, *rw, **kw)
            else:
                timing = cal.time_cpu_path(runtime, shape, int(m), u, repeats, warmup)
            cpu_rows.append(_timing_rows({"tokens_per_expert": int(m), "experts": u}, timing))
    copy_engine = None
    if rdev.is_cuda:
        bar.step("runtime copy engine")
        copies = min(int(rs["copy_batch"]), slots)
        single, batch = cal.time_copy_engine(runtime, copies, repeats, warmup)
        copy_engine = {
            "expert_bytes": shape.expert_bytes(),
            "single": single.as_dict(),
            "batch": {"copies": copies, **batch.as_dict()},
            "per_copy_us": batch.median_us / copies,
        }
    visiting = cal.synthetic_runtime(shape, e, max(1, e // 4), rdev, cpu_backend="torch")
    # every expert resident from the start: visits without admissions (the copies' host share, below)
    resident = cal.synthetic_runtime(shape, e, e, rdev, cpu_backend="torch", policy="static_cold")
    visit_rows, hit_rows, call_rows = [], [], []
    for tokens in rs["visit_tokens"]:
        bar.step(f"runtime visit T={tokens}")
        copies0 = visiting.manager.stats.copies
        timing = cal.time_visit(visiting.manager, shape, int(tokens), repeats, warmup)
        per_visit = (visiting.manager.stats.copies - copies0) / (repeats + warmup)
        visit_rows.append(_timing_rows({"tokens": int(tokens), "copies_per_visit": per_visit}, timing))
        timing = cal.time_visit(resident.manager, shape, int(tokens), repeats, warmup)
        hit_rows.append(_timing_rows({"tokens": int(tokens)}, timing))
        if in_model:
            timing = cal.time_layer_call_in_model(*model_args, visiting, shape, int(tokens), *rw, **kw)
        else:
            timing = cal.time_layer_call(visiting, shape, int(tokens), repeats, warmup)
        call_rows.append(_timing_rows({"tokens": int(tokens)}, timing))
    section = {
        "model": {
            "name": (cfg.get("model") or {}).get("name"),
            "num_layers": int(arch["num_layers"]),
            **{
                f: getattr(shape, f) for f in ("num_experts", "top_k", "hidden_size", "moe_intermediate_size")
            },
            "dtype": str(dtype).removeprefix("torch."),
            "expert_bytes": shape.expert_bytes(),
        },
        "execution": {
            "path": rs["step"],
            "overlap": runtime_overlap(rdev.is_cuda),
            "device": rdev.name,
        },
        "cpu_backend": runtime.cpu.backend,
        "cpu_threads": runtime.cpu.threads,
        "store_experts": store_experts,
        "slots": slots,
        "slot_moe": kernel_rows,
        "host_timed": "in_model" if in_model else "loop",
        "cpu_path": cpu_rows,
        "visit": visit_rows,
        "visit_hits": hit_rows,
        "layer_call": call_rows,
        "copy_engine": copy_engine,
        "non_expert": non_expert,
    }
    del runtime, visiting, resident, model_args  # their stores and pools, before the model is offloaded
    gc.collect()
    if loaded is not None and rs["step"] == "fast":
        bar.step("runtime non-expert time (fast loop)")
        section["non_expert"], model = _non_expert_fast(loaded, section, rs, device, vocab)
        bar.step("runtime cpu path (fast loop)")
        multi = [r for r in section["cpu_path"] if r["tokens_per_expert"] != 1]
        section["cpu_path"], section["cpu_path_prefill"] = _cpu_path_fast(model, rs, vocab, multi)
        if base is not None:  # both weigh the profile measured so far
            section["cpu_step_excess"] = _cpu_step_excess(section, base, rs)
            bar.step("runtime split host time (fast loop)")
            section["split_host"] = _split_host_fast(model, section, base, rs, vocab)
        del model
        gc.collect()
    if section["non_expert"] is None:
        section["non_expert_reason"] = reason
    return section


def _runtime_points(rs: dict, top_k: int, slots: int, on_gpu: bool) -> int:
    kernel = sum(len(cal.entries_grid(int(t), top_k, slots)) for t in rs["kernel_tokens"])
    in_loop = int(rs["step"] == "fast")  # _cpu_path_fast
    return 1 + kernel + 2 * len(rs["cpu_tokens_per_expert"]) + len(rs["visit_tokens"]) + int(on_gpu) + in_loop


def measure(
    settings: dict,
    shape: cal.ExpertShape,
    dtype: str,
    device: str,
    machine: dict,
    cfg: DictConfig | None = None,
) -> dict:
    """Run every measurement; the cost-profile dict (see the module docstring). The runtime section
    needs the run's config `cfg` (its model group); without it, or with cost.runtime.enabled=false, it is
    null."""
    started = time.perf_counter()
    on_gpu = device.startswith("cuda")
    n_expert_points = len(settings["dtypes"]) * len(settings["tokens_per_call"])
    n_copy_points = 2 * (len(set(settings["copy_sizes_bytes"]) | {shape.bytes(cal.dtype_of(dtype))}))
    llc = cal.last_level_cache_bytes()
    # The load average tells a reader whether other work competed for the CPU while it was measured.
    machine = machine | {"llc_bytes": llc, "gpu_l2_bytes": None, "loadavg_1m": os.getloadavg()[0]}
    machine["host_loop"] = cal.time_host_loop().as_dict()  # the host thread's speed (validate's check)
    expert_bytes = shape.bytes(cal.dtype_of(dtype))
    with _Progress(n_expert_points * (2 if on_gpu else 1) + (n_copy_points if on_gpu else 0)) as bar:
        with _threads(settings.get("threads")) as threads:
            cache = llc or int(settings["fallback_llc_bytes"])
            cpu_rows = _expert_rows(settings, shape, "cpu", cache, threads, cal.time_cpu_expert, bar)
        cuda_rows = h2d = None
        if on_gpu:
            gpu = torch.device(device)
            machine["gpu_l2_bytes"] = cal.gpu_l2_bytes(gpu)
            cuda_rows = _expert_rows(
                settings, shape, device, machine["gpu_l2_bytes"], threads, cal.time_cuda_expert, bar
            )
            h2d = _h2d(settings, expert_bytes, gpu, bar)
    base = {
        "schema_version": SCHEMA_VERSION,
        "shape": {
            "hidden_size": shape.hidden_size,
            "moe_intermediate_size": shape.moe_intermediate_size,
            "params": shape.params(),
            "expert_bytes": expert_bytes,
        },
        "dtype": dtype,
        "machine": machine,
        "cpu": cpu_rows,
        "cuda": cuda_rows,
        "h2d": h2d,
        "runtime": None,
        "settings": {
            k: settings[k]
            for k in ("repeats", "warmup", "tokens_per_call", "dtypes", "copy_sizes_bytes", "runtime")
            if k in settings
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    rs = settings.get("runtime") or {}
    if cfg is not None and rs.get("enabled"):
        with _Progress(None) as bar:
            base["runtime"] = measure_runtime(
                cfg, rs, device, machine["gpu_l2_bytes"] if on_gpu else llc or int(settings["fallback_llc_bytes"]),
                int(settings["max_pool_bytes"]), bar, base=base,
            )  # fmt: skip
    return base | {"measure_s": time.perf_counter() - started}


def _median_at(rows: list[dict], dtype: str, tokens: int) -> float | str:
    found = [r["median_us"] for r in rows if r["dtype"] == dtype and r["tokens_per_call"] == tokens]
    return found[0] if found else "not measured"


def summary(profile: CostProfile) -> dict:
    """Headline numbers for the CLI table (measured medians, not the simulator's smoothed costs)."""
    rows: dict = {
        "shape (H x I)": f"{profile.shape['hidden_size']} x {profile.shape['moe_intermediate_size']}"
    }
    rows["weight dtype"] = profile.dtype
    for name in profile.dtypes("cpu"):
        rows[f"cpu us/expert M=1 {name}"] = _median_at(profile.cpu, name, 1)
    rows["cpu threads"] = profile.machine.get("threads")
    rows["cpu pool experts"] = max(r["pool_experts"] for r in profile.cpu)
    if profile.cuda is not None:
        for name in profile.dtypes("cuda"):
            rows[f"cuda us/expert M=1 {name}"] = _median_at(profile.cuda, name, 1)
    if profile.h2d is not None:
        at_expert = profile.pinned_at(profile.expert_bytes)
        rows[f"h2d pinned GB/s at {profile.expert_bytes} B"] = at_expert["gbps"]
        rows["h2d pinned us per expert"] = at_expert["median_us"]
        rows["h2d fit latency us"] = profile.h2d["fit"]["latency_us"]
        rows["h2d fit GB/s"] = profile.h2d["fit"]["gbps"]
    rows.update(runtime_summary(profile))
    rows["measure s"] = profile.measure_s
    return rows


def runtime_summary(profile: CostProfile) -> dict:
    """The runtime section's headline numbers (its medians, and the decode step they add up to)."""
    rt = profile.runtime
    if rt is None:
        return {}
    costs = profile.runtime_costs()
    k, m = costs.top_k, rt["model"]
    rows: dict = {
        "runtime model": f"{m['name']}: {m['num_layers']} x {m['num_experts']} experts, top-{k}, {m['dtype']}",
        "runtime device / cpu backend": f"{rt['execution']['device']} / {rt['cpu_backend']} x{rt['cpu_threads']}",
    }
    for r in rt["slot_moe"]:
        if r["tokens"] == 1:
            rows[f"slot_moe us T=1 N={r['entries']}"] = r["median_us"]
    rows["cpu path us per call (fit)"] = costs.cpu_call_us
    rows["cpu path us per expert M=1 (fit)"] = float(costs.cpu_expert_us(1))
    for r in rt["visit"]:
        rows[f"visit+commit us T={r['tokens']}"] = r["median_us"]
    for r in rt.get("layer_call") or []:
        rows[f"experts-module call, halves stubbed, us T={r['tokens']}"] = r["median_us"]
    if rt["copy_engine"] is not None:
        rows["copy engine us per expert (batch)"] = rt["copy_engine"]["per_copy_us"]
        rows["copy engine us single"] = rt["copy_engine"]["single"]["median_us"]
    split = rt.get("split_host")
    if split is not None:
        rows["split host us per decision (fast loop)"] = split["decide_us"]
        rows["split host us per waiting visit (fast loop)"] = split["wait_us"]
    ne = rt["non_expert"]
    if ne is None:
        rows["non-expert"] = rt.get("non_expert_reason", "not measured")
        return rows
    rows[f"non-expert us/layer decode ({rt['execution']['path']})"] = ne["decode_us_per_layer"]
    for point in ne.get("prefill_points") or []:
        per = point["median_us"] / (point["prompt_tokens"] * ne["moe_layers"])
        rows[f"non-expert us/token/layer prefill, {point['prompt_tokens']} tokens"] = per
    if not ne.get("prefill_points"):
        rows["non-expert us/token/layer prefill"] = ne["prefill_us_per_token_per_layer"]
    if "measured" in ne:  # step=fast: the all-resident fast loop as timed (the all-hits row equals it)
        rows["decode ms/token, all resident (fast loop, measured)"] = (
            ne["measured"]["decode"]["median_us"] / 1e3
        )
    # The decode step the simulator's runtime formula gives (serial halves), all hits and all misses.
    layer = ne["decode_us_per_layer"] + float(costs.visit_us(1))
    all_hit = layer + float(costs.kernel_row_us(1)[k])
    all_miss = layer + costs.cpu_call_us + k * float(costs.cpu_expert_us(1)) + costs.cpu_step_excess_us
    rows["decode ms/token, all hits (model)"] = all_hit * m["num_layers"] / 1e3
    rows["decode ms/token, all misses (model)"] = all_miss * m["num_layers"] / 1e3
    excess = rt.get("cpu_step_excess")
    if excess is not None:  # step=fast: the all-CPU run as timed (the all-misses row equals it)
        run = next(r for r in rt["cpu_path_prefill"]["runs"] if r["slots"] == 0)
        rows["decode ms/token, all on the CPU (fast loop, measured)"] = run["decode"]["median_us"] / 1e3
        rows["cpu-step excess us/layer decode (fast loop; raw)"] = (
            f"{excess['decode_us']:.1f} ({excess['raw_us']:.1f})"
        )
        if excess.get("prefill_us") is not None:
            rows["cpu-step excess us/layer prefill (fast loop; raw)"] = (
                f"{excess['prefill_us']:.1f} ({excess['prefill_raw_us']:.1f})"
            )
    return rows


def run(cfg: DictConfig) -> StageResult:
    prepare(cfg, STAGE)
    device = torch_device(cfg)
    settings = _settings(cfg)
    shape, dtype, source = resolve_shape(cfg)
    with _threads(settings.get("threads")) as threads:
        machine = _machine(device, threads)
    identity = {k: machine[k] for k in ("cpu_model", "cpu_count", "gpu_model", "torch", "threads")}
    config = {
        "cost": settings,
        "shape": {
            "hidden_size": shape.hidden_size,
            "moe_intermediate_size": shape.moe_intermediate_size,
            "dtype": dtype,
        },
        "device": "cuda" if device.startswith("cuda") else "cpu",
        "machine": identity,
    }
    if (settings.get("runtime") or {}).get("enabled"):  # the runtime rows are the model's
        config["model"] = to_container(cfg.model) if "model" in cfg else None
    found = reusable(cfg, STAGE, SCHEMA_VERSION, config, [])
    if found is not None:
        return StageResult(found, reused=True, summary=summary(CostProfile.load(found / PROFILE_FILE)))
    profile = measure(settings, shape, dtype, device, machine, cfg)
    profile["shape"]["source"] = source
    store = store_for(cfg)
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=[], seed=None) as tmp:
        write_json_atomic(tmp / PROFILE_FILE, profile)
    final = store.root / STAGE / artifact_id(STAGE, SCHEMA_VERSION, config, [])
    return StageResult(final, reused=False, summary=summary(CostProfile.load(final / PROFILE_FILE)))
