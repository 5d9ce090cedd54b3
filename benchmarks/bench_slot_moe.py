"""Benchmark slot_moe on CUDA beside torch._grouped_mm, transformers' batched_mm and a per-expert loop.

For each shape and T, all resident / half resident: time (triton.testing.do_bench, which flushes L2 before
every run; routings rotate over the whole expert pool, so weights come cold from HBM), achieved GB/s of
the touched expert weights against the measured device copy bandwidth (the HBM floor), and TFLOP/s
against a measured bf16 matmul rate. The baselines know nothing of residency: they run every routed
expert (their rows are the same for both residency columns). slot_moe runs the launch config it picks
itself (kernels/moecache_kernels/configs/ for this device and shape, else default_config); the "config" column names it:
the path (decode or prefill), and "tuned" (from a file) or "default". Three slot_moe rows: "slot_moe" (eager
calls from Python), "slot_moe graph" (one CUDA graph per call: its launch latency included) and "slot_moe
in-graph" (one graph of all ROUTINGS calls in turn, per call: a MoE layer inside the captured decode step;
do_bench flushes L2 before each replay, and the calls read different experts). Prints a table, then one
JSON line.

    python benchmarks/bench_slot_moe.py            # every shape, T = 1 4 16 64 512 4096
    python benchmarks/bench_slot_moe.py --quick    # fewer reps, baselines only at T <= 512
    python benchmarks/bench_slot_moe.py --shapes qwen3.6 --tokens 1 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import torch

SHAPES = {  # name: (H, I, E, K)
    "qwen3.6": (2048, 512, 256, 8),
    "qwen3-30b": (2048, 768, 128, 8),
    "dsv2-lite": (2048, 1408, 64, 6),
    "large": (4096, 1536, 128, 8),
}
TOKENS = (1, 4, 16, 64, 512, 4096)
ROUTINGS = 8  # distinct routings cycled through, so consecutive runs touch different experts


def measure_ceilings() -> tuple[float, float]:
    """(device copy bytes/s counting read + write, bf16 matmul FLOP/s), measured here."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = do_bench(lambda: a @ b, warmup=5, rep=100)
    return 2 * src.numel() / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


def routings(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """ROUTINGS [T, K] routings with distinct experts per token (softmax top-k of random scores)."""
    return [
        torch.randn(num_tokens, num_experts, generator=gen, device="cuda").topk(top_k, dim=-1).indices
        for _ in range(ROUTINGS)
    ]


def cycled(fn, inputs):
    """A no-argument callable running fn on the next input set each call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(*inputs[state["i"]])

    return call


def graphs(slot_moe, inputs, out) -> list[tuple[torch.cuda.CUDAGraph]]:
    """One captured CUDA graph per input set: replays time the GPU work without Python launch overhead,
    as the runtime's captured decode step runs it (each replay with its own graph launch)."""
    return [(chained_graph(slot_moe, [args], out),) for args in inputs]


def chained_graph(slot_moe, inputs, out) -> torch.cuda.CUDAGraph:
    """One CUDA graph running every input set in turn, as the decode step's graph runs one MoE layer after
    another: its replay time over len(inputs) is a layer's time inside the step, without the graph's own
    launch latency (the rows of `graphs` carry one per call)."""
    for args in inputs:
        slot_moe(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            slot_moe(*args, out=out)
    return graph


def picked_config(num_tokens: int, num_experts: int, inter: int) -> str:
    """What slot_moe runs for this T and shape here: "decode tuned", "decode default", "prefill tuned"."""
    from moecache_kernels.slot_moe_config import (
        CONFIG_DIR,
        DECODE_MAX_T,
        config_file_name,
        device_name,
        load_configs,
    )

    table = load_configs(CONFIG_DIR / config_file_name(num_experts, inter, device_name(), torch.bfloat16))
    decode = num_tokens <= DECODE_MAX_T
    tuned = any((t <= DECODE_MAX_T) == decode for t in table or {})
    return f"{'decode' if decode else 'prefill'} {'tuned' if tuned else 'default'}"


def touched_bytes(ids_TK: torch.Tensor, resident_E: torch.Tensor, expert_bytes: int) -> int:
    ids = ids_TK.unique()
    return int(resident_E[ids].sum()) * expert_bytes


def time_ms(fn, quick: bool) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=3 if quick else 10, rep=20 if quick else 100)


def baselines(w13_EIH, w2_EHI, hidden, inter, num_experts, top_k) -> dict:
    """name -> fn(x, ids, weights) or a string saying why it is not available."""
    out = {}

    def grouped(x_TH, ids_TK, w_TK):
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("torch._grouped_mm is absent")
        flat = ids_TK.reshape(-1)
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=num_experts)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x_TH[order // top_k]
        gu = torch._grouped_mm(xs, w13_EIH.transpose(1, 2), offs=offs)
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        down = torch._grouped_mm(act, w2_EHI.transpose(1, 2), offs=offs)
        y = torch.empty_like(down)
        y[order] = down * w_TK.reshape(-1)[order, None]
        return y.view(-1, top_k, hidden).float().sum(1).to(x_TH.dtype)

    out["torch._grouped_mm"] = grouped
    try:
        from transformers.integrations.moe import batched_mm_experts_forward

        module = types.SimpleNamespace(
            gate_up_proj=w13_EIH, down_proj=w2_EHI, num_experts=num_experts, has_gate=True, has_bias=False,
            is_transposed=False, _is_expert_parallel=False, has_post_expert_norm=False,
            _apply_gate=lambda gu: torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:],
        )  # fmt: skip
        out["transformers batched_mm"] = lambda x, ids, w: batched_mm_experts_forward(module, x, ids, w)
    except ImportError as err:
        out["transformers batched_mm"] = f"not importable: {err}"

    def loop(x_TH, ids_TK, w_TK):
        y = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
        for e in ids_TK.unique().tolist():
            tok, k = torch.where(ids_TK == e)
            gu = x_TH[tok] @ w13_EIH[e].T
            h = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w2_EHI[e].T
            y.index_add_(0, tok, h.float() * w_TK[tok, k, None].float())
        return y.to(x_TH.dtype)

    out["per-expert loop"] = loop
    return out


def bench_shape(name, num_tokens_list, quick, ceilings, rows) -> None:
    from moecache_kernels import slot_moe

    hidden, inter, num_experts, top_k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    # all experts in a slot pool of S = E (slot = expert); half resident = every other expert's slot -1
    w13 = (
        torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    )
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    expert_bytes = 3 * hidden * inter * 2
    maps = {
        "all": torch.arange(num_experts, dtype=torch.int32, device="cuda"),
        "half": torch.where(torch.arange(num_experts, device="cuda") % 2 == 0,
                            torch.arange(num_experts, device="cuda"), -1).to(torch.int32),
    }  # fmt: skip
    base = baselines(w13, w2, hidden, inter, num_experts, top_k)
    copy_bw, mm_rate = ceilings
    for num_tokens in num_tokens_list:
        ids = routings(num_tokens, num_experts, top_k, gen)
        x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        w = torch.softmax(torch.randn(num_tokens, top_k, generator=gen, device="cuda"), -1).to(torch.bfloat16)
        out = torch.empty_like(x)
        config = picked_config(num_tokens, num_experts, inter)
        for residency, slot_of_E in maps.items():
            resident = slot_of_E >= 0
            inputs = [(x, i, w, slot_of_E, w13, w2) for i in ids]
            ms = time_ms(cycled(lambda *a, out=out: slot_moe(*a, out=out), inputs), quick)
            nbytes = sum(touched_bytes(i, resident, expert_bytes) for i in ids) / len(ids)
            pairs = sum(int(resident[i].sum()) for i in ids) / len(ids)
            rows.append(
                _row(name, num_tokens, residency, "slot_moe", ms, nbytes, pairs, hidden, inter, ceilings)
                | {"config": config}
            )
            ms = time_ms(cycled(torch.cuda.CUDAGraph.replay, graphs(slot_moe, inputs, out)), quick)
            rows.append(
                _row(
                    name, num_tokens, residency, "slot_moe graph", ms, nbytes, pairs, hidden, inter, ceilings
                )
                | {"config": config}
            )
            chain = chained_graph(slot_moe, inputs, out)
            ms = time_ms(chain.replay, quick) / len(inputs)
            rows.append(
                _row(
                    name,
                    num_tokens,
                    residency,
                    "slot_moe in-graph",
                    ms,
                    nbytes,
                    pairs,
                    hidden,
                    inter,
                    ceilings,
                )
                | {"config": config}
            )
            del chain
        if quick and num_tokens > 512:
            continue
        for label, fn in base.items():
            if isinstance(fn, str):
                rows.append({"shape": name, "T": num_tokens, "resident": "all", "impl": label, "note": fn})
                continue
            if label == "per-expert loop" and num_tokens > 512:
                continue
            try:
                ms = time_ms(cycled(fn, [(x, i, w) for i in ids]), quick)
            except torch.OutOfMemoryError:  # e.g. batched_mm gathers T x K experts' weights at once
                torch.cuda.empty_cache()
                rows.append(
                    {
                        "shape": name,
                        "T": num_tokens,
                        "resident": "all",
                        "impl": label,
                        "note": "out of memory",
                    }
                )
                continue
            nbytes = sum(
                touched_bytes(i, torch.ones_like(maps["all"], dtype=torch.bool), expert_bytes) for i in ids
            ) / len(ids)
            rows.append(
                _row(name, num_tokens, "all", label, ms, nbytes, num_tokens * top_k, hidden, inter, ceilings)
            )
    del w13, w2
    torch.cuda.empty_cache()
    _ = copy_bw, mm_rate


def _row(shape, num_tokens, residency, impl, ms, nbytes, pairs, hidden, inter, ceilings) -> dict:
    copy_bw, mm_rate = ceilings
    flops = 6 * hidden * inter * pairs  # 2 FLOP per MAC, gate + up + down
    floor_us = nbytes / copy_bw * 1e6
    return {
        "shape": shape, "T": num_tokens, "resident": residency, "impl": impl, "us": round(ms * 1e3, 1),
        "GB/s": round(nbytes / (ms * 1e-3) / 1e9), "floor_us": round(floor_us, 1),
        "x_floor": round(ms * 1e3 / floor_us, 2) if floor_us else None,
        "TFLOP/s": round(flops / (ms * 1e-3) / 1e12, 1),
        "pct_mm": round(100 * flops / (ms * 1e-3) / mm_rate, 1),
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; baselines only up to T=512")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_slot_moe: skipped: needs CUDA")
        return 0
    ceilings = measure_ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy {ceilings[0] / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul 8192^3 {ceilings[1] / 1e12:.0f} TFLOP/s")  # fmt: skip
    rows: list[dict] = []
    for name in args.shapes:
        bench_shape(name, args.tokens, args.quick, ceilings, rows)
    cols = (
        "shape",
        "T",
        "resident",
        "impl",
        "config",
        "us",
        "floor_us",
        "x_floor",
        "GB/s",
        "TFLOP/s",
        "pct_mm",
    )
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row.get(c, row.get("note", "-") if c == "us" else "-")) for c in cols))
    print(json.dumps({"bench": "slot_moe", "device": torch.cuda.get_device_name(),
                      "copy_TBps": round(ceilings[0] / 1e12, 2), "mm_TFLOPs": round(ceilings[1] / 1e12),
                      "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
