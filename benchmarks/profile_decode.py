"""Where one decode step's device time goes: the fast decode loop under torch.profiler, kernels by kind.

bench_decode.py gives a step's wall time; this gives its parts. The model (bench_decode.build_model: the
tiny build or a full random model cut to --layers) is offloaded at --capacity with --policy, the fast
loop generates twice (warm-up and capture; then, with --compile, compiled), and a third generation of
--new-tokens tokens after a one-token prompt runs under the profiler. Every device kernel (on the CPU:
every operator's own time) is put in one kind by its name (KINDS, first match), summed over the run
and divided by its decode steps: a table of the kinds, then the --top kernels, then one JSON line.
The prompt's one forward pass is in the sums (one step in --new-tokens).

    python benchmarks/profile_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20 --compile
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (kind, pattern on the kernel's or operator's name), first match wins; "other" takes the rest
KINDS = (
    (
        "slot-pool MoE kernel",
        r"_gate_up_(decode|grouped)|_down_(decode|grouped)|_sum_(pairs|ranks)|_align_|slot_moe",
    ),
    ("gated delta rule / conv1d", r"delta|recurrent|conv1d|convolution|chunk_"),
    ("attention", r"attn|attention|sdpa|flash|fmha|softmax"),
    ("matmul (GEMM / GEMV)", r"gemm|gemv|matmul|cutlass|nvjet|xmma|cublas|addmm|\bmm\b|linear|bmm"),
    ("norm", r"norm|rsqrt"),
    ("routing (top-k, sort, scatter)", r"topk|sort|scatter|gather|index"),
    ("fused elementwise (Inductor)", r"triton_(poi|red|per)"),
    ("copy", r"memcpy|memset|copy|cat\b|fill"),
    (
        "views and casts",
        r"as_strided|select|view|reshape|transpose|slice|squeeze|expand|permute|aten::t$|aten::to$|_to_copy",
    ),
    ("elementwise", r"elementwise|vectorized|unrolled|add|mul|silu|sigmoid|exp|neg|div"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def kernel_times(prof, on_cuda: bool) -> dict[str, float]:
    """name -> total us over the profiled run: each device kernel's time (CUDA), or each operator's own
    CPU time (CPU)."""
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        if on_cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            out[evt.key] = out.get(evt.key, 0.0) + float(us)
    return out


def main(argv: list[str] | None = None) -> None:
    import bench_decode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_decode.add_model_args(ap)
    ap.add_argument("--capacity", default="100%", help="GPU slots, in the capacity syntax")
    ap.add_argument("--policy", default="static_cold")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--compile", action="store_true", help="the loop's step through torch.compile")
    ap.add_argument("--top", type=int, default=12, help="kernels listed by name")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: at least 2")
    if args.top < 0:
        ap.error(f"--top {args.top}: at least 0")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    torch.manual_seed(0)
    model, described = bench_decode.build_model(args, device)
    model = bench_decode.offload_session(model, args.capacity, args.policy, device)

    from moecache.runtime.decode_loop import FastDecoder

    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    decoder = FastDecoder(model, max_cache_len=1 + args.new_tokens, compile=args.compile)
    decoder.generate(prompt, args.new_tokens)  # warm-up, compilation, capture
    decoder.generate(prompt, args.new_tokens)
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if on_cuda else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        result = decoder.generate(prompt, args.new_tokens)
        if on_cuda:
            torch.cuda.synchronize()
    steps = args.new_tokens
    times = kernel_times(prof, on_cuda)
    by_kind: dict[str, float] = {}
    for name, us in times.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us
    total = sum(by_kind.values())
    rows = [
        {"kind": k, "us_per_step": us / steps, "share": us / total if total else 0.0}
        for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])
    ]
    top = [
        {"kernel": name, "kind": kind_of(name), "us_per_step": us / steps}
        for name, us in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]
    ]
    unit = "device kernels" if on_cuda else "operators' own CPU time"
    print(
        f"decode profile on {torch.cuda.get_device_name(device) if on_cuda else 'cpu'}: {described['name']} "
        f"({described['num_layers']} MoE layers), capacity {args.capacity} ({args.policy}), "
        f"{'compiled' if args.compile else 'not compiled'}, mode {result.mode}, {steps} steps; {unit}"
    )
    print(f"{'kind':<32} | {'us/step':>9} | share")
    for r in rows:
        print(f"{r['kind']:<32} | {r['us_per_step']:9.1f} | {r['share']:.3f}")
    wall_us = None if result.ms_per_token is None else result.ms_per_token * 1e3
    print(f"{'all':<32} | {total / steps:9.1f} | 1.000   (the step's wall time: {wall_us} us)")
    for t in top:
        print(f"  {t['us_per_step']:8.1f} us  {t['kind']:<30} {t['kernel'][:110]}")
    print(
        json.dumps(
            {
                "bench": "profile_decode",
                "device": str(device),
                "model": described,
                "args": vars(args),
                "mode": result.mode,
                "steps": steps,
                "unit": unit,
                "step_wall_us": wall_us,
                "kernel_us_per_step": total / steps,
                "kinds": rows,
                "top": top,
            }  # fmt: skip
        )
    )


if __name__ == "__main__":
    main()
