"""Where the runtime's hits and the simulator's differ, access by access: each run of a validate artifact
(its trace with the visits' cache columns: every fast-loop or transformers-loop offloaded run) replayed
through the simulator as validate predicts it (timed on the cost profile; instant without one), and every
access of every layer visit compared, hit or miss on each side. The disagreements are counted by kind
(the runtime hit what the replay missed, or the reverse), by whether the key was admitted at the
previous layer's visit of the same forward step (a prefetch for this layer, which the replay's deferred
visit never lands in time), by phase, and by layer; a table and one JSON line.

    python benchmarks/compare_hits.py --validation VALIDATION_JSON --traces TRACES_ROOT \
        [--profile PROFILE] [--strategies selected]

TRACES_ROOT holds the runs' `traces/...` paths (the artifact's folder, or where h200_round's
traces_<tag>.tgz was unpacked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np


def runtime_visits(table) -> dict:
    """{(request id, step, layer): (hit experts, experts admitted there as global keys)} of a trace
    table whose cache columns are filled; raises where a routed row has none."""
    visits: dict = {}
    cols = {
        c: table[c].to_pylist()
        for c in ("request_id", "step_index", "layer_id", "expert_ids", "cache_hit", "admitted")
    }
    for rid, step, layer, ids, hits, admitted in zip(*cols.values(), strict=True):
        if hits is None:
            raise ValueError(f"request {rid!r} step {step} layer {layer}: no cache columns (a fused layer?)")
        key = (str(rid), int(step), int(layer))
        hit_set, admit_set = visits.setdefault(key, (set(), set()))
        hit_set.update(int(e) for e, h in zip(ids, hits, strict=True) if h)
        admit_set.update(int(g) for g in admitted or ())
    return visits


def compare(trace, hit_A: np.ndarray, visits: dict) -> dict:
    """Access by access: the replay's `hit_A` of TraceArrays `trace` against the runtime's `visits`."""
    E = trace.num_experts
    counts: Counter = Counter()
    by_layer: Counter = Counter()
    for s in range(trace.num_steps):
        rid, step, layer = trace.request_ids[trace.request_V[s]], int(trace.step_V[s]), int(trace.layer_V[s])
        hits, _ = visits[(rid, step, layer)]
        prev = visits.get((rid, step, layer - 1))
        prefetched = prev[1] if prev is not None else set()
        phase = "prefill" if trace.phase_V[s] == 0 else "decode"
        for a in range(int(trace.start_V[s]), int(trace.start_V[s + 1])):
            key = int(trace.key_A[a])
            runtime, replay = (key - layer * E) in hits, bool(hit_A[a])
            counts["accesses"] += 1
            counts["runtime_hits"] += runtime
            counts["replay_hits"] += replay
            if runtime == replay:
                continue
            kind = "runtime_only" if runtime else "replay_only"
            counts[kind] += 1
            counts[f"{kind}_admitted_at_previous_layer"] += key in prefetched
            counts[f"{kind}_{phase}"] += 1
            by_layer[(kind, layer)] += 1
    top = sorted(by_layer.items(), key=lambda kv: -kv[1])[:5]
    return {
        **dict(counts),
        "top_layers": [{"kind": k, "layer": layer, "accesses": n} for (k, layer), n in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validation", required=True, type=Path, help="a validate artifact's validation.json")
    ap.add_argument("--traces", required=True, type=Path, help="the folder its runs' `trace` paths are under")
    ap.add_argument("--profile", type=Path, help="the cost profile to replay on (timed); none: instant")
    ap.add_argument("--strategies", default="selected", help="comma-separated validate strategies to compare")
    args = ap.parse_args()
    for path in (args.validation, args.traces, *([args.profile] if args.profile else [])):
        if not path.exists():
            sys.exit(f"compare_hits: {path}: no such file or folder")

    from validate_artifact import replayable_runs

    from moecache.cost_profile import CostProfile
    from moecache.sim.cost_model import CostModel
    from moecache.sim.policy import make_policy
    from moecache.sim.replay import replay_instant
    from moecache.sim.timed import replay_timed
    from moecache.sim.trace_arrays import load_trace
    from moecache.trace.schema import read_trace

    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    chosen = replayable_runs(args.validation, args.traces, "compare_hits", wanted)
    profile = CostProfile.load(str(args.profile)) if args.profile else None
    rows = []
    print("workload | strategy | capacity | accesses | runtime hits | replay hits | runtime only (prefetched at "
          "the previous layer) | replay only")  # fmt: skip
    for run, strategy, path in chosen:
        trace = load_trace(path)
        spec = strategy.sim_policy
        policy = make_policy(spec.name, **spec.params)
        slots = int(run["slots"])
        if profile is None:
            hit_A = replay_instant(trace, policy, slots).hit_A
        else:
            cost = CostModel.for_trace(profile, trace)
            hit_A = replay_timed(trace, policy.bind_cost(cost), slots, cost, on_miss=strategy.on_miss).hit_A
        try:
            visits = runtime_visits(read_trace(path)[0])
        except ValueError as exc:
            sys.exit(f"compare_hits: {path}: {exc}")
        got = {"workload": run["workload"], "strategy": run["strategy"], "capacity": run["capacity"],
               **compare(trace, hit_A, visits)}  # fmt: skip
        rows.append(got)
        print(
            f"{got['workload']} | {got['strategy']} | {got['capacity']} | {got['accesses']} | "
            f"{got['runtime_hits']} | {got['replay_hits']} | {got.get('runtime_only', 0)} "
            f"({got.get('runtime_only_admitted_at_previous_layer', 0)}) | {got.get('replay_only', 0)}"
        )
    print(json.dumps({"bench": "compare_hits", "validation": str(args.validation), "timed": profile is not None,
                      "runs": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
