"""`moecache validate`: the decided policy end to end beside the baselines (issue 13, docs/validation.md).

Reads a decision artifact (`validate.decision`, null: the newest), runs on the `model` group's model (a
checkpoint, or random weights: moecache/models/random_full.py), for every workload of `validate.workloads`
(conf/workload/), or the one workload of `validate.forced_trace` (moecache/validation/forcing.py): first
the unmodified model (the reference, before offloading; moecache/validation/pipeline.py), then
every strategy of `validate.strategies` (moecache/validation/baselines.py) at every capacity of
`validate.capacities` (the all_resident and all_cpu baselines once, at every expert / none). Each run's
routing trace is logged with the cache columns filled; its measurements (moecache/validation/runs.py) and,
where moecache/validation/fidelity.py exists, the simulator's prediction for the same trace, go to:

- `validation.json`: the inputs (decision, selected policy, model, device, execution path) and every run;
- `runs.parquet`: the same runs as a table (moecache/validation/tables.py);
- `latency.parquet`: every generated token's latency (time to first token, then each gap);
- `traces/<workload>/<strategy>-c<slots>/trace.parquet`: the runs' traces (canonical format).
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from moecache.artifacts import Artifact, ArtifactStore, artifact_id
from moecache.config_values import integer, list_of, optional, string
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
SCHEMA_VERSION = 1
KEYS = (
    "decision", "workloads", "capacities", "strategies", "requests", "max_new_tokens", "cost_profile",
    "loop", "reference", "forced_trace", "forced_requests", "forced_max_tokens", "warmup", "on_miss", "init",
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
    optional(string)("validate.forced_trace", v["forced_trace"])
    optional(integer(1))("validate.forced_requests", v["forced_requests"])
    optional(integer(1))("validate.forced_max_tokens", v["forced_max_tokens"])
    optional(string)("validate.init", v["init"])
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
    forced_ref = None
    if v["forced_trace"] is not None:  # one trace-forced workload instead (moecache/validation/forcing.py)
        from moecache.sim.inputs import resolve_traces
        from moecache.trace.schema import read_trace

        (forced_trace,) = resolve_traces(store, [str(v["forced_trace"])])
        table, _ = read_trace(forced_trace.path, columns=["request_id"])  # every rule, before the model loads
        have = len(set(table["request_id"].to_pylist()))
        if v["forced_requests"] is not None and have < v["forced_requests"]:
            raise MoecacheError(
                f"validate.forced_requests={v['forced_requests']}: the trace {forced_trace.path} has {have} requests"
            )
        forced_ref = forced_trace.ref
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
    if v["forced_trace"] is not None:
        from moecache.validation.forcing import load_forced

        forced = load_forced(
            store, str(v["forced_trace"]), num_requests=v["forced_requests"],
            max_tokens=v["forced_max_tokens"], arch=arch, vocab_size=int(vocab),
        )  # fmt: skip
        if v["loop"] == "fast" and not forced.forced.has_weights:
            raise MoecacheError(
                f"validate.loop=fast: the forcing trace {forced.path} has no router_weights (the fast "
                "loop writes the trace's weights at its host points); use validate.loop=transformers"
            )
        workloads = [Workload(forced.name, forced=forced)]
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
    inputs = [decision.id] + ([forced_ref] if forced_ref else [])
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(json.loads((existing / "validation.json").read_text()))
        )

    from moecache.cost_profile import CostProfile
    from moecache.validation import machine_check
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
            reference=v["reference"], init=v["init"],
            warmup=v["warmup"] == "on" or (v["warmup"] == "auto" and (device == "cuda" or profile is not None)),
        )  # fmt: skip
        costs = None if profile is None else CostProfile.load(profile)
        before = None if costs is None else machine_check.probe(costs)
        rows, latencies = validate_all(loaded, arch, workloads, strategies, grid, settings)
        after = None if costs is None else machine_check.probe(costs)
        write(tmp, rows, latencies)
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
            "forced": _forced_info(workloads[0].forced, forced_ref) if forced_ref else None,
            "capacities": [{"capacity": cap, "slots": n} for cap, n in grid],
            "strategies": [s.name for s in strategies],
            "cost_profile": profile,
            "machine_check": None if costs is None else machine_check.compare(costs, before, after),
            "runs": rows,
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
    for key, what in (
        ("fidelity_errors", "calibrate's profile"),
        ("fidelity_errors_anchored", "anchored here"),
    ):
        errors = [json.loads(r[key]) for r in result["runs"] if r.get(key)]
        judged = [e["time_within_target"] for e in errors if e["time_within_target"] is not None]
        if judged:
            target = errors[0]["time_target_pct"]
            out[f"time/token within {target:.0f}% ({what})"] = f"{sum(judged)} of {len(judged)} runs"
    for r in result["runs"]:
        if r["strategy"] in ("unmodified", "all_resident", "all_cpu", "selected"):
            where = f"{r['workload']} {r['strategy']}" + (
                f" @{r['capacity']}" if r["strategy"] == "selected" else ""
            )
            tps = r["decode_tokens_per_s"]
            hit = r["hit_rate"]
            out[where] = (
                f"{tps:.1f} tok/s"
                + (f", hit {hit:.3f}" if hit is not None else "")
                + (f", match {r['token_match_rate']:.3f}" if r["token_match_rate"] is not None else "")
            )
    return out
