"""`moecache calibrate`: measure this machine's expert and copy costs; write a cost-profile artifact.

Reads no model weights: synthetic experts of the model's shape (see `resolve_shape`) are timed on the CPU
(and on CUDA when the run's device is a GPU), and host-to-device copies are timed from pinned and pageable
memory. The artifact id covers the cost settings, the shape and the machine (CPU and GPU model, torch
version, threads), so a profile measured elsewhere never stands in for this machine's.

`cost_profile.json` (schema 1; `moecache.cost_profile.CostProfile` loads it):
    schema_version  1
    shape           {hidden_size, moe_intermediate_size, params, expert_bytes (of `dtype`), source}
    dtype           the model's weight dtype (the headline and the one-expert copy use it)
    machine         {cpu_model, cpu_count, gpu_model, torch, cuda, threads, llc_bytes, gpu_l2_bytes, loadavg_1m}
    cpu             [{dtype, tokens_per_call, median_us, p10_us, p90_us, repeats, pool_experts, threads}]
    cuda            same rows, timed with CUDA events around one eager expert call (its kernel launches
                    included: what a per-expert loop pays), or null when the run had no GPU
    h2d             {pinned: [{bytes, median_us, p10_us, p90_us, repeats, gbps}], pageable: [...],
                     fit: {latency_us, gbps} (pinned), expert_bytes} or null when the run had no GPU
    settings        {repeats, warmup, tokens_per_call, dtypes, copy_sizes_bytes}
    measured_at     UTC time, ISO 8601
    measure_s       wall seconds the measurements took
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
from moecache.env_info import cpu_model
from moecache.errors import MoecacheError
from moecache.stages.base import StageResult, prepare, reusable, store_for, torch_device

STAGE = "calibrate"
SCHEMA_VERSION = 1


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

    def __init__(self, total: int):
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


def measure(settings: dict, shape: cal.ExpertShape, dtype: str, device: str, machine: dict) -> dict:
    """Run every measurement; the cost-profile dict (see the module docstring)."""
    started = time.perf_counter()
    on_gpu = device.startswith("cuda")
    n_expert_points = len(settings["dtypes"]) * len(settings["tokens_per_call"])
    n_copy_points = 2 * (len(set(settings["copy_sizes_bytes"]) | {shape.bytes(cal.dtype_of(dtype))}))
    llc = cal.last_level_cache_bytes()
    # The load average tells a reader whether other work competed for the CPU while it was measured.
    machine = machine | {"llc_bytes": llc, "gpu_l2_bytes": None, "loadavg_1m": os.getloadavg()[0]}
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
    return {
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
        "settings": {
            k: settings[k] for k in ("repeats", "warmup", "tokens_per_call", "dtypes", "copy_sizes_bytes")
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measure_s": time.perf_counter() - started,
    }


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
    rows["measure s"] = profile.measure_s
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
    found = reusable(cfg, STAGE, SCHEMA_VERSION, config, [])
    if found is not None:
        return StageResult(found, reused=True, summary=summary(CostProfile.load(found / PROFILE_FILE)))
    profile = measure(settings, shape, dtype, device, machine)
    profile["shape"]["source"] = source
    store = store_for(cfg)
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=[], seed=None) as tmp:
        write_json_atomic(tmp / PROFILE_FILE, profile)
    final = store.root / STAGE / artifact_id(STAGE, SCHEMA_VERSION, config, [])
    return StageResult(final, reused=False, summary=summary(CostProfile.load(final / PROFILE_FILE)))
