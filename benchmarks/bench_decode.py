"""Decode speed of moecache's fast loop (moecache/runtime/decode_loop.py) against transformers' generate.

One model built from a config with random weights IN MEMORY (no checkpoint): the tiny model by default
(conf/model/tiny.yaml), or `--model conf/model/qwen3_6_35b_a3b.yaml`: the full Qwen3.6-35B-A3B text
decoder (all 40 layers), its fields from `--config-json` (default ../shared/reference/<name>.config.json),
checked against the yaml's `architecture`, built directly on the GPU in `--dtype` (bf16), vocabulary
`--vocab` (default 32768, as the runtime notes' measurements).

Runs, each greedy, batch 1, a prompt of `--prompt-tokens` random ids:
- unmodified: the model itself, experts `--experts-impl` (grouped_mm for bf16 on CUDA, else batched_mm;
  both graph-capturable):
  (a) transformers `model.generate` (eager, DynamicCache), (b) the fast loop without graphs, (c) with
  CUDA graphs (one graph per step: no host point);
- then offloaded (`moecache.offload`, the experts moved to the host store once; later capacities get a
  new manager on the same store) at each of `--capacities`: "100%" with static_cold (every expert
  resident, the mapping frozen: (b)/(c) "fused", one graph per step: the all-resident upper bound) and
  again with host points forced ("100% split": its difference to "fused", per MoE layer, is the expert
  path's own overhead: read-back, manager, publication, combine, graph launches); other capacities with
  `--policy` (lru) in split mode; (a) there is transformers' generate with whole layer visits.
The fast loop's time is the second `generate` call's (the first warms up and captures), decode steps
only; (a) is (time of N new tokens - time of 1) / (N - 1). Prefill is reported apart.

    python benchmarks/bench_decode.py                          # tiny model, CPU or GPU
    python benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --capacities 100%,25%

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from moecache.errors import MoecacheError

REPO = Path(__file__).resolve().parents[1]


# ---- the model ---------------------------------------------------------------------------------------


def build_model(args, device: torch.device):
    """(model, description) from the model yaml: the tiny build, or a full config (module docstring)."""
    import transformers

    from moecache.models import ADAPTERS, adapter_for

    cfg = yaml.safe_load(Path(args.model).read_text())
    dtype = getattr(torch, args.dtype) if args.dtype else getattr(torch, cfg.get("dtype") or "float32")
    if cfg.get("build"):  # the tiny model: its adapter's tiny config with the yaml's overrides
        config = ADAPTERS[cfg["model_type"]].tiny_config(**dict(cfg["build"].get("overrides") or {}))
        seed = int(cfg["build"].get("seed", 0))
    else:
        config = full_config(args, cfg)
        seed = 0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if args.vocab:
        text.vocab_size = args.vocab
    cls = (
        transformers.Qwen3_5MoeForCausalLM
        if cfg["model_type"] == "qwen3_5_moe"
        else getattr(transformers, config.architectures[0])
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(text).eval()
    finally:
        torch.set_default_dtype(default)
    arch = adapter_for(model).describe()
    want = cfg.get("architecture") or {}
    wrong = {k: (arch.get(k), v) for k, v in want.items() if arch.get(k) != v}
    if wrong:
        raise MoecacheError(f"{args.model}: architecture (built, yaml) disagree: {wrong}")
    return model, {"name": cfg["name"], "dtype": str(dtype), "vocab": text.vocab_size, **arch}


# Qwen3.6-35B-A3B's text fields beyond the yaml's `architecture` (its config.json), for a machine without
# ../shared: the layer pattern and the partial multimodal RoPE follow from qwen3_5_moe's tiny_config.
QWEN3_6_TEXT = {
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
}  # fmt: skip


def full_config(args, cfg: dict):
    """The text config of a full model from its config.json (the yaml names no checkpoint to read); for
    qwen3_5_moe without one, the yaml's architecture plus QWEN3_6_TEXT."""
    import transformers

    from moecache.models import ADAPTERS

    path = Path(args.config_json or REPO / f"../shared/reference/{cfg['name']}.config.json")
    if not path.is_file():
        if args.config_json or cfg["model_type"] != "qwen3_5_moe":
            raise MoecacheError(f"--config-json {path}: no such file (the full model's config.json)")
        a = cfg["architecture"]
        args.config_source = "builtin"
        return ADAPTERS["qwen3_5_moe"].tiny_config(
            num_hidden_layers=a["num_layers"], num_experts=a["num_experts"], num_experts_per_tok=a["top_k"],
            hidden_size=a["hidden_size"], moe_intermediate_size=a["moe_intermediate_size"],
            shared_expert_intermediate_size=a["shared_expert_intermediate_size"], **QWEN3_6_TEXT,
        ).text_config  # fmt: skip
    args.config_source = str(path)
    raw = json.loads(path.read_text())
    if cfg["model_type"] == "qwen3_5_moe":
        text = {k: v for k, v in raw["text_config"].items() if k not in ("model_type", "dtype")}
        return transformers.Qwen3_5MoeTextConfig(**text)
    return transformers.AutoConfig.for_model(**raw)


def optional_kernels() -> dict:
    """Which fast linear-attention kernels transformers can import (the qwen3_5_moe torch fallbacks
    are used otherwise)."""
    return {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}


# ---- the runs ----------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(model, prompt, new: int, device, reps: int) -> dict:
    """transformers' greedy generate: decode ms/token = (t(new) - t(1)) / (new - 1), medians of `reps`."""
    kwargs = dict(
        do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0, eos_token_id=None
    )
    ids = prompt.view(1, -1).to(device)

    def timed(n: int):
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - t0, out

    timed(2)  # warm-up
    one = statistics.median(timed(1)[0] for _ in range(reps))
    totals = [timed(new) for _ in range(reps)]
    total, out = statistics.median(t for t, _ in totals), totals[-1][1]
    ms = 1e3 * (total - one) / (new - 1)
    return {"loop": "transformers", "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "prefill_ms": 1e3 * one,
            "graphs_per_step": 0, "tokens": out[0, ids.shape[1]:].tolist()}  # fmt: skip


def run_fast(model, prompt, new: int, graphs: str, host_points: str = "auto", compile: bool = False) -> dict:
    from moecache.runtime.decode_loop import FastDecoder

    decoder = FastDecoder(
        model, max_cache_len=prompt.numel() + new, graphs=graphs, host_points=host_points, compile=compile
    )
    first = decoder.generate(prompt, new)  # warm-up (compilation) and capture
    result = decoder.generate(prompt, new)
    loop = "fast-graphs" if result.graphs_per_step else "fast-eager"
    return {
        "loop": loop + ("+compile" if compile else ""),
        "mode": result.mode,
        "ms_per_token": result.ms_per_token,
        "tokens_per_s": result.tokens_per_s,
        "prefill_ms": 1e3 * result.prefill_s,
        "graphs_per_step": result.graphs_per_step,
        "warmup_s": first.warmup_s,
        "tokens": result.tokens[0, prompt.numel() :].tolist(),
    }


def offload_session(model, capacity, policy: str, device: torch.device):
    """Offload the model's experts once (moecache.offload); later calls give it a new manager (this
    capacity and policy) on the same host store, the previous slot pool freed first."""
    from moecache.capacity import parse_capacity
    from moecache.offloading import OffloadSession, offload_model
    from moecache.runtime.device import CudaDevice, StandinDevice
    from moecache.runtime.experts_module import ExpertsRuntime, OffloadedExperts
    from moecache.runtime.manager import CacheManager

    session = getattr(model, "moecache", None)
    gc.collect()  # earlier runs' decoders and graph pools
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if session is None:
        return offload_model(model, capacity=capacity, policy=policy, device=str(device))
    store, cpu, arch = session.manager.store, session.runtime.cpu, session.architecture
    top_k = session.manager.shape.top_k
    parents = [
        (p, name)
        for p in model.modules()
        for name, c in p.named_children()
        if isinstance(c, OffloadedExperts)
    ]
    model.moecache = None
    for parent, name in parents:
        setattr(parent, name, torch.nn.Identity())
    del session
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    slots = parse_capacity(capacity, key="capacity", num_keys=store.num_layers * store.num_experts,
                           expert_bytes=store.expert_bytes)  # fmt: skip
    runtime_device = CudaDevice(device.index) if device.type == "cuda" else StandinDevice("before_visit")
    manager = CacheManager.from_policy(store, runtime_device, slots, policy, {}, top_k=top_k)
    runtime = ExpertsRuntime(manager, cpu)
    for layer_id, (parent, name) in enumerate(parents):
        setattr(parent, name, OffloadedExperts(layer_id, runtime))
    model.moecache = OffloadSession(manager, runtime, slots, arch)
    return model


def agree(tokens: list[int], reference: list[int]) -> int:
    """Leading generated tokens equal to the reference's."""
    n = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "conf/model/tiny.yaml"))
    ap.add_argument("--config-json", default=None)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the yaml's dtype)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (full models: 32768)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--capacities", default="100%,25%")
    ap.add_argument("--policy", default="lru", help="the policy of capacities below 100%")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--hf-new-tokens", type=int, default=16, help="transformers' generate (slow) decodes fewer"
    )
    ap.add_argument("--hf-reps", type=int, default=3, help="medians of this many transformers runs")
    ap.add_argument(
        "--experts-impl", default="batched_mm", help="the unmodified model's experts_implementation"
    )
    ap.add_argument("--skip", default="", help="comma list of: hf, offloaded")
    ap.add_argument(
        "--compile", action="store_true", help="also the fast loop with torch.compile (slow to build)"
    )
    args = ap.parse_args()
    if args.new_tokens < 3 or args.hf_new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 3 and --hf-new-tokens >= 2 (decode steps to time)")
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg_yaml = yaml.safe_load(Path(args.model).read_text())
    if args.vocab is None and not cfg_yaml.get("build"):
        args.vocab = 32768
    skip = set(filter(None, args.skip.split(",")))
    args.config_source = "the yaml's build" if cfg_yaml.get("build") else None
    t0 = time.perf_counter()
    model, described = build_model(args, device)
    build_s = time.perf_counter() - t0
    if args.experts_impl is None:
        bf16_cuda = device.type == "cuda" and described["dtype"] == str(torch.bfloat16)
        args.experts_impl = "grouped_mm" if bf16_cuda else "batched_mm"
    model.set_experts_implementation(args.experts_impl)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, described["vocab"], (args.prompt_tokens,), generator=gen).to(device)
    graphs = ["off", "on"] if device.type == "cuda" else ["off"]
    variants = [(g, False) for g in graphs] + (
        [("on" if device.type == "cuda" else "off", True)] if args.compile else []
    )
    runs, skipped = [], {}
    if device.type != "cuda":
        skipped["fast-graphs"] = "needs CUDA"

    def record(variant: str, policy: str | None, r: dict, reference: list[int] | None) -> None:
        r = {"variant": variant, "policy": policy, **r}
        if reference is not None:
            r["agree_with_transformers"] = agree(r["tokens"], reference)
        if getattr(model, "moecache", None) is not None:
            stats = model.moecache.stats()
            r["hit_rate"], r["fallback_entries"] = stats["hit_rate"], stats["fallback_entries"]
        r.pop("tokens")
        runs.append(r)
        print(f"  {variant:<12} {r['loop']:<19} {r['ms_per_token']:9.3f} ms/token", flush=True)

    hf_ref = None
    if "hf" not in skip:
        hf = run_hf(model, prompt, args.hf_new_tokens, device, args.hf_reps)
        hf_ref = hf["tokens"]
        record("unmodified", None, hf, None)
    for g, compiled in variants:
        record("unmodified", None, run_fast(model, prompt, args.new_tokens, g, compile=compiled), hf_ref)
    if "offloaded" not in skip:
        for capacity in filter(None, args.capacities.split(",")):
            full = capacity.strip() == "100%"
            policy = "static_cold" if full else args.policy
            t1 = time.perf_counter()
            offload_session(model, capacity, policy, device)
            offload_s = time.perf_counter() - t1
            print(f"offloaded at {capacity} ({policy}) in {offload_s:.1f} s", flush=True)
            if "hf" not in skip:
                model.moecache.reset()
                record(
                    capacity, policy, run_hf(model, prompt, args.hf_new_tokens, device, args.hf_reps), hf_ref
                )
            for g, compiled in variants:
                model.moecache.reset()
                record(
                    capacity, policy, run_fast(model, prompt, args.new_tokens, g, compile=compiled), hf_ref
                )
                if full:
                    model.moecache.reset()
                    r = run_fast(model, prompt, args.new_tokens, g, host_points="always", compile=compiled)
                    record("100% split", policy, r, hf_ref)
    result = {
        "bench": "decode",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "kernels": optional_kernels(),
        "model": described,
        "build_s": build_s,
        "args": vars(args),
        "runs": runs,
        "expert_path_overhead_us_per_layer": overhead(runs, described["num_layers"]),
        "skipped": skipped,
    }
    print_table(result)
    print(json.dumps(result))


def overhead(runs: list[dict], num_layers: int) -> dict:
    """(100% split - 100% fused) per MoE layer per token, in us, for each loop measured."""
    out = {}
    for loop in ("fast-eager", "fast-graphs", "fast-graphs+compile"):
        fused = [r for r in runs if r["variant"] == "100%" and r["loop"] == loop]
        split = [r for r in runs if r["variant"] == "100% split" and r["loop"] == loop]
        if fused and split:
            out[loop] = 1e3 * (split[0]["ms_per_token"] - fused[0]["ms_per_token"]) / num_layers
    return out


def print_table(r: dict) -> None:
    m = r["model"]
    print(
        f"decode benchmark on {r['gpu'] or r['device']}: {m['name']} ({m['num_layers']} MoE layers, "
        f"{m['num_experts']} experts, top-{m['top_k']}, {m['dtype']}, vocab {m['vocab']}); "
        f"kernels {r['kernels']}; torch {r['torch']}, transformers {r['transformers']}"
    )
    head = (
        f"{'variant':<12} | {'policy':<11} | {'loop':<19} | {'mode':<6} | {'graphs':>6} | {'ms/token':>9} | "
    )
    head += f"{'tokens/s':>9} | {'prefill ms':>10} | {'hit rate':>8} | {'= hf':>4}"
    print(head)
    for run in r["runs"]:
        hit = run.get("hit_rate")
        print(
            f"{run['variant']:<12} | {run['policy'] or '-':<11} | {run['loop']:<19} | {run.get('mode', '-'):<6} | "
            f"{run['graphs_per_step']:>6} | {run['ms_per_token']:>9.3f} | {run['tokens_per_s']:>9.1f} | "
            f"{run['prefill_ms']:>10.1f} | {'-' if hit is None else f'{hit:.3f}':>8} | "
            f"{run.get('agree_with_transformers', '-'):>4}"
        )
    for loop, us in r["expert_path_overhead_us_per_layer"].items():
        print(f"expert path overhead ({loop}): {us:.1f} us per MoE layer per token (100% split - fused)")
    for name, why in r["skipped"].items():
        print(f"{name}: skipped ({why})")


if __name__ == "__main__":
    main()
