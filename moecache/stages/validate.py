"""`moecache validate`: the decided policy end to end beside the baselines (issue 13, docs/validation.md).

Reads a decision artifact (`validate.decision`, null: the newest), runs on the `model` group's model (a
checkpoint, or random weights: moecache/models/random_full.py), for every workload of `validate.workloads`
(conf/workload/), or the workloads of `validate.forced_trace` (one per trace; moecache/validation/
forcing.py): first the unmodified model (the reference, before offloading; moecache/validation/
pipeline.py), then every strategy of `validate.strategies` (moecache/validation/baselines.py) at every
capacity of `validate.capacities` (the all_resident and all_cpu baselines once, at every expert / none).
Each run's routing trace is logged with the cache columns filled; its measurements (moecache/validation/
runs.py), its output agreement teacher-forced against transformers' own tolerance (moecache/validation/
agreement_runs.py) and the simulator's prediction of the same trace (moecache/validation/fidelity.py;
on profiles fitted on another workload's runs: moecache/validation/holdout.py) go to:

- `validation.json`: the inputs (decision, selected policy, model, device, execution path), every run,
  the agreement per workload and the fidelity per direction, each judged against its targets;
- `runs.parquet`, `agreement.parquet`, `fidelity.parquet`: the tables (moecache/validation/tables.py);
- `latency.parquet`: every generated token's latency (time to first token, then each gap);
- `traces/<workload>/<strategy>-c<slots>/trace.parquet`: the runs' traces (canonical format).
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from moecache.artifacts import Artifact, ArtifactStore, artifact_id
from moecache.config_values import boolean, integer, list_of, optional, string
from moecache.errors import MoecacheError
from moecache.stages.base import StageResult, prepare, reusable, store_for, torch_device

STAGE = "validate"
# validation.json's `execution` per validate.loop; each run's own path is its row's `loop`:
# transformers, fast-graphs (CUDA graphs between the host points) or fast-eager (eager steps: the CPU, or an
# unmodified model forced by its router hooks).
EXECUTION = {
    "transformers": "transformers generate (eager)",
    "fast": "moecache fast decode loop (FastDecoder; per run: the runs' loop column)",
}
# 3: runs.parquet and fidelity.parquet carry cpu_probe_change_pct; grouped_mm is the agreement baseline
# 4: runs.parquet carries decode_cpu_exec_us_per_call
# 5: validate.repeats; runs.parquet carries time_per_token_ms_repeats
# 6: the fast loop's traces carry the visits' cache columns; runs.parquet carries hit_rate_repeats
# 7: runs.parquet carries decode_publish_lag_us
# 8: runs.parquet carries warmup_gaps_ms; anchoring moves the profile's decoder warm-up too
SCHEMA_VERSION = 8
KEYS = (
    "decision", "workloads", "capacities", "strategies", "requests", "max_new_tokens", "cost_profile",
    "loop", "reference", "forced_trace", "forced_requests", "forced_max_tokens", "warmup", "on_miss", "init",
    "agreement_requests", "agreement_tokens", "agreement_impls", "agreement_float32", "repeats",
)  # fmt: skip
WARMUPS = ("auto", "on", "off")  # validate.warmup: an untimed generation per strategy first (auto: on
# CUDA, or where the runs' times are predicted: a cost profile given)


def _checked(c: dict) -> dict:
    """The validate group's values, each checked (one line naming the key on failure)."""
    from moecache.capacity import capacity_specs
    from moecache.validation.baselines import check_names

    v = c["validate"]
    unknown = sorted(set(v) - set(KEYS))
    if unknown:
        raise MoecacheError(f"validate.{unknown[0]}: unknown key; validate takes {', '.join(KEYS)}")
    optional(string)("validate.decision", v["decision"])
    list_of(string)("validate.workloads", v["workloads"])
    if len(set(v["workloads"])) != len(v["workloads"]):
        raise MoecacheError(f"validate.workloads={v['workloads']}: a workload is listed twice")
    capacity_specs(v["capacities"], key="validate.capacities")
    if not isinstance(v["capacities"], list):
        raise MoecacheError(f"validate.capacities={v['capacities']!r}: expected a list, e.g. ['25%']")
    check_names(v["strategies"])
    optional(integer(1))("validate.requests", v["requests"])
    optional(integer(1))("validate.max_new_tokens", v["max_new_tokens"])
    optional(string)("validate.cost_profile", v["cost_profile"])
    from moecache.validation.generation import LOOPS
    from moecache.validation.pipeline import REFERENCES

    for key, allowed in (("loop", LOOPS), ("reference", REFERENCES), ("warmup", WARMUPS)):
        if v[key] not in allowed:
            raise MoecacheError(f"validate.{key}={v[key]!r}: expected one of {', '.join(allowed)}")
    _forced_refs(v["forced_trace"])
    optional(integer(1))("validate.forced_requests", v["forced_requests"])
    optional(integer(1))("validate.forced_max_tokens", v["forced_max_tokens"])
    optional(string)("validate.init", v["init"])
    integer(0)("validate.agreement_requests", v["agreement_requests"])
    integer(1)("validate.repeats", v["repeats"])
    optional(integer(0))("validate.agreement_tokens", v["agreement_tokens"])
    from moecache.validation.agreement_runs import IMPLEMENTATIONS

    list_of(string)("validate.agreement_impls", v["agreement_impls"])
    boolean("validate.agreement_float32", v["agreement_float32"])
    for impl in v["agreement_impls"]:
        if impl not in IMPLEMENTATIONS:
            raise MoecacheError(
                f"validate.agreement_impls: {impl!r}: expected some of {', '.join(IMPLEMENTATIONS)} (transformers'"
                " implementations compared with its default grouped_mm path)"
            )
    if v["init"] is not None and not Path(v["init"]).exists():
        raise MoecacheError(f"validate.init={v['init']}: no such file or folder (a saved state or a trace)")
    if v["loop"] == "fast" and v["forced_trace"] is None:
        raise MoecacheError(
            "validate.loop=fast: needs validate.forced_trace (a replayed CUDA graph runs no routing hook, so "
            "the fast loop's traces are the forcing trace's rows; docs/validation.md)"
        )
    if v["reference"] == "all_resident" and "all_resident" not in v["strategies"]:
        raise MoecacheError("validate.reference=all_resident: validate.strategies must list all_resident")
    from moecache.validation.baselines import SELECTED_ON_MISS

    if v["on_miss"] is not None and v["on_miss"] not in SELECTED_ON_MISS:
        raise MoecacheError(
            f"validate.on_miss={v['on_miss']!r}: expected one of {', '.join(SELECTED_ON_MISS)} (or null: the"
            " decision's)"
        )
    return v


def _forced_refs(value) -> list[str]:
    """validate.forced_trace as a list of trace references: null (none), one, or a list of distinct ones
    (one workload each). One line on failure."""
    if value is None:
        return []
    refs = [value] if isinstance(value, str) else value
    list_of(string)("validate.forced_trace", refs)
    if len(set(refs)) != len(refs):
        raise MoecacheError(f"validate.forced_trace={list(refs)}: a trace is listed twice")
    return list(refs)


def _check_agreement_tokens(v: dict, forced) -> None:
    """validate.agreement_tokens must stay within the forcing trace: each request held to the tolerance
    (its first validate.agreement_requests) has that many tokens after its prompt. One line on failure."""
    n = v["agreement_tokens"]
    if n is None:
        return
    for req in forced.requests[: v["agreement_requests"]]:
        have = forced.forced.decode_steps(req.request_id)
        if n > have:
            raise MoecacheError(
                f"validate.agreement_tokens={n}: request {req.request_id!r} of the trace {forced.path} has"
                f" {have} tokens after its prompt"
            )


def _on_miss(v: dict, decision_json) -> str:
    """The selected policy's on_miss: validate.on_miss, else (null) the decision's (its sweep's
    sim.on_miss). One line on failure."""
    from moecache.sim.policy_spec import PolicySpec
    from moecache.validation.baselines import SELECTED_ON_MISS

    on_miss = v["on_miss"] if v["on_miss"] is not None else PolicySpec.on_miss_in(decision_json)
    if on_miss not in SELECTED_ON_MISS:
        raise MoecacheError(
            f"validate: the decision {decision_json} was judged with on_miss={on_miss}, which validate does"
            f" not run for the selected policy; set validate.on_miss to one of {', '.join(SELECTED_ON_MISS)}"
        )
    return on_miss


def _check_no_reader(strategies, selected) -> None:
    """Without validate.cost_profile, no run may need one (`offloading.cost_readers`): the selected
    policy's on_miss=split weighs copies against the CPU, a policy that weighs costs (impact) reads them."""
    from moecache.offloading import cost_readers

    for st in strategies:
        readers = cost_readers(st.on_miss, st.policy, on_miss_key="validate.on_miss")
        if readers:
            what = (
                "copies against the CPU"
                if readers[0].endswith("=split")
                else "measured costs (CPU, GPU, copy time)"
            )
            raise MoecacheError(
                f"{readers[0]}: weighs {what} with validate.cost_profile, which is null (the selected policy"
                f" {selected.label()}; a moecache calibrate profile of this machine)"
            )


def _decision(store: ArtifactStore, ref: str | None) -> Artifact:
    if ref:
        art = store.resolve(str(ref))
        if art.stage != "decide":
            raise MoecacheError(
                f"validate.decision={ref}: a {art.stage} artifact, expected a decide artifact"
            )
        return art
    art = store.latest("decide")
    if art is None:
        raise MoecacheError(
            f"validate.decision: no decide artifact under {store.root}/ (run `moecache decide`)"
        )
    return art


def _check_online(spec) -> None:
    """The selected policy must run in the runtime: known, its parameters valid, and online. Needs no
    model, so it runs before the model is loaded."""
    from moecache.sim.policy import make_policy
    from moecache.validation.baselines import HINDSIGHT

    if spec.name == HINDSIGHT:
        return  # runs as the hindsight placement (baselines.py)
    if make_policy(spec.name, **spec.params).offline:
        raise MoecacheError(
            f"decision selects {spec.label()}: an offline policy (it reads the future) cannot run in the runtime"
        )


def _check_runnable(spec, shape, slots: int, profile: str | None) -> None:
    """The selected policy must be buildable from the model's shape (and the cost profile, for a policy
    that weighs costs: the runtime binds it too); `_check_online` has passed."""
    from moecache.offloading import runtime_cost
    from moecache.sim.policy import make_policy
    from moecache.validation.baselines import HINDSIGHT

    if spec.name == HINDSIGHT:
        return
    policy = make_policy(spec.name, **spec.params)
    if policy.weighs_costs:  # as the runtime binds it (validate refused it without a profile before)
        policy.bind_cost(runtime_cost(profile, "cpu", policy, shape.expert_bytes, "validate.cost_profile"))
    policy.init_state(shape, slots)


def _profile_path(store: ArtifactStore, ref: str | None) -> str | None:
    """The cost_profile.json of validate.cost_profile (a bundled profile, a calibrate artifact or a JSON
    file), read and checked (errors name the key) before the model is loaded."""
    from moecache.sim.inputs import BUNDLED_PROFILES, load_profile

    if ref is None:
        return None
    resolved, _ = load_profile(store, ref, key="validate.cost_profile")
    if resolved.startswith("bundled:"):
        return str(BUNDLED_PROFILES / f"{resolved.split(':', 1)[1]}.json")
    if Path(resolved).is_file():
        return resolved
    return str(store.resolve(ref).path / "cost_profile.json")


def run(cfg: DictConfig) -> StageResult:
    from moecache.config import CONF_DIR
    from moecache.sim.policy_spec import PolicySpec
    from moecache.validation import fidelity
    from moecache.validation.baselines import build
    from moecache.validation.pipeline import Workload
    from moecache.validation.workloads import load_workload

    c = prepare(cfg, STAGE)
    v = _checked(c)
    store = store_for(cfg)
    device = torch_device(cfg)
    decision = _decision(store, v["decision"])
    selected = PolicySpec.selected_in(decision.path / "decision.json")
    forced_refs = []  # the forcing traces' identities (artifact ids or path@sha256)
    if v["forced_trace"] is not None:  # trace-forced workloads instead (moecache/validation/forcing.py)
        from moecache.sim.inputs import resolve_traces
        from moecache.trace.schema import read_trace

        for forced_trace in resolve_traces(store, _forced_refs(v["forced_trace"])):
            table, _ = read_trace(forced_trace.path, columns=["request_id"])  # every rule, before the model
            have = len(set(table["request_id"].to_pylist()))
            if v["forced_requests"] is not None and have < v["forced_requests"]:
                raise MoecacheError(
                    f"validate.forced_requests={v['forced_requests']}: the trace {forced_trace.path} has {have}"
                    " requests"
                )
            forced_refs.append(forced_trace.ref)
        workloads = []
    else:
        workloads = [Workload(n, wcfg=load_workload(n, CONF_DIR)) for n in v["workloads"]]
    strategies = build(v["strategies"], selected, _on_miss(v, decision.path / "decision.json"))
    if any(s.name == "selected" for s in strategies):
        _check_online(selected)
    if v["cost_profile"] is None:
        _check_no_reader(strategies, selected)
    profile = _profile_path(store, v["cost_profile"])
    fidelity.check_loop(profile, v["loop"])  # before the model is loaded

    import torch

    from moecache.capacity import parse_capacities
    from moecache.models import load_model
    from moecache.models.loading import describe_model
    from moecache.sim.shape import ModelShape

    # what the inputs are checked against, from the model's config alone (no weight read)
    arch, vocab = describe_model(cfg.model, cfg.output_root)
    for ref in _forced_refs(v["forced_trace"]):
        from moecache.validation.forcing import load_forced

        forced = load_forced(
            store, str(ref), num_requests=v["forced_requests"], max_tokens=v["forced_max_tokens"], arch=arch,
            vocab_size=int(vocab),
        )  # fmt: skip
        if v["loop"] == "fast" and not forced.forced.has_weights:
            raise MoecacheError(
                f"validate.loop=fast: the forcing trace {forced.path} has no router_weights (the fast "
                "loop writes the trace's weights at its host points); use validate.loop=transformers"
            )
        _check_agreement_tokens(v, forced)
        if forced.name in {w.name for w in workloads}:  # a workload's rows and traces are named after it
            raise MoecacheError(
                f"validate.forced_trace: two traces are named {forced.name!r} (the second {forced.path});"
                " import one under another trace_import.name"
            )
        workloads.append(Workload(forced.name, forced=forced))
    L, E = arch["num_layers"], arch["num_experts"]
    slots = parse_capacities(
        list(v["capacities"]), key="validate.capacities", num_keys=L * E, expert_bytes=arch["expert_bytes"]
    )
    shape = ModelShape(L, E, arch["top_k"], arch["expert_bytes"])
    if any(s.name == "selected" for s in strategies):
        _check_runnable(selected, shape, max(slots), profile)
    loaded = load_model(cfg.model, cfg.output_root, device)  # one model, on the device (pipeline.py)
    if c["model"].get("experts_implementation") is None and loaded.adapter.dtype != torch.bfloat16:
        loaded.model.set_experts_implementation("eager")  # grouped_mm (CUDA's default) is for bf16
    if loaded.adapter.describe() != arch:
        raise MoecacheError(
            f"validate: the loaded model is {loaded.adapter.describe()}, its config described {arch}"
        )
    config = {
        "validate": {
            **{k: v[k] for k in KEYS if k not in ("decision", "cost_profile")},
            "decision": decision.id,
        },
        "cost_profile": v["cost_profile"],
        "model": c["model"],
        "model_revision": loaded.revision,
        "seed": c["seed"],
        "device": device,
    }
    inputs = [decision.id, *forced_refs]
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(json.loads((existing / "validation.json").read_text()))
        )

    from moecache.cost_profile import CostProfile
    from moecache.validation import holdout, machine_check
    from moecache.validation.pipeline import Settings, validate_all
    from moecache.validation.tables import write

    run_id = artifact_id(STAGE, SCHEMA_VERSION, config, inputs)
    grid = list(zip([str(x) for x in v["capacities"]], slots, strict=True))
    with store.create(
        STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=int(c["seed"])
    ) as tmp:
        settings = Settings(
            device=device, seed=int(c["seed"]), loop=v["loop"], limit=v["requests"],
            max_new_tokens=v["max_new_tokens"], folder=tmp, run_id=run_id, profile=profile,
            reference=v["reference"], init=v["init"], agreement_requests=v["agreement_requests"],
            agreement_tokens=v["agreement_tokens"], agreement_impls=tuple(v["agreement_impls"]),
            agreement_float32=v["agreement_float32"], repeats=v["repeats"],
            warmup=v["warmup"] == "on" or (v["warmup"] == "auto" and (device == "cuda" or profile is not None)),
        )  # fmt: skip
        costs = None if profile is None else CostProfile.load(profile)
        runs_probe = None if costs is None else machine_check.RunProbe.of(costs)
        settings.run_probe = None if runs_probe is None else runs_probe.probe
        before = None if costs is None else machine_check.probe(costs)
        done = validate_all(loaded, arch, workloads, strategies, grid, settings)
        after = None if costs is None else machine_check.probe(costs)
        rows = done.rows
        write(tmp, rows, done.latencies, done.agreement, done.fidelity)
        result = {
            "decision": decision.id,
            "selected": {"policy": selected.name, "params": selected.params, "label": selected.label()},
            "model": c["model"]["name"],
            "model_revision": loaded.revision,
            "architecture": arch,
            "device": device,
            "execution": EXECUTION[v["loop"]],
            "execution_per_run": {
                f"{r['workload']}/{r['strategy']}@{r['capacity']}": r["loop"] for r in rows
            },
            "reference": (
                "unmodified: the model as loaded, every expert on the device, run before offloading"
                if v["reference"] == "unmodified"
                else "all_resident: the all_resident run (the model is not run unmodified)"
            ),
            "model_build": "random weights (model.random)"
            if loaded.revision.startswith("random:")
            else "checkpoint",
            "workloads": [w.name for w in workloads],
            "forced": [_forced_info(w.forced, ref) for w, ref in zip(workloads, forced_refs, strict=True)]
            if forced_refs
            else None,
            "capacities": [{"capacity": cap, "slots": n} for cap, n in grid],
            "strategies": [s.name for s in strategies],
            "cost_profile": profile,
            "machine_check": None if costs is None else machine_check.compare(costs, before, after),
            "runs": rows,
            # per workload: what was fed, the tolerance, how many runs are within it (agreement.parquet)
            "agreement": done.agreement_of,
            # per direction (fit_on -> predicted workload), judged against the targets (fidelity.parquet)
            "fidelity": holdout.summary(done.fidelity),
        }
        (tmp / "validation.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return StageResult(store.get(run_id).path, summary=_summary(result))


def _forced_info(forced, ref: str) -> dict:
    return {
        "trace": ref,
        "path": str(forced.path),
        "requests": [
            {
                "request_id": r.request_id,
                "prompt_tokens": len(r.prompt_ids),
                "max_new_tokens": r.max_new_tokens,
            }
            for r in forced.requests
        ],
        "has_router_weights": bool(forced.forced.has_weights),
    }


def _summary(result: dict) -> dict:
    out = {
        "decision": result["decision"],
        "selected": result["selected"]["label"],
        "runs": len(result["runs"]),
    }
    out["predicted"] = "hit rate, time per token" if result["cost_profile"] else "hit rate (no cost profile)"
    check = result.get("machine_check")
    for p in (check or {}).get("probes", []):
        out[f"machine since calibrate: {p['probe']}"] = (
            f"{p['change_pct_before']:+.1f}% before, {p['change_pct_after']:+.1f}% after"
        )
    if check is not None and check["changed"]:
        out["machine since calibrate"] = f"changed (beyond {check['change_target_pct']:.0f}%)"
    from moecache.validation.agreement_runs import BASELINE

    for workload, a in result["agreement"].items():
        out[f"{workload} agreement (teacher-forced, {a['positions']} positions)"] = (
            f"{a['runs_within']} of {a['runs']} runs within transformers' tolerance ("
            + ", ".join(
                f"{impl} vs {BASELINE}: max {t['max_abs_logit_error']:.3g}"
                for impl, t in a["tolerance"].items()
            )
            + ")"
            + (
                f"; {a['runs_within_float32_spread']} of {a['runs']} as close to float32 as transformers' own"
                if a["float32"] is not None
                else ""
            )
        )
    fid = result["fidelity"]
    target = fid["targets"]
    for d in fid["directions"]:
        out[f"fidelity {d['direction']}"] = _judged_line(d, target)
    if fid["held_out"] is not None:
        out["fidelity held out (every cross-workload direction)"] = _judged_line(fid["held_out"], target)
    anchored = [
        json.loads(r["fidelity_errors_anchored"]) for r in result["runs"] if r.get("fidelity_errors_anchored")
    ]
    judged = [e["time_within_target"] for e in anchored if e["time_within_target"] is not None]
    if judged:  # the same workload's anchors: its all_resident and all_cpu runs are fitted, not predicted
        out[f"time/token within {target['time_per_token_pct']:.0f}% (anchored on the same workload: its all_resident"
            " and all_cpu fitted)"] = f"{sum(judged)} of {len(judged)} runs"  # fmt: skip
    for r in result["runs"]:
        if r["strategy"] in ("unmodified", "all_resident", "all_cpu", "selected"):
            where = f"{r['workload']} {r['strategy']}" + (
                f" @{r['capacity']}" if r["strategy"] == "selected" else ""
            )
            tps = r["decode_tokens_per_s"]
            hit = r["hit_rate"]
            rate = "no decode step" if tps is None else f"{tps:.1f} tok/s"  # one token per request: a prefill
            out[where] = rate + (f", hit {hit:.3f}" if hit is not None else "")
    return out


def _judged_line(d: dict, target: dict) -> str:
    """One direction's (or the held-out runs') verdicts in one line (validation.json's fidelity)."""
    parts = []
    if d["time_judged"]:
        met = "met" if d["time_target_met"] else "MISSED"
        parts.append(
            f"time/token within {target['time_per_token_pct']:.0f}%: {d['time_within']} of {d['time_judged']}"
            f" (target {target['time_within_share']:.0%}: {met})"
        )
    if d["hit_rate_judged"]:
        met = "met" if d["hit_rate_target_met"] else "MISSED"
        parts.append(
            f"hit rate within {target['hit_rate_pp']:g} pp: {d['hit_rate_within']} of {d['hit_rate_judged']} ({met})"
        )
    return "; ".join(parts) or f"{d['predicted_runs']} runs, nothing predicted"
