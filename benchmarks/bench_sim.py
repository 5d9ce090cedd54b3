"""Simulator speed: accesses replayed per second, per policy, on real traces already loaded.

Targets (one core): >= 50 M accesses/s for lru, lfu and the static policies, >= 10 M/s for Belady
and for timed mode. Also times loading (Parquet -> flat arrays). Prints a table and ends with one
JSON line.

    python benchmarks/bench_sim.py --trace outputs/import_trace/<id>/trace.parquet [--capacity 300]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import numba

from moecache.cost_profile import CostProfile
from moecache.sim.inputs import BUNDLED_PROFILES
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.sweep import CostSettings, cost_model
from moecache.sim.timed import replay_timed
from moecache.sim.trace_arrays import load_trace

PROFILE = BUNDLED_PROFILES / "h200_qwen3_6_35b_a3b_2026-11-30.json"


def best_of(fn, repeats: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trace", default=None, help="canonical trace Parquet (default: newest import_trace artifact)"
    )
    ap.add_argument("--capacity", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    numba.set_num_threads(1)
    path = args.trace or sorted(glob.glob("outputs/import_trace/*/trace.parquet"), key=os.path.getmtime)[-1]

    load_s = [best_of(lambda: load_trace(path), 1) for _ in range(3)]
    trace = load_trace(path)
    n = trace.num_accesses
    cost = cost_model(trace, CostProfile.load(PROFILE), CostSettings())
    print(
        f"trace {path}: {n:,} accesses, {trace.num_steps:,} layer steps, {trace.num_keys} keys; capacity {args.capacity}"
    )
    print(
        f"load (Parquet -> flat arrays): {statistics.median(load_s) * 1e3:.1f} ms = {n / statistics.median(load_s) / 1e6:.1f} M accesses/s"
    )
    print(f"{'policy':<40} | {'instant M/s':>11} | {'timed M/s':>9} | {'hit rate':>8}")
    rows = []
    import moecache.sim.policies  # noqa: F401

    for name in sorted(POLICIES):
        policy = make_policy(name).bind_cost(cost)  # cost-aware policies (impact) read it
        hit = replay_instant(trace, policy, args.capacity).hit_A.mean()
        t_inst = best_of(lambda p=policy: replay_instant(trace, p, args.capacity), args.repeats)
        t_timed = best_of(lambda p=policy: replay_timed(trace, p, args.capacity, cost), args.repeats)
        rows.append(
            {
                "policy": policy.label(),
                "instant_maps": n / t_inst / 1e6,
                "timed_maps": n / t_timed / 1e6,
                "hit_rate": float(hit),
            }
        )
        print(f"{policy.label():<40} | {n / t_inst / 1e6:11.1f} | {n / t_timed / 1e6:9.1f} | {hit:8.3f}")
    print(
        json.dumps(
            {
                "bench": "simulator_speed",
                "trace": os.path.basename(os.path.dirname(path)),
                "accesses": n,
                "capacity": args.capacity,
                "load_maps": n / statistics.median(load_s) / 1e6,
                "policies": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
