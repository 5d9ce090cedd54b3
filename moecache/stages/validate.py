"""`moecache validate`: the decided policy end to end beside the baselines (issue 13, docs/validation.md).

Reads a decision artifact (`validate.decision`, null: the newest), runs on the `model` group's model, for
every workload of `validate.workloads` (conf/workload/): first the unmodified model (the reference), then
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
SCHEMA_VERSION = 1
KEYS = ("decision", "workloads", "capacities", "strategies", "requests", "max_new_tokens", "cost_profile")


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
    return v


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


def _selected(decision: Artifact):
    from moecache.sim.policy_spec import PolicySpec

    path = decision.path / "decision.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"{path}: cannot read the decision ({' '.join(str(exc).split())})") from exc
    if not isinstance(d, dict) or not isinstance(d.get("selected"), dict):
        raise MoecacheError(f"{path}: no `selected: {{policy, params}}` object")
    return PolicySpec.from_dict(d["selected"], f"{path}: selected")


def _check_runnable(spec, shape, slots: int) -> None:
    """The selected policy must run in the runtime: online, and buildable without a replay's costs."""
    from moecache.sim.policy import make_policy
    from moecache.validation.baselines import HINDSIGHT

    if spec.name == HINDSIGHT:
        return  # runs as the hindsight placement (baselines.py)
    policy = make_policy(spec.name, **spec.params)
    if policy.offline:
        raise MoecacheError(
            f"decision selects {spec.label()}: an offline policy (it reads the future) cannot run in the runtime"
        )
    policy.init_state(shape, slots)


def _profile_path(store: ArtifactStore, ref: str | None) -> str | None:
    if ref is None:
        return None
    if Path(ref).is_file():
        return str(Path(ref))
    art = store.resolve(ref)
    path = art.path / "cost_profile.json"
    if not path.is_file():
        raise MoecacheError(f"validate.cost_profile={ref}: {art.path} holds no cost_profile.json")
    return str(path)


def run(cfg: DictConfig) -> StageResult:
    from moecache.config import CONF_DIR
    from moecache.validation.baselines import build
    from moecache.validation.workloads import load_workload

    c = prepare(cfg, STAGE)
    v = _checked(c)
    store = store_for(cfg)
    device = torch_device(cfg)
    decision = _decision(store, v["decision"])
    selected = _selected(decision)
    workloads = {name: load_workload(name, CONF_DIR) for name in v["workloads"]}
    strategies = build(v["strategies"], selected)
    profile = _profile_path(store, v["cost_profile"])

    from moecache.capacity import parse_capacities
    from moecache.models import load_model
    from moecache.sim.shape import ModelShape

    loaded = load_model(cfg.model, cfg.output_root, "cpu")  # runs copy it; only what stays goes to device
    arch = loaded.adapter.describe()
    L, E = arch["num_layers"], arch["num_experts"]
    slots = parse_capacities(
        list(v["capacities"]), key="validate.capacities", num_keys=L * E, expert_bytes=arch["expert_bytes"]
    )
    shape = ModelShape(L, E, arch["top_k"], arch["expert_bytes"])
    if any(s.name == "selected" for s in strategies):
        _check_runnable(selected, shape, max(slots))
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
    inputs = [decision.id]
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(json.loads((existing / "validation.json").read_text()))
        )

    from moecache.validation import predict
    from moecache.validation.pipeline import validate_workload
    from moecache.validation.runs import EXECUTION
    from moecache.validation.tables import write

    run_id = artifact_id(STAGE, SCHEMA_VERSION, config, inputs)
    grid = list(zip([str(x) for x in v["capacities"]], slots, strict=True))
    with store.create(
        STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=int(c["seed"])
    ) as tmp:
        rows, latencies = [], []
        for name, wcfg in workloads.items():
            w_rows, w_lat = validate_workload(
                loaded, name, wcfg, strategies, grid, device=device, seed=int(c["seed"]),
                limit=v["requests"], max_new_tokens=v["max_new_tokens"], folder=tmp, run_id=run_id,
                profile=profile,
            )  # fmt: skip
            rows += w_rows
            latencies += w_lat
        write(tmp, rows, latencies)
        result = {
            "decision": decision.id,
            "selected": {"policy": selected.name, "params": selected.params, "label": selected.label()},
            "model": c["model"]["name"],
            "model_revision": loaded.revision,
            "architecture": arch,
            "device": device,
            "execution": EXECUTION,
            "workloads": list(workloads),
            "capacities": [{"capacity": cap, "slots": n} for cap, n in grid],
            "strategies": [s.name for s in strategies],
            "fidelity": predict.MODULE if predict.available() else None,
            "cost_profile": profile,
            "runs": rows,
        }
        (tmp / "validation.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return StageResult(store.get(run_id).path, summary=_summary(result))


def _summary(result: dict) -> dict:
    out = {
        "decision": result["decision"],
        "selected": result["selected"]["label"],
        "runs": len(result["runs"]),
    }
    out["predicted"] = "yes" if result["fidelity"] else "no (moecache/validation/fidelity.py absent)"
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
