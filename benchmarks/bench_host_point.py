"""The fast decode loop's host-point Python around the CPU executor, with the caches cold as on a GPU host.

On a GPU host the executor streams a layer's expert weights (Qwen3.6: 8 x 6.3 MB a CPU layer) through the
caches, so the host point's Python after it and at the next layer's host point runs cold; that Python is
on the decode step's critical path (between the routing's arrival and the executor, and between the
executor and the next segment's replay). This runs the real fast loop (moecache/runtime/segments.py) on
the CPU stand-in with the tiny model and, after each executor call, reads `--sweep-mib` MiB through the
caches (excluded from the times), then reports, per CPU layer of the timed decode steps:
- pre: from the read-back's arrival (`_wait_readback` returning) to the executor call;
- post: from the executor's return to the host point's return (the replay of the next segment follows).
The hooks wrap those methods in this process only. Medians over the second half of the calls (the first
half warms up). Prints a table, then one JSON line.

    python benchmarks/bench_host_point.py                       # capacity 0: every layer on the CPU
    python benchmarks/bench_host_point.py --capacity 50% --policy lfu
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch
from bench_decode import build_model, offload_session

from moecache.runtime import cpu_experts, segments
from moecache.runtime.decode_loop import FastDecoder


def hooked(sweep_B: np.ndarray) -> tuple[dict, list]:
    """Wrap the executor's bound call, the read-back wait and both host points; returns (times, undo)."""
    times, mark = {"pre": [], "post": []}, {}
    originals = []

    def wrap(cls, name, make):
        original = getattr(cls, name)
        originals.append((cls, name, original))
        setattr(cls, name, make(original))

    def call(original):
        def run(self, m, round_product):
            mark["call"] = time.perf_counter_ns()
            if "arrived" in mark:
                times["pre"].append(mark["call"] - mark.pop("arrived"))
            out = original(self, m, round_product)
            sweep_B.sum()  # the weights' cache pollution, outside both times
            mark["returned"] = time.perf_counter_ns()
            return out

        return run

    def wait(original):
        def run(self):
            original(self)
            mark["arrived"] = time.perf_counter_ns()

        return run

    def host_point(original):
        def run(self, layer):
            original(self, layer)
            if "returned" in mark:
                times["post"].append(time.perf_counter_ns() - mark.pop("returned"))

        return run

    wrap(cpu_experts.BoundCall, "__call__", call)
    wrap(segments.ExpertsTaps, "_wait_readback", wait)
    wrap(segments.ExpertsTaps, "_combine", host_point)
    return times, originals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="conf/model/tiny.yaml")
    ap.add_argument("--capacity", default="0")
    ap.add_argument("--policy", default="static_layers")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--sweep-mib", type=int, default=64)
    args = ap.parse_args()
    if args.sweep_mib < 0:
        ap.error(f"--sweep-mib {args.sweep_mib}: must be >= 0")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: must be >= 2 (one decode step at least)")
    torch.manual_seed(0)
    device = torch.device("cpu")
    model, desc = build_model(SimpleNamespace(model=args.model, dtype=None, vocab=None, layers=None), device)
    model = offload_session(model, args.capacity, args.policy, device)
    prompt = torch.randint(0, desc["vocab"], (1, 8))
    decoder = FastDecoder(model, max_cache_len=prompt.numel() + args.new_tokens)
    decoder.generate(prompt, args.new_tokens)  # warm-up: compiled pieces, bound calls
    times, originals = hooked(np.ones(args.sweep_mib << 20, np.uint8))
    try:
        decoder.generate(prompt, args.new_tokens)
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
    result = {}
    print(f"host point on the CPU stand-in: {desc['name']}, capacity {args.capacity}, {args.policy}, "
          f"{args.sweep_mib} MiB swept after each executor call")  # fmt: skip
    print(f"{'part':<6} | {'calls':>5} | {'median us':>9} | {'p10 us':>7} | {'p90 us':>7}")
    for part, ns in times.items():
        us = np.array(ns[len(ns) // 2 :]) / 1e3
        if not len(us):
            raise SystemExit(f"bench_host_point: no {part} times (no CPU call at capacity {args.capacity})")
        row = {"calls": len(us), "median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
               "p90_us": float(np.percentile(us, 90))}  # fmt: skip
        result[part] = row
        print(
            f"{part:<6} | {row['calls']:>5} | {row['median_us']:>9.2f} | {row['p10_us']:>7.2f} | {row['p90_us']:>7.2f}"
        )
    print(json.dumps({"bench": "host_point", "args": vars(args), "model": desc, **result}))


if __name__ == "__main__":
    main()
