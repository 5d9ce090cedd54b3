"""One layer visit called from Python, per online policy: the cost the runtime's cache manager pays
per MoE layer per token for the policy itself (hit mask, step, evictions and admissions applied).

Shape (default): Qwen3.6-35B-A3B, 40 layers x 256 experts, top-8, capacity 2048 slots. Routing is
synthetic (each token's 8 experts drawn without replacement, skewed towards low expert ids, so that
the cache both hits and misses); the policy is warmed on `--warm-tokens` tokens, then `--tokens`
further tokens are timed visit by visit (time.perf_counter_ns around each call). Offline policies
(Belady, hindsight static: they read the whole trace) are skipped. Target: median <= 5 us for lru and
lfu. Prints a table and ends with one JSON line.

    python benchmarks/bench_step.py [--layers 40 --experts 256 --top-k 8 --capacity 2048]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from moecache.cost_profile import CostProfile
from moecache.sim.inputs import BUNDLED_PROFILES
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.sweep import CostSettings, cost_model
from moecache.sim.trace_arrays import DECODE, TraceArrays
from moecache.sim.visit import visit_entry

PROFILE = BUNDLED_PROFILES / "h200_qwen3_6_35b_a3b_2026-11-30.json"
EXPERT_BYTES = 3 * 2048 * 512 * 2  # Qwen3.6-35B-A3B: H 2048, I 512, bf16 (only the cost model reads it)


def synthetic_trace(layers: int, experts: int, top_k: int, tokens: int, seed: int) -> TraceArrays:
    """A one-request decode trace: every token visits every layer and selects `top_k` distinct experts,
    expert e with probability proportional to 1 / (e + 8)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(experts) + 8.0)
    p /= p.sum()
    visits = tokens * layers
    layer_V = np.tile(np.arange(layers, dtype=np.int32), tokens)
    expert_VK = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(visits)])
    key_A = (layer_V[:, None] * experts + expert_VK).astype(np.int32).ravel()
    return TraceArrays(
        num_layers=layers,
        num_experts=experts,
        top_k=top_k,
        expert_bytes=EXPERT_BYTES,
        request_ids=("synthetic",),
        layer_V=layer_V,
        request_V=np.zeros(visits, np.int32),
        step_V=np.repeat(np.arange(tokens, dtype=np.int32), layers),
        tokens_V=np.ones(visits, np.int32),
        phase_V=np.full(visits, DECODE, np.int8),
        clock_V=np.repeat(np.arange(tokens, dtype=np.int64), layers),
        start_V=np.arange(0, visits * top_k + 1, top_k, dtype=np.int64),
        key_A=key_A,
        uses_A=np.ones(visits * top_k, np.int32),
        name="synthetic",
    )


def time_visits(name: str, trace: TraceArrays, capacity: int, warm_tokens: int, cost) -> dict:
    """Per-visit times (ns) of the timed tokens, and the hit rate over them."""
    policy = make_policy(name).bind_cost(cost)
    state = policy.named_state(policy.init_state(trace, capacity))
    visit = visit_entry(type(policy))
    resident_G = np.zeros(trace.num_keys, np.bool_)
    resident_G[policy.initial_residents(state, trace, capacity)] = True
    held_capacity = np.array([int(resident_G.sum()), capacity], np.int64)
    hit_U = np.zeros(trace.top_k, np.bool_)
    admit_out = np.empty(trace.num_keys, np.int32)
    evict_out = np.empty(trace.num_keys, np.int32)
    warm_visits = warm_tokens * trace.num_layers
    ns, hits, accesses = [], 0, 0
    clock = time.perf_counter_ns
    for v in range(trace.num_steps):
        a0, a1 = int(trace.start_V[v]), int(trace.start_V[v + 1])
        key_U, uses_U = trace.key_A[a0:a1], trace.uses_A[a0:a1]
        t0 = clock()
        visit(
            state,
            key_U,
            uses_U,
            a0,
            int(trace.clock_V[v]),
            0,
            resident_G,
            held_capacity,
            hit_U,
            admit_out,
            evict_out,
        )
        t1 = clock()
        if v >= warm_visits:
            ns.append(t1 - t0)
            hits += int(hit_U.sum())
            accesses += a1 - a0
    ns_V = np.array(ns, np.float64)
    return {
        "policy": policy.label(),
        "median_us": float(np.median(ns_V)) / 1e3,
        "p90_us": float(np.percentile(ns_V, 90)) / 1e3,
        "p99_us": float(np.percentile(ns_V, 99)) / 1e3,
        "hit_rate": hits / accesses,
        "visits": len(ns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--warm-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trace = synthetic_trace(args.layers, args.experts, args.top_k, args.warm_tokens + args.tokens, args.seed)
    cost = cost_model(trace, CostProfile.load(PROFILE), CostSettings())
    import moecache.sim.policies  # noqa: F401  (registers every policy)

    online = sorted(name for name, cls in POLICIES.items() if not cls.offline)
    for name in online:  # compile (or load from the disk cache) before timing
        time_visits(
            name, synthetic_trace(args.layers, args.experts, args.top_k, 2, 1), args.capacity, 1, cost
        )
    rows = [time_visits(name, trace, args.capacity, args.warm_tokens, cost) for name in online]
    print(
        f"{args.layers} layers x {args.experts} experts, top-{args.top_k}, capacity {args.capacity}; "
        f"{args.tokens} timed tokens after {args.warm_tokens} warm-up tokens; one visit per call, from Python"
    )
    print(f"{'policy':<48} | {'median us':>9} | {'p90 us':>7} | {'p99 us':>7} | {'hit rate':>8}")
    for r in rows:
        print(
            f"{r['policy']:<48} | {r['median_us']:9.2f} | {r['p90_us']:7.2f} | {r['p99_us']:7.2f} | "
            f"{r['hit_rate']:8.3f}"
        )
    print(json.dumps({"bench": "policy_visit", **vars(args), "policies": rows}))


if __name__ == "__main__":
    main()
