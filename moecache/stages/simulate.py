"""`moecache simulate`: replay traces through one placement policy at one or more capacities.

Writes `metrics.parquet` (one row per trace and capacity, the sweep's columns), `per_layer.parquet`
(hit rate per layer) and `per_request.parquet` (metrics per request).

`capacity` takes the one capacity syntax of moecache/capacity.py (slots, `25%`, `12GiB`, or a list); a
percentage or a budget resolves per trace, from the trace's own expert count and size. Every config
value is checked before a trace is read, and every capacity against each trace's metadata before the
first replay.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig

from moecache.arrow_numpy import table_from_rows
from moecache.artifacts import artifact_id
from moecache.capacity import parse_capacities
from moecache.errors import MoecacheError
from moecache.sim.inputs import load_profile, load_traces
from moecache.sim.metrics import per_layer, per_request
from moecache.sim.policy import make_policy
from moecache.sim.sweep import CostSettings, Job, run_job
from moecache.stages.base import StageResult, prepare, profile_digest, reusable, store_for

STAGE = "simulate"
SCHEMA_VERSION = 1
DEFAULT_POLICY = {"name": "lfu", "params": {}}


def cost_settings(sim: dict) -> CostSettings:
    """The cost model's settings from the `sim` group (its values checked by moecache/config_values.py)."""
    return CostSettings(
        dtype=sim.get("dtype"),
        non_expert_us_per_layer=float(sim["non_expert_us_per_layer"]),
        bandwidth_scale=float(sim["bandwidth_scale"]),
        cpu_scale=float(sim["cpu_scale"]),
        gpu_scale=float(sim["gpu_scale"]),
        on_miss=str(sim.get("on_miss", "cpu")),
    )


def check_policy(policy: dict, where: str = "policy") -> None:
    """The policy's name and parameters, checked by the policy registry before any trace is read."""
    if not isinstance(policy, dict) or "name" not in policy:
        raise MoecacheError(
            f"{where}: expected policy=<name> (conf/policy/) or {{name: ..., params: {{...}}}}"
        )
    params = policy.get("params") or {}
    if not isinstance(params, dict):
        raise MoecacheError(f"{where}.params={params!r}: expected a mapping of parameter names to values")
    make_policy(policy["name"], **params)


def trace_capacities(value, trace) -> list[int]:
    """`capacity` (one value or a list, moecache/capacity.py) as slot counts for this trace."""
    return parse_capacities(
        value,
        key="capacity",
        num_keys=trace.num_layers * trace.num_experts,
        expert_bytes=trace.expert_bytes or None,
    )


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)
    capacities = c["capacity"] if isinstance(c["capacity"], list) else [c["capacity"]]
    policy = c.get("policy") or DEFAULT_POLICY
    check_policy(policy)
    store = store_for(cfg)
    traces = load_traces(store, c["traces"])
    slots = [trace_capacities(c["capacity"], t.trace) for t in traces]
    profile_ref, profile = load_profile(store, c["sim"]["cost_profile"])
    inputs = [t.ref for t in traces] + ([profile_ref] if profile_ref.startswith("calibrate-") else [])
    config = {
        "policy": policy,
        "capacities": capacities,
        "sim": c["sim"],
        "cost_profile_sha256": profile_digest(profile_ref),
        "traces": [t.ref for t in traces],
    }
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(pq.read_table(existing / "metrics.parquet"))
        )

    settings = cost_settings(c["sim"])
    rows, layers, requests = [], [], []
    for index, t in enumerate(traces):
        for capacity in slots[index]:
            job = Job(
                index,
                policy["name"],
                dict(policy.get("params") or {}),
                capacity,
                c["sim"]["mode"],
                settings,
            )
            row, result, cost = run_job(t.trace, profile, job)
            rows.append(row)
            keys = {"trace": t.trace.name, "capacity": capacity}
            by_layer = per_layer(t.trace, result)
            layers += [
                {**keys, **{name: values[i].item() for name, values in by_layer.items()}}
                for i in range(t.trace.num_layers)
            ]
            requests += [{**keys, **r} for r in per_request(t.trace, result, cost)]
    metrics = table_from_rows(rows)
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=None) as tmp:
        pq.write_table(metrics, tmp / "metrics.parquet")
        pq.write_table(table_from_rows(layers), tmp / "per_layer.parquet")
        pq.write_table(table_from_rows(requests), tmp / "per_request.parquet")
    return StageResult(
        store.get(artifact_id(STAGE, SCHEMA_VERSION, config, inputs)).path, summary=_summary(metrics)
    )


def _summary(metrics: pa.Table) -> dict:
    out = {}
    for r in metrics.to_pylist():
        key = f"{r['trace']} {r['label']} C={r['capacity']}"
        est = r.get("est_ms_per_token")
        out[key] = f"hit {r['hit_rate']:.3f}" + (f", {est:.3f} ms/token" if est is not None else "")
    return out
