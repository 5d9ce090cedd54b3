"""Where slot_moe's time goes, per launch: each Triton kernel's device time under torch.profiler.

bench_slot_moe times whole calls; this splits a call into its launches (the decode's gate/up and down, the
prefill's align, gate/up, down and sum), so a shortfall can be put on one of them. Each call runs after
an L2 flush (a 512 MiB write) with a routing drawn as bench_slot_moe draws them, all experts resident;
per kernel name: mean device microseconds per call, and its share of the sum of kernel times. The gaps
between launches are not kernel time: "call" is the whole call's time from CUDA events around it, one
call at a time (so it carries one launch latency per kernel from Python; bench_slot_moe's in-graph rows
are the figure to quote). Prints a table, then one JSON line.

    python benchmarks/profile_slot_moe.py --shapes qwen3.6 qwen3-30b --tokens 1 4096
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_slot_moe import SHAPES, routings  # noqa: E402


def profile_one(name: str, num_tokens: int, calls: int) -> dict:
    """{"shape", "T", "call_us", "kernels": {kernel: us per call}} for `calls` flushed calls."""
    from moecache_kernels import slot_moe
    from torch.profiler import ProfilerActivity, profile

    hidden, inter, num_experts, top_k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda", dtype=torch.bfloat16)
    w13 *= 0.02
    w2 *= 0.02
    slot_of_E = torch.arange(num_experts, dtype=torch.int32, device="cuda")
    ids = routings(num_tokens, num_experts, top_k, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=gen, device="cuda"), -1).to(torch.bfloat16)
    out = torch.empty_like(x)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    for i in range(3):  # compile and warm up outside the profile
        slot_moe(x, ids[i % len(ids)], w, slot_of_E, w13, w2, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    call_ms = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            flush.zero_()
            start.record()
            slot_moe(x, ids[i % len(ids)], w, slot_of_E, w13, w2, out=out)
            end.record()
            end.synchronize()
            call_ms.append(start.elapsed_time(end))
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(
            ("Memset", "Memcpy")
        ):
            kernels[event.name] += event.time_range.elapsed_us() / calls
    kernels.pop(_flush_kernel(kernels), None)
    del w13, w2, flush
    torch.cuda.empty_cache()
    call_ms.sort()
    return {
        "shape": name,
        "T": num_tokens,
        "call_us": round(1e3 * call_ms[len(call_ms) // 2], 1),
        "kernels": {k: round(v, 1) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])},
    }


def _flush_kernel(kernels: dict[str, float]) -> str | None:
    """The L2 flush's fill kernel (torch's elementwise fill), not slot_moe's."""
    return next((k for k in kernels if "fill" in k.lower() or "FillFunctor" in k), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3.6", "qwen3-30b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_slot_moe: needs CUDA", file=sys.stderr)
        return 2
    if args.calls < 1:
        print(f"profile_slot_moe: --calls {args.calls}: want at least 1", file=sys.stderr)
        return 2
    rows = [profile_one(s, t, args.calls) for s in args.shapes for t in args.tokens]
    print("shape | T | call us (events, eager) | kernel | us per call | share of kernel time")
    for row in rows:
        total = sum(row["kernels"].values()) or 1.0
        for kernel, us in row["kernels"].items():
            print(
                f"{row['shape']} | {row['T']} | {row['call_us']} | {kernel} | {us} | {100 * us / total:.1f}%"
            )
    print(json.dumps({"bench": "profile_slot_moe", "device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
