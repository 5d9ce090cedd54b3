"""Decode tokens/s with the routing logger on vs off (target: under 3% slowdown).

Runs the same greedy generation (fixed prompt, fixed number of new tokens, EOS ignored) in adjacent
pairs, one run with and one without the logger attached (the order alternating between pairs),
`--repeats` pairs. Shared machines drift between slow and fast phases, so the slowdown is the median
of the per-pair time ratios (with its interquartile range); best-of-N and median tokens/s are printed
beside it. Prints a table and ends with one JSON line.

    python benchmarks/bench_logging.py --model tiny                   # the embedded tiny model, CPU
    python benchmarks/bench_logging.py --model large --device cuda    # random Qwen3.6-shaped layers, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from moecache.models import adapter_for
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import TraceMeta


def build_model(name: str, device: str, layers: int, experts_impl: str | None):
    if name == "tiny":
        from moecache.config import compose
        from moecache.models import load_model

        cfg = compose(["model=tiny"])
        return load_model(cfg.model, cfg.output_root, device).model
    # Qwen3.6-35B-A3B layer shapes (hidden 2048, 256 experts, top-8, I=512, one shared expert),
    # fewer layers, random bf16 weights, text-only CausalLM.
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        num_hidden_layers=layers,
        vocab_size=32000,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    if experts_impl:
        model.set_experts_implementation(experts_impl)
    return model.eval()


def generate_seconds(model, prompt_ids: torch.Tensor, new_tokens: int) -> float:
    if prompt_ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    if prompt_ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "large"], default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the large model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument(
        "--experts-impl", default=None, help="transformers experts implementation of the large model"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args.model, args.device, args.layers, args.experts_impl)
    adapter = adapter_for(model)
    vocab = model.config.get_text_config().vocab_size
    prompt_ids = torch.randint(
        3, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
    ).to(args.device)
    meta = TraceMeta(
        adapter.num_layers, adapter.num_experts, adapter.top_k, adapter.expert_bytes, model=args.model
    )

    generate_seconds(model, prompt_ids, 8)  # warm-up
    off, on, rows = [], [], 0

    def logged_run(tmp: str, rep: int) -> float:
        nonlocal rows
        logger = RoutingLogger(f"{tmp}/{rep}", meta, "bench", LoggerConfig(queue_size=1 << 16))
        with RoutingRecorder(model, adapter, logger) as recorder:
            recorder.start_request(f"bench-{rep}")
            seconds = generate_seconds(model, prompt_ids, args.new_tokens)
        rows = logger.close().rows_written
        return seconds

    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            if rep % 2 == 0:
                off.append(generate_seconds(model, prompt_ids, args.new_tokens))
                on.append(logged_run(tmp, rep))
            else:
                on.append(logged_run(tmp, rep))
                off.append(generate_seconds(model, prompt_ids, args.new_tokens))
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    slowdown = (statistics.median(ratios) - 1.0) * 100.0
    best_off, best_on = min(off), min(on)
    med_off, med_on = statistics.median(off), statistics.median(on)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"

    print(
        f"routing-logger overhead: {args.model} model ({adapter.num_layers} MoE layers x {adapter.num_experts} "
        f"experts, top-{adapter.top_k}) on {device_name}, {args.new_tokens} new tokens, {args.repeats} pairs of runs, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(f"{'logging':>8} | {'best tok/s':>10} | {'median tok/s':>12} | {'best s':>8}")
    print(
        f"{'off':>8} | {args.new_tokens / best_off:10.2f} | {args.new_tokens / med_off:12.2f} | {best_off:8.4f}"
    )
    print(
        f"{'on':>8} | {args.new_tokens / best_on:10.2f} | {args.new_tokens / med_on:12.2f} | {best_on:8.4f}"
    )
    print(
        f"slowdown: {slowdown:+.2f}% (median of {args.repeats} paired ratios; IQR {100 * (q1 - 1):+.2f}% .. "
        f"{100 * (q3 - 1):+.2f}%; target < 3%); rows logged per run: {rows}"
    )
    print(
        json.dumps(
            {
                "bench": "logging_overhead",
                "model": args.model,
                "device": device_name,
                "moe_layers": adapter.num_layers,
                "num_experts": adapter.num_experts,
                "top_k": adapter.top_k,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "tokens_per_s_off": round(args.new_tokens / best_off, 3),
                "tokens_per_s_on": round(args.new_tokens / best_on, 3),
                "slowdown_pct": round(slowdown, 3),
                "slowdown_pct_q1": round(100 * (q1 - 1), 3),
                "slowdown_pct_q3": round(100 * (q3 - 1), 3),
                "rows_per_run": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
