"""Output agreement of an offloaded model with the unmodified one, against the model's own bf16 error.

A random-weight model's greedy tokens are a poor equality test in bf16 (near-flat logits: one rounding
flips an argmax), so this measures logits. One model of the `--model` yaml's shape (all its widths, the
first `--layers` decoder layers, random weights on the GPU in fp32), then, on one random prompt's
prefill, the last position's logits of:

- the unmodified model in fp32: the reference;
- the unmodified model cast to bf16: the model's own bf16 error (what any bf16 run of it carries);
- offloaded (`moecache.offload`, every expert resident, static_cold) in fp32 and in bf16;
- offloaded in bf16 at `--capacity` (lru: CPU misses mixed in).

Each row: max |logit - reference|, that error relative to the reference logits' standard deviation, the
reference's top-1 and top-5 agreement. The offloaded fp32 row must be at fp32 rounding; an offloaded bf16
row within a small multiple of the unmodified bf16 row's error is "bf16 within tolerance".

    python benchmarks/bench_agreement.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 8

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def build(model_yaml: Path, layers: int, vocab: int, device: torch.device):
    """The yaml's model cut to its first `layers` decoder layers (moecache/models/random_full.py), fp32."""
    from moecache.models.adapter import adapter_for
    from moecache.models.random_full import build_random_model

    cfg = yaml.safe_load(model_yaml.read_text())
    random = {"seed": 0, "vocab_size": vocab, "num_layers": layers, "config_json": None, "overrides": {}}
    model, _ = build_random_model({**cfg, "path": None, "random": random}, device, torch.float32)
    name = f"{cfg['name']} (first {layers} layers)"
    return model, {"name": name, "vocab": vocab, **adapter_for(model).describe()}


@torch.inference_mode()
def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits[0, -1].float()


def compare(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (logits - ref).abs().max().item()
    top5_ref = set(ref.topk(5).indices.tolist())
    return {
        "max_abs_error": err,
        "error_over_std": err / ref.std().item(),
        "top1_equal": int(logits.argmax()) == int(ref.argmax()),
        "top5_overlap": len(top5_ref & set(logits.topk(5).indices.tolist())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "conf/model/qwen3_6_35b_a3b.yaml"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--capacity", default="25%")
    args = ap.parse_args()
    from moecache.offloading import offload_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, described = build(Path(args.model), args.layers, args.vocab, device)
    base.set_experts_implementation("batched_mm")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, described["vocab"], (1, args.prompt_tokens), generator=gen).to(device)
    ref = last_logits(base, ids)
    rows = []

    def row(name: str, model) -> None:
        rows.append({"run": name, **compare(last_logits(model, ids), ref)})
        print(f"  {name:<36} {rows[-1]['max_abs_error']:.4g}", flush=True)

    row("unmodified fp32 (reference, again)", base)
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        if dtype == torch.bfloat16:
            unmodified = copy.deepcopy(base).to(dtype)
            row("unmodified bf16", unmodified)
            del unmodified
        for capacity, policy in (("100%", "static_cold"), (args.capacity, "lru")):
            if dtype == torch.float32 and capacity != "100%":
                continue
            offloaded = offload_model(
                copy.deepcopy(base).to(dtype), capacity=capacity, policy=policy, device=str(device)
            )
            row(f"offloaded {name} {capacity} {policy}", offloaded)
            del offloaded
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(
        f"logit agreement on {device}: {described['name']}, "
        f"({described['num_experts']} experts, top-{described['top_k']}, vocab {described['vocab']}), "
        f"{args.prompt_tokens}-token prompt, last position, reference unmodified fp32 (std {ref.std().item():.4g})"
    )
    print(f"{'run':<36} | max |err| | err / std | top-1 | top-5")
    for r in rows:
        print(
            f"{r['run']:<36} | {r['max_abs_error']:9.4g} | {r['error_over_std']:9.4g} | "
            f"{'yes' if r['top1_equal'] else 'no':>5} | {r['top5_overlap']:>5}"
        )
    print(json.dumps({"bench": "agreement", "model": described, "layers": args.layers, "rows": rows}))


if __name__ == "__main__":
    main()
