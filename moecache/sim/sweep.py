"""Replay a grid of (trace, policy, parameters, capacity, mode, cost scales) and tabulate the metrics.

Each trace is loaded once; replays run on a thread pool (the compiled replay loops release the GIL).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from moecache.cost_profile import CostProfile
from moecache.errors import MoecacheError
from moecache.sim.cost_model import CostModel
from moecache.sim.metrics import summarize
from moecache.sim.policy import make_policy
from moecache.sim.replay import check_capacity, replay_instant
from moecache.sim.timed import replay_timed
from moecache.sim.trace_arrays import TraceArrays

MODES = ("instant", "timed")
SCALES = ("bandwidth_scale", "cpu_scale", "gpu_scale")


@dataclass(frozen=True, kw_only=True)
class CostSettings:
    dtype: str | None = None
    non_expert_us_per_layer: float = 0.0
    bandwidth_scale: float = 1.0
    cpu_scale: float = 1.0
    gpu_scale: float = 1.0
    on_miss: str = "cpu"  # what a timed replay's misses do (timed.py: cpu, wait, split)

    def scaled(self, **scales: float) -> CostSettings:
        return CostSettings(**{**self.__dict__, **scales})


@dataclass(frozen=True)
class Job:
    trace_index: int
    policy: str
    params: dict = field(hash=False)
    capacity: int
    mode: str
    cost: CostSettings


def dense_capacities(trace: TraceArrays, dense_multiple: float, dense_step: int | None) -> list[int]:
    """0, dense_step, 2 x dense_step, ... up to dense_multiple x (layers x top_k) slots."""
    per_token = trace.num_layers * trace.top_k
    step = int(dense_step) if dense_step else max(1, per_token // 2)
    if step < 1:
        raise MoecacheError(f"sweep.capacities.dense_step={dense_step}: must be at least 1")
    return list(range(0, min(trace.num_keys, int(dense_multiple * per_token)) + 1, step))


def capacity_grid(
    trace: TraceArrays, dense_multiple: float, dense_step: int | None, fractions: list[float]
) -> list[int]:
    """Every `dense_step` slots up to `dense_multiple` x (layers x top_k), then fractions of all keys."""
    grid = set(dense_capacities(trace, dense_multiple, dense_step))
    for f in fractions:
        if not 0 <= f <= 1:
            raise MoecacheError(f"sweep.capacities.fractions: {f} is not a fraction in [0, 1]")
        grid.add(int(round(f * trace.num_keys)))
    return sorted(grid)


def cost_model(trace: TraceArrays, profile: CostProfile, settings: CostSettings) -> CostModel:
    return CostModel.from_profile(
        profile,
        expert_bytes=trace.expert_bytes,
        max_tokens=int(trace.uses_A.max()) if trace.num_accesses else 1,
        dtype=settings.dtype,
        non_expert_us_per_layer=settings.non_expert_us_per_layer,
        bandwidth_scale=settings.bandwidth_scale,
        cpu_scale=settings.cpu_scale,
        gpu_scale=settings.gpu_scale,
    )


def run_job(trace: TraceArrays, profile: CostProfile, job: Job) -> tuple[dict, object, CostModel]:
    if job.mode not in MODES:
        raise MoecacheError(f"mode={job.mode!r}: expected one of {list(MODES)}")
    check_capacity(trace, job.capacity)
    if job.mode == "instant" and job.cost.on_miss != "cpu":
        raise MoecacheError(
            f"sim.on_miss={job.cost.on_miss}: only a timed replay has copies to wait for (sim.mode=timed)"
        )
    policy = make_policy(job.policy, **job.params)
    cost = cost_model(trace, profile, job.cost)
    policy.bind_cost(cost)
    if job.mode == "instant":
        result = replay_instant(trace, policy, job.capacity)
    else:
        result = replay_timed(trace, policy, job.capacity, cost, on_miss=job.cost.on_miss)
    metrics = summarize(trace, result, cost)
    row = {
        "trace": trace.name,
        "workload": trace.workload,
        "policy": job.policy,
        "params": json.dumps(job.params, sort_keys=True),
        "label": policy.label(),
        "mode": job.mode,
        "capacity": job.capacity,
        "capacity_fraction": job.capacity / trace.num_keys,
        **{s: getattr(job.cost, s) for s in SCALES},
        **metrics,
    }
    return row, result, cost


def run_jobs(
    traces: list[TraceArrays], profile: CostProfile, jobs: list[Job], workers: int, progress=None
) -> pa.Table:
    """All jobs' metric rows as one table, in job order (deterministic whatever the thread count)."""
    return run_jobs_with(traces, profile, jobs, workers, progress)[0]


def run_jobs_with(
    traces: list[TraceArrays],
    profile: CostProfile,
    jobs: list[Job],
    workers: int,
    progress=None,
    extra: Callable[[Job, TraceArrays, object, CostModel], object] | None = None,
) -> tuple[pa.Table, list]:
    """(the metric rows as one table, extra(job, trace, result, cost) of every job), both in job order
    (deterministic whatever the thread count). `extra` computes per-job detail (per block, per layer)
    while the replay's result is in memory."""

    def one(job: Job) -> tuple[dict, object]:
        trace = traces[job.trace_index]
        row, result, cost = run_job(trace, profile, job)
        detail = extra(job, trace, result, cost) if extra is not None else None
        if progress is not None:
            progress()
        return row, detail

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(one, jobs))
    else:
        done = [one(job) for job in jobs]
    return pa.Table.from_pylist([row for row, _ in done]), [detail for _, detail in done]


def base_rows(table: pa.Table, mode: str | None = None) -> pa.Table:
    """The rows at the base cost scales (every *_scale column the table has equals 1.0), and of
    `mode` when given: the sweep rows every decision and figure reads (not the sensitivity rows)."""
    masks = [pc.equal(table["mode"], mode)] if mode is not None else []
    masks += [pc.equal(table[s], 1.0) for s in SCALES if s in table.column_names]
    if not masks:
        return table
    keep = masks[0]
    for mask in masks[1:]:
        keep = pc.and_(keep, mask)
    return table.filter(pc.fill_null(keep, False))


def capacity_to_target(table: pa.Table, targets: list[float]) -> pa.Table:
    """Per (trace, policy label, mode, scales) and target hit rate: the smallest swept capacity whose
    hit rate reaches the target (null when none does)."""
    rows = table.select(["trace", "label", "mode", *SCALES, "capacity", "hit_rate"]).to_pylist()
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        key = (r["trace"], r["label"], r["mode"], *(r[s] for s in SCALES))
        groups.setdefault(key, []).append((r["capacity"], r["hit_rate"]))
    out = []
    for key, points in groups.items():
        points.sort()
        for target in targets:
            reached = [c for c, h in points if h is not None and h >= target]
            out.append(
                {
                    "trace": key[0],
                    "label": key[1],
                    "mode": key[2],
                    **dict(zip(SCALES, key[3:], strict=True)),
                    "target_hit_rate": float(target),
                    "capacity": int(min(reached)) if reached else None,
                }
            )
    return pa.Table.from_pylist(out)
