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
`runtime`): every field, and which the fit derives, in docs/artifacts.md "The cost profile". The
measurements are `moecache.calibration`'s (one timing primitive, `calibration.time_calls`); the runtime
section's, `moecache.stages.calibrate_runtime`'s; the derived fields, `moecache.calibration_fit`'s.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig

from moecache import calibration as cal
from moecache.artifacts import artifact_id, write_json_atomic
from moecache.config import to_container
from moecache.cost_profile import PROFILE_FILE, CostProfile
from moecache.cost_profile import SCHEMA_VERSION as PROFILE_SCHEMA
from moecache.env_info import cpu_model
from moecache.errors import MoecacheError
from moecache.stages.base import StageResult, prepare, reusable, store_for, torch_device
from moecache.stages.calibrate_runtime import measure_runtime

STAGE = "calibrate"
SCHEMA_VERSION = PROFILE_SCHEMA  # the artifact's schema is the profile's


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


def measure(
    settings: dict,
    shape: cal.ExpertShape,
    dtype: str,
    device: str,
    machine: dict,
    cfg: DictConfig | None = None,
) -> dict:
    """Run every measurement; the cost-profile dict (docs/artifacts.md "The cost profile"). The runtime section
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
    lag = rt.get("publish_lag")
    if lag is not None:  # its quantiles at evenly spaced probabilities
        q = lag["quantiles_us"]
        at = [q[round(p * (len(q) - 1))] for p in (0.5, 0.1, 0.9)]
        rows["publish lag us, median (p10..p90) (fast loop)"] = f"{at[0]:.1f} ({at[1]:.1f}..{at[2]:.1f})"
    warm = rt.get("decode_warmup")
    if warm is not None:  # the decoder's first decode steps beyond a timed step
        rows["decoder warm-up ms beyond a step (fast loop)"] = ", ".join(
            f"{p / 1e3:.1f}" for p in warm["pause_us"]
        )
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
