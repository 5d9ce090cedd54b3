"""`moecache sweep`: every policy of `sweep.policies` at every capacity of the grid, on every trace.

Writes `sweep.parquet` (one row per trace, policy parameters, mode, capacity and cost scales; the
columns of docs/simulator.md), `per_block.parquet` (the same replays' counts and time per block of
`sweep.block_forward_steps` forward steps of one request: what `moecache decide` bootstraps over),
`per_layer.parquet` (hit rate per layer, base costs), `targets.parquet` (the smallest swept capacity
at which each policy reaches each target hit rate), `grid.json` (the capacities swept per trace) and
`costs.json` (the base cost model of each trace: copy time, CPU/GPU tables). `policy=<name>` and
`capacity=...` restrict the sweep, which is how a Hydra multirun splits it:
`moecache sweep -m policy=lfu,lru capacity=16,64`. `capacity` takes the syntax of moecache/capacity.py
(slots, `25%`, `12GiB`, or a list), resolved per trace.

`sweep.workers` is not part of the artifact id: it changes how the replays are scheduled, not what they
compute (the table is in job order whatever the thread count).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moecache.artifacts import artifact_id
from moecache.errors import MoecacheError
from moecache.sim.inputs import load_profile, load_traces
from moecache.sim.metrics import per_block, per_layer
from moecache.sim.sweep import (
    SCALES,
    Job,
    base_rows,
    capacity_grid,
    capacity_to_target,
    cost_model,
    dense_capacities,
    run_jobs_with,
)
from moecache.stages.base import StageResult, prepare, profile_digest, reusable, store_for
from moecache.stages.simulate import check_policy, cost_settings, trace_capacities

STAGE = "sweep"
SCHEMA_VERSION = 2


def _policies(c: dict) -> dict[str, list[dict]]:
    if c.get("policy"):
        check_policy(c["policy"])
        return {c["policy"]["name"]: [dict(c["policy"].get("params") or {})]}
    policies = c["sweep"]["policies"]
    if not policies:
        raise MoecacheError("sweep.policies is empty: nothing to sweep")
    out = {name: [dict(p or {}) for p in params] for name, params in policies.items()}
    for name, param_sets in out.items():
        for i, params in enumerate(param_sets):
            check_policy({"name": name, "params": params}, where=f"sweep.policies.{name}[{i}]")
    return out


def _id_config(c: dict, policies: dict, inputs: list[str], profile_ref: str) -> dict:
    """The part of the config that determines the sweep's result (not `workers`: see the docstring)."""
    return {
        "sweep": {k: v for k, v in c["sweep"].items() if k != "workers"},
        "sim": c["sim"],
        "cost_profile_sha256": profile_digest(profile_ref),
        "policies": policies,
        "capacity": c["capacity"],
        "traces": inputs,
    }


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)
    sweep = c["sweep"]
    policies = _policies(c)
    store = store_for(cfg)
    traces = load_traces(store, c["traces"])
    fixed = [trace_capacities(c["capacity"], t.trace) for t in traces] if c["capacity"] is not None else None
    profile_ref, profile = load_profile(store, c["sim"]["cost_profile"])
    inputs = [t.ref for t in traces] + ([profile_ref] if profile_ref.startswith("calibrate-") else [])
    config = _id_config(c, policies, inputs, profile_ref)
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(existing, reused=True, summary=json.loads((existing / "summary.json").read_text()))

    base = cost_settings(c["sim"])
    grids, jobs = {}, []
    for index, t in enumerate(traces):
        if fixed is not None:
            caps = sens_caps = fixed[index]
        else:
            caps = capacity_grid(t.trace, **sweep["capacities"])
            dense = sweep["capacities"]
            sens_caps = dense_capacities(t.trace, dense["dense_multiple"], dense["dense_step"])
        grids[t.trace.name] = caps
        for name, param_sets in policies.items():
            for params in param_sets:
                for mode in sweep["modes"]:
                    jobs += [Job(index, name, params, cap, mode, base) for cap in caps]
                if name in sweep["sensitivity"]["policies"]:
                    for scale in sweep["sensitivity"]["scales"]:
                        jobs += [
                            Job(index, name, params, cap, "timed", base.scaled(**scale)) for cap in sens_caps
                        ]
    workers = int(sweep["workers"] or os.cpu_count() or 1)
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("replays", total=len(jobs))
        block_steps = sweep["block_forward_steps"]
        table, details = run_jobs_with(
            [t.trace for t in traces],
            profile,
            jobs,
            workers,
            lambda: progress.advance(task),
            lambda job, trace, result, cost: _detail(job, trace, result, cost, block_steps),
        )
    targets = capacity_to_target(table, [float(x) for x in sweep["targets"]])
    summary = {
        "traces": len(traces),
        "policy parameter sets": sum(len(v) for v in policies.values()),
        "replays": len(jobs),
        "accesses replayed": int(sum(traces[j.trace_index].trace.num_accesses for j in jobs)),
        "best timed ms/token (base costs)": _best(table),
    }
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=None) as tmp:
        pq.write_table(table, tmp / "sweep.parquet")
        blocks = [d["blocks"] for d in details]
        pq.write_table(_concat(table, range(len(details)), blocks, BLOCK_KEYS), tmp / "per_block.parquet")
        base_jobs = [i for i, d in enumerate(details) if d["layers"] is not None]
        layers = [details[i]["layers"] for i in base_jobs]
        pq.write_table(_concat(table, base_jobs, layers, LAYER_KEYS), tmp / "per_layer.parquet")
        pq.write_table(targets, tmp / "targets.parquet")
        (tmp / "grid.json").write_text(json.dumps(grids, indent=2) + "\n")
        costs = {t.trace.name: cost_model(t.trace, profile, base).describe() for t in traces}
        (tmp / "costs.json").write_text(json.dumps(costs, indent=2, default=str) + "\n")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return StageResult(store.get(artifact_id(STAGE, SCHEMA_VERSION, config, inputs)).path, summary=summary)


BLOCK_KEYS = ("trace", "workload", "label", "mode", "capacity", *SCALES)
LAYER_KEYS = ("trace", "label", "mode", "capacity")


def _is_base(job: Job) -> bool:
    return all(getattr(job.cost, s) == 1.0 for s in SCALES)


def _detail(job: Job, trace, result, cost, block_steps: int) -> dict:
    """Per block (every job) and per layer (base costs only) arrays of one replay."""
    layers = None
    if _is_base(job):
        by_layer = per_layer(trace, result)
        layers = {k: by_layer[k] for k in ("layer", "accesses", "hits", "hit_rate")}
    return {"blocks": per_block(trace, result, block_steps, cost), "layers": layers}


def _concat(table: pa.Table, rows, parts: list[dict], keys: tuple[str, ...]) -> pa.Table:
    """One table of detail arrays, parts[i] led by the key columns of sweep row rows[i]."""
    sizes = [len(next(iter(p.values()))) for p in parts]
    out = table.select(list(keys)).take(pa.array(np.repeat(np.asarray(rows, np.int64), sizes), pa.int64()))
    for name in parts[0] if parts else ():
        merged = np.concatenate([p[name] for p in parts])
        out = out.append_column(name, pa.array(merged, from_pandas=merged.dtype.kind == "f"))
    return out


def _best(table) -> str:
    base = base_rows(table, "timed")
    if base.num_rows == 0 or base["est_ms_per_token"].null_count == base.num_rows:
        return "n/a"
    i = pc.index(base["est_ms_per_token"], pc.min(base["est_ms_per_token"])).as_py()
    r = base.slice(i, 1).to_pylist()[0]
    return f"{r['est_ms_per_token']:.4g} ({r['label']}, C={r['capacity']}, {r['trace']})"
