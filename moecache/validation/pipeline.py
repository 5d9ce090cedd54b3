"""All runs of one workload: the unmodified model first (it fixes the requests, gives the reference
outputs and the trace whose counts make the hindsight placement), then every strategy at every capacity.
Each run's trace goes to `<folder>/traces/<workload>/<strategy>-c<slots>/trace.parquet`; its row names it
relative to `folder` (the artifact)."""

from __future__ import annotations

from pathlib import Path

from moecache.trace.schema import TraceMeta
from moecache.validation import predict
from moecache.validation.baselines import Strategy, hindsight_keys
from moecache.validation.runs import Outputs, Request, RunSpec, measure
from moecache.validation.workloads import request_stream


def _meta(loaded, workload: str, spec: RunSpec, device: str) -> TraceMeta:
    a = loaded.adapter
    return TraceMeta(
        num_layers=a.num_layers, num_experts=a.num_experts, top_k=a.top_k, expert_bytes=a.expert_bytes,
        model=loaded.path.name, source=f"validate:{workload}",
        run={
            "workload": workload, "strategy": spec.label, "capacity": spec.capacity, "slots": spec.slots,
            "policy": spec.strategy.policy.label() if spec.strategy else None,
            "on_miss": spec.strategy.on_miss if spec.strategy else None, "device": device,
        },
    )  # fmt: skip


def validate_workload(
    loaded, workload: str, wcfg, strategies: list[Strategy], grid: list[tuple[str, int]], *, device: str,
    seed: int, limit: int | None, max_new_tokens: int | None, folder: Path, run_id: str, profile: str | None,
) -> tuple[list[dict], list[dict]]:  # fmt: skip
    from moecache.sim.policies.lfu import key_counts
    from moecache.sim.trace_arrays import load_trace

    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    new_tokens = int(max_new_tokens or wcfg.max_new_tokens)
    num_keys = loaded.adapter.num_layers * loaded.adapter.num_experts
    rows, latencies = [], []

    def one(spec: RunSpec, requests, reference, hindsight=None, outputs=None):
        trace_dir = (
            folder
            / "traces"
            / workload
            / ("unmodified" if spec.strategy is None else f"{spec.label}-c{spec.slots}")
        )
        outcome = measure(
            loaded.model, spec, requests, device=device, max_new_tokens=new_tokens, pad_id=pad_id,
            trace_dir=trace_dir, meta=_meta(loaded, workload, spec, device), run_id=run_id,
            reference=reference, hindsight_G=hindsight, outputs=outputs,
        )  # fmt: skip
        trace = trace_dir / "trace.parquet"
        row = {**outcome.row, "trace": str(trace.relative_to(folder))}
        if spec.strategy is None:
            row.update(predict.EMPTY)
        else:
            row.update(predict.predict(trace, spec.strategy.sim_policy, spec.slots, profile, row))
        rows.append(row)
        latencies.extend(outcome.latencies)
        return outcome, trace

    made: list[Request] = []
    answers = Outputs()
    stream = request_stream(wcfg, seed, tokenizer, limit, answers, made)
    reference, ref_trace = one(RunSpec(workload, None, None, None), stream, None, outputs=answers)
    count_G = key_counts(load_trace(ref_trace))
    for strategy in strategies:
        fixed = strategy.fixed_capacity
        points = [(fixed, num_keys if fixed == "all" else 0)] if fixed else grid
        for capacity, slots in points:
            hindsight = hindsight_keys(count_G, slots) if strategy.hindsight else None
            one(RunSpec(workload, strategy, capacity, slots), made, reference.outputs, hindsight)
    return rows, latencies
