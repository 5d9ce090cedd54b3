"""CPU fallback time per expert against tokens and threads, for each backend of `CpuExperts`.

One call of `CpuExperts.run` computes `--experts` distinct experts on T tokens each (M = experts x T
triples, the misses of one layer visit); the time per expert is the call's wall time divided by the
experts. "cold": every call reads experts it has not read for a while (rotating over a pool of more than
twice the last-level cache, as `moecache calibrate` does), the realistic miss; "warm": the same experts
every call (weights in cache, optimistic). Shapes: Qwen3.6-35B-A3B (H 2048, I 512) and DeepSeek-V2-Lite
(H 2048, I 1408), bf16 and fp32. Target on the H200 host: a cold bf16 Qwen3.6 expert at one token
<= 130 us on 16 threads. Prints a table and ends with one JSON line.

    python benchmarks/bench_cpu_experts.py [--backends cpp,torch --dtypes bfloat16 --shapes qwen3.6
        --tokens 1,2,4,8,16 --threads 1,4,8,16 --experts 1,8 --modes cold,warm --repeats 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from moecache.calibration import (
    ExpertShape,
    available_memory_bytes,
    dtype_of,
    last_level_cache_bytes,
    make_pool,
    pool_experts,
    summarize,
)
from moecache.runtime.cpu_experts import CpuExperts, cpp_unavailable_reason

SHAPES = {"qwen3.6": ExpertShape(2048, 512), "dsv2-lite": ExpertShape(2048, 1408)}
MiB = 1 << 20


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def str_list(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo").read().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_calls(
    executor: CpuExperts, x_TH, pool_size: int, experts: int, cold: bool, repeats: int, warmup: int
) -> list[float]:
    """Wall time (us) of each timed call; call n reads experts n*experts.. (cold) or 0.. (warm)."""
    tokens = x_TH.shape[0]
    token_M = torch.arange(tokens).repeat(experts)
    weight_M = torch.full((experts * tokens,), 1.0 / experts)
    out_TH = torch.empty_like(x_TH)
    samples = []
    for n in range(warmup + repeats):
        first = n * experts if cold else 0
        keys_M = (torch.arange(first, first + experts) % pool_size).repeat_interleave(tokens)
        t0 = time.perf_counter_ns()
        executor.run(x_TH, keys_M, token_M, weight_M, out_TH)
        elapsed = (time.perf_counter_ns() - t0) / 1e3
        if n >= warmup:
            samples.append(elapsed)
    return samples


def bench_pool(
    args, shape_name: str, dtype_name: str, cache_bytes: int, backends: list[str], threads: list[int]
) -> list[dict]:
    shape, dtype = SHAPES[shape_name], dtype_of(dtype_name)
    expert_bytes = shape.bytes(dtype)
    max_pool = args.max_pool_mib * MiB
    free = available_memory_bytes()
    if free is not None:
        max_pool = min(max_pool, free // 2)
    pool_size = max(pool_experts(expert_bytes, cache_bytes, max_pool), max(args.experts) + 1)
    w13_P2IH, w2_PHI = make_pool(shape, pool_size, dtype)
    rows = []
    for backend in backends:
        for nthreads in threads:
            executor = CpuExperts(w13_P2IH, w2_PHI, threads=nthreads, backend=backend)
            for experts in args.experts:
                for tokens in args.tokens:
                    x_TH = torch.randn(tokens, shape.hidden_size, generator=torch.Generator().manual_seed(0))
                    x_TH = x_TH.to(dtype)
                    for mode in args.modes:
                        samples = time_calls(
                            executor, x_TH, pool_size, experts, mode == "cold", args.repeats, args.warmup
                        )
                        timing = summarize(samples)
                        rows.append(
                            {
                                "backend": backend,
                                "shape": shape_name,
                                "dtype": dtype_name,
                                "threads": nthreads,
                                "experts": experts,
                                "tokens": tokens,
                                "mode": mode,
                                "call_median_us": timing.median_us,
                                "call_p10_us": timing.p10_us,
                                "call_p90_us": timing.p90_us,
                                "per_expert_us": timing.median_us / experts,
                                "gbps": expert_bytes * experts / (timing.median_us * 1e3),
                                "pool_experts": pool_size,
                                "repeats": timing.repeats,
                            }
                        )
                        print_row(rows[-1])
    return rows


HEADER = (
    f"{'backend':<6} | {'shape':<9} | {'dtype':<8} | {'thr':>3} | {'exp':>3} | {'tok':>3} | {'mode':<4} | "
    f"{'call us':>8} | {'p10':>8} | {'p90':>8} | {'us/expert':>9} | {'GB/s':>6}"
)


def print_row(r: dict) -> None:
    print(
        f"{r['backend']:<6} | {r['shape']:<9} | {r['dtype']:<8} | {r['threads']:>3} | {r['experts']:>3} | "
        f"{r['tokens']:>3} | {r['mode']:<4} | {r['call_median_us']:8.1f} | {r['call_p10_us']:8.1f} | "
        f"{r['call_p90_us']:8.1f} | {r['per_expert_us']:9.1f} | {r['gbps']:6.1f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=str_list, default=["cpp", "torch"])
    ap.add_argument("--dtypes", type=str_list, default=["bfloat16", "float32"])
    ap.add_argument("--shapes", type=str_list, default=list(SHAPES))
    ap.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--threads", type=int_list, default=[1, 4, 8, 16], help="counts above the CPUs are dropped"
    )
    ap.add_argument("--experts", type=int_list, default=[1, 8], help="distinct experts per call")
    ap.add_argument("--modes", type=str_list, default=["cold", "warm"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-pool-mib", type=int, default=8192, help="cap on the cold pool's bytes")
    args = ap.parse_args()
    for name in args.shapes:
        if name not in SHAPES:
            ap.error(f"--shapes: '{name}' is not one of {', '.join(SHAPES)}")
    for mode in args.modes:
        if mode not in ("cold", "warm"):
            ap.error(f"--modes: '{mode}' is not cold or warm")
    cpus = len(os.sched_getaffinity(0))
    threads = [n for n in args.threads if n <= cpus] or [cpus]
    cache_bytes = last_level_cache_bytes() or 64 * MiB
    torch_threads = torch.get_num_threads()
    skipped = {}
    print(f"host: {cpu_model()}, {cpus} CPUs, LLC {cache_bytes / MiB:.0f} MiB, torch {torch.__version__}")
    print(HEADER)
    rows = []
    for dtype_name in args.dtypes:
        backends = list(args.backends)
        if "cpp" in backends and (reason := cpp_unavailable_reason(dtype_of(dtype_name))) is not None:
            skipped[f"cpp/{dtype_name}"] = reason
            backends.remove("cpp")
        for shape_name in args.shapes:
            rows += bench_pool(args, shape_name, dtype_name, cache_bytes, backends, threads)
    torch.set_num_threads(torch_threads)
    for what, reason in skipped.items():
        print(f"skipped {what}: {reason}")
    print(
        json.dumps(
            {
                "bench": "cpu_experts",
                "host": {
                    "cpu": cpu_model(),
                    "cpus": cpus,
                    "llc_bytes": cache_bytes,
                    "torch": torch.__version__,
                },
                "args": {k: v for k, v in vars(args).items()},
                "threads": threads,
                "skipped": skipped,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
