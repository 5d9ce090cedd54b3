"""`moecache simulate`: replay traces through one placement policy at one or more capacities.

Writes `metrics.parquet` (one row per trace and capacity, the sweep's columns), `per_layer.parquet`
(hit rate per layer) and `per_request.parquet` (metrics per request).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig

from moecache.artifacts import artifact_id
from moecache.config import to_container
from moecache.errors import MoecacheError
from moecache.sim.inputs import load_profile, load_traces
from moecache.sim.metrics import per_layer, per_request
from moecache.sim.sweep import CostSettings, Job, run_job
from moecache.stages.base import StageResult, reusable, store_for

STAGE = "simulate"
SCHEMA_VERSION = 1
DEFAULT_POLICY = {"name": "lfu", "params": {}}


def cost_settings(sim: dict) -> CostSettings:
    return CostSettings(
        dtype=sim.get("dtype"),
        non_expert_us_per_layer=float(sim["non_expert_us_per_layer"]),
        bandwidth_scale=float(sim["bandwidth_scale"]),
        cpu_scale=float(sim["cpu_scale"]),
        gpu_scale=float(sim["gpu_scale"]),
    )


def run(cfg: DictConfig) -> StageResult:
    c = to_container(cfg)
    if c["capacity"] is None:
        raise MoecacheError("simulate needs capacity=N (GPU slots) or capacity=[N1,N2,...]")
    capacities = c["capacity"] if isinstance(c["capacity"], list) else [c["capacity"]]
    policy = c.get("policy") or DEFAULT_POLICY
    store = store_for(cfg)
    traces = load_traces(store, c["traces"])
    profile_ref, profile = load_profile(store, c["sim"]["cost_profile"])
    inputs = [t.ref for t in traces] + ([profile_ref] if profile_ref.startswith("calibrate-") else [])
    config = {"policy": policy, "capacities": capacities, "sim": c["sim"], "traces": [t.ref for t in traces]}
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(pq.read_table(existing / "metrics.parquet"))
        )

    settings = cost_settings(c["sim"])
    rows, layers, requests = [], [], []
    for index, t in enumerate(traces):
        for capacity in capacities:
            job = Job(
                index,
                policy["name"],
                dict(policy.get("params") or {}),
                int(capacity),
                c["sim"]["mode"],
                settings,
            )
            row, result, cost = run_job(t.trace, profile, job)
            rows.append(row)
            keys = {"trace": t.trace.name, "capacity": int(capacity)}
            by_layer = per_layer(t.trace, result)
            layers += [
                {**keys, **{name: values[i].item() for name, values in by_layer.items()}}
                for i in range(t.trace.num_layers)
            ]
            requests += [{**keys, **r} for r in per_request(t.trace, result, cost)]
    metrics = pa.Table.from_pylist(rows)
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=None) as tmp:
        pq.write_table(metrics, tmp / "metrics.parquet")
        pq.write_table(pa.Table.from_pylist(layers), tmp / "per_layer.parquet")
        pq.write_table(pa.Table.from_pylist(requests), tmp / "per_request.parquet")
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
