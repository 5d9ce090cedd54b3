"""The cost profile's `runtime` section (schema 2): what moecache's runtime itself costs, measured through
its own code paths (moecache/runtime/experts_module.py) on a synthetic store of the model's shape and on
the run's device (CUDA, else the CPU stand-in): the slot-pool operator, the CPU path, the manager's
visit, the copy engine, and the non-expert time of the model itself (built or loaded as `moecache
generate` does; without weights, e.g. an `architecture`-only model config, that part is null and says
why). The fields are described in docs/artifacts.md "The cost profile".

The measurements are `moecache.calibration`'s; what the section derives from them (step=fast's
non-expert time, its CPU-path rows, the CPU-step excess) is `moecache.calibration_fit`'s, called here
where a later measurement needs the fitted profile (the split-host run weighs it).
"""

from __future__ import annotations

import gc

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from moecache import calibration as cal
from moecache import calibration_fit as fit
from moecache.config import to_container
from moecache.cost_profile import CostProfile, decode_warmup_row
from moecache.errors import MoecacheError


# How the runtime's layer step combines its halves (moecache/runtime/experts_module.py,
# moecache/runtime/segments.py): on CUDA the CPU half's inputs are on the host before the GPU half is
# enqueued, so the CPU misses are computed while the resident experts run, in both decode loops and the
# fast loop's prefill ("parallel", moecache/sim/cost_model.py); on the CPU stand-in the operator is host
# work run first, then the CPU path ("serial").
def runtime_overlap(cuda: bool) -> str:
    """How the measured execution path combines a layer step's GPU and CPU halves (above)."""
    return "parallel" if cuda else "serial"


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


def _non_expert_zeroed(loaded, runtime, shape: cal.RuntimeShape, rs: dict, vocab: int, step) -> dict:
    """cost.runtime.step=transformers: the model with its routed experts returning zeros (ZeroExperts),
    its prefills and decode steps timed through `step` (docs/artifacts.md "The cost profile",
    `non_expert`)."""
    rdev = runtime.device
    # On the stand-in the model runs behind the runtime's operator (its time subtracted), whose cache
    # pressure a run's model work pays (docs/simulator.md); on CUDA that work is the device's.
    spent_s = None if rdev.is_cuda else [0.0]
    work = None if rdev.is_cuda else cal.resident_operator_work(runtime, shape)
    layers = cal.zero_experts(loaded.adapter, work, spent_s)
    lengths = sorted({int(t) for t in rs["prompt_tokens"]})
    warmup = int(rs["warmup"])
    timed = [
        cal.time_model_steps(
            loaded.model,
            prompt_tokens=t,
            decode_steps=int(rs["decode_steps"]),
            repeats=cal.in_loop_repeats(rs),
            warmup=min(warmup, cal.MODEL_RUN_WARMUP),
            vocab_size=vocab,
            step=step,
            spent_s=spent_s,
        )  # fmt: skip
        for t in lengths
    ]
    return fit.non_expert_section(layers, lengths, timed, int(rs["decode_steps"]))


def _all_resident(model, device: str, rs: dict):
    """`model` offloaded as `moecache validate` offloads it (capacity 0, static_cold), then reconfigured
    as its all_resident run: every expert resident from the start (static_cold at all experts)."""
    from moecache.offloading import offload_model

    offload_model(
        model, capacity=0, policy="static_cold", device=device, cpu_backend=rs["cpu_backend"],
        cpu_threads=rs.get("cpu_threads"), stream_min_tokens=0,
    )  # fmt: skip
    model.moecache.reconfigure(capacity="100%", policy="static_cold")
    return model


def _time_all_resident(loaded, rs: dict, device: str, vocab: int) -> tuple[int, list[int], list, object]:
    """cost.runtime.step=fast: the all-resident model in moecache's fast decode loop, as validate's fast
    runs pay it (`calibration.time_fast_steps`), one (prefill, decode) per prompt length of
    cost.runtime.prompt_tokens. Returns (MoE layers, the sorted lengths, their timings, the offloaded
    model: last, for the in-loop runs after it); `calibration_fit.fit_non_expert_fast` fits them."""
    from moecache.validation.generation import FastLoop

    layers = len(loaded.adapter.moe_layers())
    loaded.adapter = None  # offload drops the model's experts: no other reference may keep them
    gc.collect()
    model = _all_resident(loaded.model, device, rs)
    lengths = sorted({int(t) for t in rs["prompt_tokens"]})
    warmup = int(rs["warmup"])
    measured = [
        cal.time_fast_steps(
            model,
            make_loop=FastLoop,
            prompt_tokens=t,
            decode_steps=int(rs["decode_steps"]),
            repeats=cal.in_loop_repeats(rs),
            warmup=min(warmup, cal.MODEL_RUN_WARMUP),
            vocab_size=vocab,
        )  # fmt: skip
        for t in lengths
    ]
    return layers, lengths, measured, model


def _time_cpu_path_runs(model, rs: dict, vocab: int) -> tuple[list[tuple[int, int, int, tuple]], list[dict]]:
    """cost.runtime.step=fast: the fast loop's own CPU-path calls, where the runs make them (between the
    segments' replays, copies and GPU work around them): the offloaded model with every expert on the
    CPU (validate's all_cpu), then with the first half of every layer's experts resident (a fixed
    placement: calls of 1..K entries), under random forced routing (`calibration.time_fast_steps`),
    each call's host time the loop's own CPU-path timer (ExpertsTaps.cpu_log). Returns (the calls'
    log, the two runs' step timings); `calibration_fit.fit_cpu_path_fast` turns them into rows."""
    from moecache.validation.baselines import install_hindsight
    from moecache.validation.generation import FastLoop

    shape = model.moecache.manager.shape
    L, E = shape.num_layers, shape.num_experts
    keep = E // 2
    half_G = (np.arange(L)[:, None] * E + np.arange(keep)[None, :]).reshape(-1).astype(np.int64)
    log: list[tuple[int, int, int, tuple]] = []
    runs = []
    for slots in (0, len(half_G)):
        session = model.moecache.reconfigure(capacity=slots, policy="static_cold")
        if slots:
            install_hindsight(session.manager, half_G)
        prefill, decode = cal.time_fast_steps(
            model, make_loop=FastLoop, prompt_tokens=int(rs["cpu_path_prompt_tokens"]),
            decode_steps=int(rs["cpu_path_decode_steps"]), repeats=cal.in_loop_repeats(rs), warmup=1,
            vocab_size=vocab, cpu_log=log,
        )  # fmt: skip
        runs.append({"slots": slots, "prefill": prefill.as_dict(), "decode": decode.as_dict()})
    return log, runs


SPLIT_HOST_POLICY, SPLIT_HOST_CAPACITY = "lru", "25%"  # _split_host_fast's cache: most misses admitted


def _split_host_fast(model, section: dict, base: dict, rs: dict, vocab: int) -> dict:
    """cost.runtime.step=fast: on_miss="split"'s own host time, in the fast loop (the profile's
    runtime.split_host, docs/artifacts.md "The cost profile"): the offloaded model reconfigured to
    SPLIT_HOST_POLICY at SPLIT_HOST_CAPACITY with on_miss="split" weighing the profile measured and
    fitted so far (`base` with this `section`: the decisions are the ones a run with this profile
    makes), decoding under random forced routing (`calibration.time_fast_steps`) over
    cost.runtime.cpu_path_decode_steps decode steps; the manager's split counters over the timed
    generations (ManagerStats.split_*)."""
    from moecache.validation.generation import FastLoop

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
        model, make_loop=FastLoop, prompt_tokens=int(rs["cpu_path_prompt_tokens"]),
        decode_steps=int(rs["cpu_path_decode_steps"]), repeats=cal.in_loop_repeats(rs), warmup=1,
        vocab_size=vocab, timed_start=timed_start,
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


# _publish_lag_and_warmup_fast's cache: most visits copy
PUBLISH_LAG_POLICY, PUBLISH_LAG_CAPACITY = "lru", "25%"
PUBLISH_LAG_QUANTILES = 21  # runtime.publish_lag.quantiles_us: p0, p5, ..., p100


def _publish_lag_and_warmup_fast(model, rs: dict, vocab: int) -> tuple[dict | None, dict | None]:
    """cost.runtime.step=fast: (runtime.publish_lag, runtime.decode_warmup) of one run of the fast loop.
    publish_lag: the host time from a deferred visit's last copy enqueue to the next layer's publication
    (moecache/runtime/segments.py `_route`, timed.py 7.): the offloaded model reconfigured to
    PUBLISH_LAG_POLICY at PUBLISH_LAG_CAPACITY with on_miss="cpu" (every visit deferred), decoding under
    random forced routing (`calibration.time_fast_steps`) over cost.runtime.cpu_path_decode_steps decode
    steps; every lag of the timed generations, as PUBLISH_LAG_QUANTILES quantiles (the middle one the
    median); None where no deferred visit copied. decode_warmup: the same decoder's first decode steps
    (eager, then the capture), each as the time it took beyond a timed step's median (`pause_us`, >= 0:
    time the copy engine runs on while the host warms up; timed.py 8.); None where the decoder had no
    warm-up step."""
    from moecache.validation.generation import FastLoop

    model.moecache.reconfigure(capacity=PUBLISH_LAG_CAPACITY, policy=PUBLISH_LAG_POLICY, on_miss="cpu")
    lags_ns: list[int] = []
    warmup_us: list[float] = []
    _, decode = cal.time_fast_steps(
        model, make_loop=FastLoop, prompt_tokens=int(rs["cpu_path_prompt_tokens"]),
        decode_steps=int(rs["cpu_path_decode_steps"]), repeats=cal.in_loop_repeats(rs), warmup=1,
        vocab_size=vocab, publish_lag_log=lags_ns, warmup_log=warmup_us,
    )  # fmt: skip
    where = {"policy": PUBLISH_LAG_POLICY, "capacity": PUBLISH_LAG_CAPACITY, "timed": "fast_loop"}
    warmup = decode_warmup_row(warmup_us, decode.median_us, **where) if warmup_us else None
    if not lags_ns:
        return None, warmup
    lags_us = np.asarray(lags_ns, np.float64) / 1e3
    quantiles = np.percentile(lags_us, np.linspace(0.0, 100.0, PUBLISH_LAG_QUANTILES))
    return {"quantiles_us": [float(q) for q in quantiles], "visits": len(lags_ns), **where}, warmup


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
    """The profile's `runtime` section (docs/artifacts.md "The cost profile"). `step`: the decode loop of
    the non-expert time (step=transformers) and of the stand-in's in-model timings (default:
    cost.runtime.step from calibration.STEP_FUNCTIONS). `base`: the profile's other sections
    (measure's), for step=fast's cpu_step_excess and split_host rows (both weigh the whole profile);
    without it neither is computed."""
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
            kernel_rows.append(fit.timing_row({"tokens": int(tokens), "entries": entries}, timing))
    cpu_rows = []
    for m in rs["cpu_tokens_per_expert"]:
        for u in sorted({1, k}):
            bar.step(f"runtime cpu path M={m} U={u}")
            if in_model:
                timing = cal.time_cpu_path_in_model(*model_args, runtime, shape, int(m), u, *rw, **kw)
            else:
                timing = cal.time_cpu_path(runtime, shape, int(m), u, repeats, warmup)
            cpu_rows.append(fit.timing_row({"tokens_per_expert": int(m), "experts": u}, timing))
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
        visit_rows.append(fit.timing_row({"tokens": int(tokens), "copies_per_visit": per_visit}, timing))
        timing = cal.time_visit(resident.manager, shape, int(tokens), repeats, warmup)
        hit_rows.append(fit.timing_row({"tokens": int(tokens)}, timing))
        if in_model:
            timing = cal.time_layer_call_in_model(*model_args, visiting, shape, int(tokens), *rw, **kw)
        else:
            timing = cal.time_layer_call(visiting, shape, int(tokens), repeats, warmup)
        call_rows.append(fit.timing_row({"tokens": int(tokens)}, timing))
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
        layers, lengths, measured, model = _time_all_resident(loaded, rs, device, vocab)
        section["non_expert"] = fit.fit_non_expert_fast(
            section, layers, lengths, measured, int(rs["decode_steps"])
        )
        bar.step("runtime cpu path (fast loop)")
        log, runs = _time_cpu_path_runs(model, rs, vocab)
        multi = [r for r in section["cpu_path"] if r["tokens_per_expert"] != 1]
        prompt = int(rs["cpu_path_prompt_tokens"])
        section["cpu_path"], section["cpu_path_prefill"] = fit.fit_cpu_path_fast(log, multi, prompt, runs)
        if base is not None:  # both weigh the profile measured (and fitted) so far
            section["cpu_step_excess"] = fit.cpu_step_excess(section, base, rs)
            bar.step("runtime split host time (fast loop)")
            section["split_host"] = _split_host_fast(model, section, base, rs, vocab)
        bar.step("runtime publish lag and decoder warm-up (fast loop)")
        section["publish_lag"], section["decode_warmup"] = _publish_lag_and_warmup_fast(model, rs, vocab)
        del model
        gc.collect()
    if section["non_expert"] is None:
        section["non_expert_reason"] = reason
    return section
