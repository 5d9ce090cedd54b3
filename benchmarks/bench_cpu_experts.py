"""CPU fallback time per expert against tokens and threads, for each backend of `CpuExperts`.

One call of `CpuExperts.run` computes `--experts` distinct experts on T tokens each (M = experts x T
triples, the misses of one layer visit); the time per expert is the call's wall time divided by the
experts. "cold": every call reads experts it has not read for a while (rotating over a pool of more than
twice the last-level cache, as `moecache calibrate` does), the realistic miss; "warm": the same experts
every call (weights in cache, optimistic). Shapes: Qwen3.6-35B-A3B (H 2048, I 512) and DeepSeek-V2-Lite
(H 2048, I 1408), bf16 and fp32. Target on the H200 host: a cold bf16 Qwen3.6 expert at one token
<= 130 us on 16 threads. Prints a table and ends with one JSON line.

Backends: "cpp" and "torch" are `CpuExperts`' own; "kt" is kt-kernel's BF16 MoE (benchmarks/kt_backend.py),
bfloat16 only, run where `kt_kernel` imports (a Python 3.12 environment with kt-kernel installed); a backend
that cannot run here is skipped with one line saying why, and the others still run. Before a backend is
timed at a thread count, its output on distinct random experts (1 token and the most tokens, up to 2
experts each, one token left without any) is checked against the fp32 torch oracle of
tests/runtime/test_cpu_experts.py with its tolerances; a wrong result stops the benchmark (exit 1) and
is not timed.

    python benchmarks/bench_cpu_experts.py [--backends cpp,torch,kt --dtypes bfloat16 --shapes qwen3.6
        --tokens 1,2,4,8,16 --threads 1,4,8,16 --experts 1,8 --modes cold,warm --gap-us 0,300
        --pages huge,base --repeats 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from kt_backend import KtExperts, kt_info, kt_unavailable_reason
from moecache_kernels import expert_forward

from moecache.calibration import (
    ExpertShape,
    available_memory_bytes,
    dtype_of,
    last_level_cache_bytes,
    make_pool,
    pool_experts,
    summarize,
)
from moecache.models.host_pages import PAGE_KINDS, huge_pages_of
from moecache.runtime.cpu_experts import CpuExperts, cpp_unavailable_reason

SHAPES = {"qwen3.6": ExpertShape(2048, 512), "dsv2-lite": ExpertShape(2048, 1408)}
MiB = 1 << 20
# tests/runtime/test_cpu_experts.py's tolerances against its fp32 oracle (the reasons are given there).
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 5e-2, "rtol": 1e-2}}
CHECK_EXPERTS = 4


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
    executor: CpuExperts,
    x_TH,
    pool_size: int,
    experts: int,
    cold: bool,
    repeats: int,
    warmup: int,
    gap_us: int = 0,
) -> list[float]:
    """Wall time (us) of each timed call; call n reads experts n*experts.. (cold) or 0.. (warm). With
    `gap_us`, the calling thread spins that long before each call, as a decode step's host thread does
    between two layers' CPU calls (the GPU segment between them): the executor's threads then wait
    between calls as they do in a decode, and what that costs (waking them) is in the call's time."""
    tokens = x_TH.shape[0]
    token_M = torch.arange(tokens).repeat(experts)
    weight_M = torch.full((experts * tokens,), 1.0 / experts)
    out_TH = torch.empty_like(x_TH)
    samples = []
    for n in range(warmup + repeats):
        first = n * experts if cold else 0
        keys_M = (torch.arange(first, first + experts) % pool_size).repeat_interleave(tokens)
        if gap_us:
            until = time.perf_counter_ns() + gap_us * 1000
            while time.perf_counter_ns() < until:
                pass
        t0 = time.perf_counter_ns()
        executor.run(x_TH, keys_M, token_M, weight_M, out_TH)
        elapsed = (time.perf_counter_ns() - t0) / 1e3
        if n >= warmup:
            samples.append(elapsed)
    return samples


def make_executor(backend: str, w13_GIH, w2_GHI, threads: int, max_tokens: int, max_per_token: int):
    if backend == "kt":
        return KtExperts(w13_GIH, w2_GHI, threads=threads, max_tokens=max_tokens, max_per_token=max_per_token)
    return CpuExperts(w13_GIH, w2_GHI, threads=threads, backend=backend)


def oracle(x_TH, w13_GIH, w2_GHI, keys_M, token_M, weight_M):
    """tests/runtime/test_cpu_experts.py's oracle: each triple's expert (`expert_forward`: fp32 sums,
    transformers' roundings) times its float32 weight, summed in fp32."""
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32)
    for key, tok, w in zip(keys_M.tolist(), token_M.tolist(), weight_M.tolist(), strict=True):
        y_TH[tok] += w * expert_forward(x_TH[tok : tok + 1], w13_GIH[key], w2_GHI[key])[0]
    return y_TH.to(x_TH.dtype)


def check_cases(shape: ExpertShape, dtype: torch.dtype, tokens: list[int], seed: int = 0):
    """Distinct random experts and, for 1 token and for the most tokens, random triples (up to 2 distinct
    experts per token, the last token of a multi-token call without any) with their oracle output."""
    gen = torch.Generator().manual_seed(seed)
    h, i = shape.hidden_size, shape.moe_intermediate_size
    w13_GIH = (torch.randn(CHECK_EXPERTS, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w2_GHI = (torch.randn(CHECK_EXPERTS, h, i, generator=gen) * i**-0.5).to(dtype)
    cases = []
    for t in sorted({1, max(tokens)}):
        x_TH = torch.randn(t, h, generator=gen).to(dtype)
        routed = max(t - 1, 1)
        keys_M = torch.cat([torch.randperm(CHECK_EXPERTS, generator=gen)[:2] for _ in range(routed)])
        token_M = torch.arange(routed).repeat_interleave(2)
        shuffle_M = torch.randperm(keys_M.shape[0], generator=gen)
        keys_M, token_M = keys_M[shuffle_M], token_M[shuffle_M]
        weight_M = torch.rand(keys_M.shape[0], generator=gen)
        cases.append(
            (x_TH, keys_M, token_M, weight_M, oracle(x_TH, w13_GIH, w2_GHI, keys_M, token_M, weight_M))
        )
    return w13_GIH, w2_GHI, cases


def check_backend(backend: str, threads: int, shape_name: str, dtype_name: str, check) -> None:
    """Exit 1 with one line where the backend's output differs from the oracle (or misses a row)."""
    w13_GIH, w2_GHI, cases = check
    executor = make_executor(backend, w13_GIH, w2_GHI, threads, max(c[0].shape[0] for c in cases), 2)
    try:
        for x_TH, keys_M, token_M, weight_M, want_TH in cases:
            got_TH = executor.run(x_TH, keys_M, token_M, weight_M, torch.full_like(x_TH, float("nan")))
            where = f"{backend} ({threads} threads, {shape_name} {dtype_name}, {x_TH.shape[0]} tokens)"
            try:
                torch.testing.assert_close(got_TH.float(), want_TH.float(), **TOL[x_TH.dtype])
            except AssertionError as exc:
                err = (got_TH.float() - want_TH.float()).abs().nan_to_num(float("inf")).max().item()
                detail = next((ln.strip() for ln in str(exc).splitlines() if "Mismatched" in ln), "")
                raise SystemExit(
                    f"bench_cpu_experts: {where} differs from the reference: {detail} max |err| {err:.3g}"
                ) from None
            untouched = torch.ones(x_TH.shape[0], dtype=torch.bool)
            untouched[token_M] = False
            if not (got_TH[untouched] == 0).all():
                raise SystemExit(f"bench_cpu_experts: {where} leaves a token without a triple non-zero")
    finally:
        executor.close()


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
    check = check_cases(shape, dtype, args.tokens)
    rows = []
    for pages in args.pages:
        w13_P2IH, w2_PHI = make_pool(shape, pool_size, dtype, pages=pages)
        rows += bench_backends(
            args, shape_name, dtype_name, backends, threads, check, w13_P2IH, w2_PHI, pages
        )
        del w13_P2IH, w2_PHI
    return rows


def bench_backends(
    args, shape_name, dtype_name, backends, threads, check, w13_P2IH, w2_PHI, pages
) -> list[dict]:
    """Every backend, thread count, expert count, token count and mode on one pool (`pages`: its pages)."""
    shape, dtype = SHAPES[shape_name], dtype_of(dtype_name)
    expert_bytes, pool_size = shape.bytes(dtype), w13_P2IH.shape[0]
    huge = huge_pages_of(w13_P2IH)  # what the kernel gave the pool's gate_up half
    print(f"{pages} pages: gate_up pool {w13_P2IH.numel() * w13_P2IH.element_size() / MiB:.0f} MiB, "
          f"{'unknown' if huge is None else f'{huge / MiB:.0f} MiB'} of it in huge pages")  # fmt: skip
    rows = []
    for backend in backends:
        for nthreads in threads:
            check_backend(backend, nthreads, shape_name, dtype_name, check)
            executor = make_executor(backend, w13_P2IH, w2_PHI, nthreads, max(args.tokens), max(args.experts))
            for experts in args.experts:
                for tokens in args.tokens:
                    x_TH = torch.randn(tokens, shape.hidden_size, generator=torch.Generator().manual_seed(0))
                    x_TH = x_TH.to(dtype)
                    for mode, gap in ((m, g) for m in args.modes for g in args.gap_us):
                        samples = time_calls(
                            executor, x_TH, pool_size, experts, mode == "cold", args.repeats, args.warmup, gap
                        )
                        timing = summarize(samples)
                        rows.append(
                            {
                                "backend": backend,
                                "pages": pages,
                                "shape": shape_name,
                                "dtype": dtype_name,
                                "threads": nthreads,
                                "experts": experts,
                                "tokens": tokens,
                                "mode": mode,
                                "gap_us": gap,
                                "call_median_us": timing.median_us,
                                "call_p10_us": timing.p10_us,
                                "call_p90_us": timing.p90_us,
                                "per_expert_us": timing.median_us / experts,
                                "gbps": expert_bytes * experts / (timing.median_us * 1e3),
                                "pool_experts": pool_size,
                                "pool_huge_page_bytes": huge,
                                "repeats": timing.repeats,
                            }
                        )
                        print_row(rows[-1])
            executor.close()
    return rows


HEADER = (
    f"{'backend':<6} | {'pages':<5} | {'shape':<9} | {'dtype':<8} | {'thr':>3} | {'exp':>3} | {'tok':>3} | "
    f"{'mode':<4} | {'gap us':>6} | "
    f"{'call us':>8} | {'p10':>8} | {'p90':>8} | {'us/expert':>9} | {'GB/s':>6}"
)


def print_row(r: dict) -> None:
    print(
        f"{r['backend']:<6} | {r['pages']:<5} | {r['shape']:<9} | {r['dtype']:<8} | {r['threads']:>3} | "
        f"{r['experts']:>3} | "
        f"{r['tokens']:>3} | {r['mode']:<4} | {r['gap_us']:>6} | {r['call_median_us']:8.1f} | "
        f"{r['call_p10_us']:8.1f} | {r['call_p90_us']:8.1f} | {r['per_expert_us']:9.1f} | {r['gbps']:6.1f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=str_list, default=["cpp", "torch", "kt"])
    ap.add_argument("--dtypes", type=str_list, default=["bfloat16", "float32"])
    ap.add_argument("--shapes", type=str_list, default=list(SHAPES))
    ap.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--threads", type=int_list, default=[1, 4, 8, 16], help="counts above the CPUs are dropped"
    )
    ap.add_argument("--experts", type=int_list, default=[1, 8], help="distinct experts per call")
    ap.add_argument("--modes", type=str_list, default=["cold", "warm"])
    ap.add_argument(
        "--gap-us",
        type=int_list,
        default=[0],
        help="the caller spins this long before each call (a decode step's GPU segment between layers)",
    )
    ap.add_argument(
        "--pages",
        type=str_list,
        default=["huge"],
        help="the cold pool's host pages: huge (the expert store's: moecache/models/host_pages.py), base",
    )
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-pool-mib", type=int, default=8192, help="cap on the cold pool's bytes")
    args = ap.parse_args()
    for name in args.backends:
        if name not in ("cpp", "torch", "kt"):
            ap.error(f"--backends: '{name}' is not cpp, torch or kt")
    for name in args.shapes:
        if name not in SHAPES:
            ap.error(f"--shapes: '{name}' is not one of {', '.join(SHAPES)}")
    for pages in args.pages:
        if pages not in PAGE_KINDS:
            ap.error(f"--pages: '{pages}' is not one of {', '.join(PAGE_KINDS)}")
    for mode in args.modes:
        if mode not in ("cold", "warm"):
            ap.error(f"--modes: '{mode}' is not cold or warm")
    if any(g < 0 for g in args.gap_us):
        ap.error(f"--gap-us: {args.gap_us} holds a negative gap")
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
        if "kt" in backends and (reason := kt_unavailable_reason(dtype_of(dtype_name))) is not None:
            skipped[f"kt/{dtype_name}"] = reason
            backends.remove("kt")
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
                    "kt_kernel": kt_info() if "kt" in args.backends else None,
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
