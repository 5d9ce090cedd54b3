"""The routers' top-k on CUDA: `torch.topk` against `moecache_kernels.topk_rows` at each num_warps, as a
decode step calls it, one row per MoE layer inside a captured graph.

Per shape (E experts, K top-k) and kind of row: one CUDA graph of LAYERS calls on distinct rows (a 20-
or 26-layer decode step's routers), replayed; microseconds per call (the graph's time over LAYERS, the
launches' gaps included, as in the captured step). Rows: "fp32" (float32 scores, no equal ones) and
"softmax(bf16)" (a bf16 router's logits through a float32 softmax, as Qwen3.6's router computes them:
equal scores happen). Every timed kernel's output is checked against torch.topk first. Prints a table,
then one JSON line.

    python benchmarks/bench_topk_rows.py
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"qwen3.6": (256, 8, 20), "dsv2-lite": (64, 6, 26)}  # name: (E, K, layers of the step)
WARPS = (1, 2, 4, 8)


def rows(kind: str, layers: int, num_experts: int, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "fp32":
        return [torch.randn(1, num_experts, generator=gen, device="cuda") for _ in range(layers)]
    logits = [torch.randn(1, num_experts, generator=gen, device="cuda").bfloat16() for _ in range(layers)]
    return [torch.softmax(x, dim=-1, dtype=torch.float32) for x in logits]


def per_call_us(call, inputs: list[torch.Tensor], replays: int) -> float:
    """Microseconds per call of one graph of `call` over every input, replayed `replays` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for x in inputs:  # warm-up (compiles the kernel) outside the capture
            call(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            call(x)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(inputs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=2000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk_rows: needs CUDA")
    from moecache_kernels.topk_rows import NUM_WARPS, topk_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    print(
        f"{'shape':10} | {'rows':13} | {'sorted':6} | {'torch.topk us':>13} | "
        + " | ".join(f"w={w} us" for w in WARPS)
    )
    for name, (num_experts, top_k, layers) in SHAPES.items():
        for kind in ("fp32", "softmax(bf16)"):
            inputs = rows(kind, layers, num_experts, gen)
            for by_value in (True, False):
                for x in inputs:
                    want = torch.topk(x, top_k, dim=-1, sorted=by_value)
                    for w in WARPS:
                        got = topk_rows(x, top_k, by_value, num_warps=w)
                        if not (torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)):
                            raise SystemExit(
                                f"bench_topk_rows: {name} {kind} num_warps={w}: differs from torch.topk"
                            )
                torch_us = per_call_us(
                    lambda x, k=top_k, b=by_value: torch.topk(x, k, dim=-1, sorted=b), inputs, args.replays
                )
                kernel_us = {
                    w: per_call_us(
                        lambda x, w=w, k=top_k, b=by_value: topk_rows(x, k, b, num_warps=w),
                        inputs,
                        args.replays,
                    )
                    for w in WARPS
                }
                print(f"{name:10} | {kind:13} | {by_value!s:6} | {torch_us:13.2f} | "
                      + " | ".join(f"{kernel_us[w]:7.2f}" for w in WARPS))  # fmt: skip
                results.append({"shape": name, "E": num_experts, "K": top_k, "rows": kind, "sorted": by_value,
                                "torch_us": torch_us, "kernel_us": {str(w): v for w, v in kernel_us.items()}})  # fmt: skip
    print(json.dumps({"bench": "topk_rows", "gpu": torch.cuda.get_device_name(), "default_num_warps": NUM_WARPS,
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
