"""Cost of the logit lens in collect: generation time with the routing logger on, lens at rate 0 vs r.

Runs the same greedy generation (fixed prompt, fixed number of new tokens, EOS ignored) with the
routing logger attached, in rounds; each round runs every rate once, in a rotating order. Per rate it
reports the median wall time, the median lens time that `LogitLens.take_seconds` measured (what
`collect` subtracts) and the median of wall - lens. The paired ratios against rate 0 (same round)
show the lens overhead (wall) and how well the subtraction removes it (wall - lens: ~1.0 when the
measured time is the time the lens added). Ends with one JSON line.

    python benchmarks/bench_logit_lens.py --model tiny                 # the tiny qwen3_5_moe, CPU
    python benchmarks/bench_logit_lens.py --model large --device cuda  # random Qwen3.6-shaped layers, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from bench_logging import generate_seconds  # sibling script: greedy generate, timed

from moecache.models import ADAPTERS, adapter_for
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.lens import LogitLens
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import TraceMeta


def build_model(name: str, device: str, layers: int):
    """tiny: the tiny qwen3_5_moe text model (the architecture `model=tiny` collects from, own random
    weights); large: Qwen3.6-35B-A3B layer shapes, `layers` decoder layers, vocab 32000, bf16."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    if name == "tiny":
        config = ADAPTERS["qwen3_5_moe"].tiny_config().text_config
        dtype = torch.float32
    else:
        config = Qwen3_5MoeTextConfig(
            num_hidden_layers=layers,
            vocab_size=32000,
            layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        )
        dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(config).to(dtype)
    if device == "cpu":
        model.set_experts_implementation("eager")
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "large"], default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the large model")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = sorted(set(args.rates) | {0.0})

    model = build_model(args.model, args.device, args.layers)
    adapter = adapter_for(model)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(args.device)
    meta = TraceMeta(adapter.num_layers, adapter.num_experts, adapter.top_k, adapter.expert_bytes)

    def run(tmp: str, tag: str, rate: float) -> tuple[float, float]:
        logger = RoutingLogger(f"{tmp}/{tag}", meta, "bench", LoggerConfig(queue_size=1 << 16))
        lens = LogitLens(adapter, rate, 0) if rate > 0 else None
        with RoutingRecorder(model, adapter, logger, lens) as recorder, torch.inference_mode():
            recorder.start_request(tag)
            wall = generate_seconds(model, prompt, args.new_tokens)
        logger.close()
        return wall, lens.take_seconds() if lens is not None else 0.0

    wall = {r: [] for r in rates}
    lens_s = {r: [] for r in rates}
    with tempfile.TemporaryDirectory() as tmp:
        run(tmp, "warmup", max(rates))
        for rnd in range(args.rounds):
            k = rnd % len(rates)
            for rate in rates[k:] + rates[:k]:
                w, s = run(tmp, f"r{rnd}-{rate}", rate)
                wall[rate].append(w)
                lens_s[rate].append(s)

    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    tokens = args.prompt_tokens + args.new_tokens - 1
    print(
        f"logit-lens overhead: {args.model} model ({adapter.num_layers} MoE layers, vocab {vocab}) on {device_name}, "
        f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.rounds} rounds, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(
        f"{'rate':>5} | {'wall s':>8} | {'lens s':>8} | {'wall-lens s':>11} | {'wall/r0':>8} | {'(wall-lens)/r0':>14}"
    )
    result = {}
    for rate in rates:
        ratio = statistics.median(w / w0 for w, w0 in zip(wall[rate], wall[0.0], strict=True))
        excl = statistics.median(
            (w - s) / w0 for w, s, w0 in zip(wall[rate], lens_s[rate], wall[0.0], strict=True)
        )
        med_w, med_s = statistics.median(wall[rate]), statistics.median(lens_s[rate])
        med_x = statistics.median(w - s for w, s in zip(wall[rate], lens_s[rate], strict=True))
        print(f"{rate:5.2f} | {med_w:8.4f} | {med_s:8.4f} | {med_x:11.4f} | {ratio:8.4f} | {excl:14.4f}")
        result[str(rate)] = {
            "wall_s": round(med_w, 5),
            "lens_s": round(med_s, 5),
            "wall_minus_lens_s": round(med_x, 5),
            "wall_ratio": round(ratio, 4),
            "wall_minus_lens_ratio": round(excl, 4),
        }
    print(
        json.dumps(
            {
                "bench": "logit_lens_overhead",
                "model": args.model,
                "device": device_name,
                "tokens_per_run": tokens,
                "moe_layers": adapter.num_layers,
                "rounds": args.rounds,
                "threads": torch.get_num_threads(),
                "rates": result,
            }
        )
    )


if __name__ == "__main__":
    main()
