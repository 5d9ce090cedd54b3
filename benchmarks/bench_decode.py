"""Decode speed of moecache's fast loop (moecache/runtime/decode_loop.py) against transformers' generate.

One model built from a config with random weights IN MEMORY (no checkpoint): the tiny model by default
(conf/model/tiny.yaml), or `--model conf/model/qwen3_6_35b_a3b.yaml`: the full Qwen3.6-35B-A3B text
decoder (all 40 layers; or conf/model/deepseek_v2_lite.yaml), built by moecache/models/random_full.py
(its built-in config fields, or `--config-json`), checked against the yaml's `architecture`, directly
on the GPU in `--dtype` (bf16), vocabulary
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
`--cpu-teams 15:work,15:idle,...` runs each capacity below 100% once per CPU-path team: the executor's
OpenMP threads, the GPU-driving thread working among them or idle in them (CpuExperts' host_thread).
`--router-topk-ab` runs each offloaded run again with the routers' own `torch.topk` (on CUDA the offloaded
model's routers take moecache's one-launch top-k, moecache/runtime/router_topk.py), an A/B on one model.
`--visit-first` runs each capacity below 100% again with every layer's visit before its CPU half (the
host point's order before the visit moved to the next host point, moecache/runtime/segments.py).
`--decode-stream-share S` runs each capacity below 100% again with that share of every decode visit's
misses run on the device (runtime.decode_stream_share, moecache/runtime/decode_stream.py).
The fast loop's time is the second `generate` call's (the first warms up and captures), decode steps
only; (a) is (time of N new tokens - time of 1) / (N - 1). Prefill is reported apart.

    python benchmarks/bench_decode.py                          # tiny model, CPU or GPU
    python benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --capacities 100%,25%

`--strategies` (a comma list of all_resident, all_cpu, lru_sync, policy; or "all") runs, instead, the
baselines of `moecache validate` (moecache/validation/baselines.py) on the fast loop, one offloaded model
switched between them by `model.moecache.reconfigure` (the same host store): all_resident (100%
static_cold), all_cpu (capacity 0), lru_sync (lru_per_layer split equal, on_miss="wait": synchronous
on-demand copies) and the policy under test (`--policy`) at each of `--capacities`. `--forced-trace PATH`
(a canonical trace, or a DeepSeek ESFT `.npz` through the importer: step 0 its first `--prompt-tokens`
tokens) forces the routing of its first `--requests` requests (moecache/runtime/forced_routing.py; the
fast loop then always runs split, host points at every MoE layer, the forced rows written there), each
request decoding up to `--new-tokens` tokens; without it, one request of `--prompt-tokens` random ids.
Per strategy one FastDecoder: one warm-up request (capture), `model.moecache.reset()`, then every
request timed (decode steps only). Reported: decode tokens/s per strategy, policy / all_cpu and policy /
lru_sync at each capacity (the issue's targets at 25%: >= 2 and >= 1.5), and whether each strategy's
tokens equal all_resident's.

    python benchmarks/bench_decode.py --model conf/model/deepseek_v2_lite.yaml --strategies all \
        --capacities 25% --forced-trace ../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from moecache.errors import MoecacheError
from moecache.validation.repeats import rounds

REPO = Path(__file__).resolve().parents[1]


# ---- the model ---------------------------------------------------------------------------------------


def build_model(args, device: torch.device):
    """(model, description) from the model yaml: the tiny build, or the full random model of
    moecache/models/random_full.py (its built-in config fields unless --config-json)."""
    from moecache.models import ADAPTERS, adapter_for
    from moecache.models.random_full import build_random_model, fill_experts, instantiate

    cfg = yaml.safe_load(Path(args.model).read_text())
    dtype = getattr(torch, args.dtype) if args.dtype else getattr(torch, cfg.get("dtype") or "float32")
    if cfg.get("build"):  # the tiny model: its adapter's tiny config with the yaml's overrides
        if getattr(args, "layers", None) is not None:
            raise MoecacheError(f"--layers: {args.model} is a tiny build; --layers cuts full models only")
        import transformers

        config = ADAPTERS[cfg["model_type"]].tiny_config(**dict(cfg["build"].get("overrides") or {}))
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if args.vocab:
            text.vocab_size = args.vocab
        cls = (
            transformers.Qwen3_5MoeForCausalLM
            if cfg["model_type"] == "qwen3_5_moe"
            else getattr(transformers, config.architectures[0])
        )
        seed = int(cfg["build"].get("seed", 0))
        model = instantiate(cls, text, device, dtype, seed)  # the routed experts on the meta device
        fill_experts(model, adapter_for(model), seed, device)
    else:
        random = {"seed": 0, "vocab_size": args.vocab, "num_layers": getattr(args, "layers", None),
                  "config_json": args.config_json, "overrides": {}}  # fmt: skip
        model, _ = build_random_model({**cfg, "path": None, "random": random}, device, dtype)
        args.config_source = args.config_json or "built-in fields (moecache/models/random_full.py)"
    arch = adapter_for(model).describe()
    vocab = model.get_output_embeddings().weight.shape[0]
    return model, {"name": cfg["name"], "dtype": str(dtype), "vocab": vocab, **arch}


def environment(device: torch.device, described: dict) -> dict:
    """The JSON line's machine, software and model fields (both modes of the benchmark)."""
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "kernels": optional_kernels(),
        "model": described,
    }


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
        **result.host.rates(),  # the host points per visit and per CPU call (LayerCounters.rates)
        "cpu_calls_per_token": result.host.cpu_calls / result.timed_steps if result.timed_steps else None,
        "tokens": result.tokens[0, prompt.numel() :].tolist(),
    }


def cpu_teams(ap, value: str | None) -> list[tuple[int, str] | None]:
    """`--cpu-teams` as [(threads, host_thread)], or [None] (the executor as offload made it)."""
    if value is None:
        return [None]
    from moecache.runtime.cpu_experts import HOST_THREADS

    teams = []
    for item in filter(None, value.split(",")):
        threads, _, host = item.partition(":")
        if not threads.isdigit() or int(threads) < 1 or host not in HOST_THREADS:
            ap.error(f"--cpu-teams: '{item}' is not THREADS:work or THREADS:idle (THREADS >= 1)")
        teams.append((int(threads), host))
    if not teams:
        ap.error("--cpu-teams: empty")
    return teams


def set_cpu_team(model, threads: int, host_thread: str) -> None:
    """The offloaded model's CPU path rebuilt on the same host weights with this team (every later
    run, and a reconfigured session, uses it)."""
    from moecache.runtime.cpu_experts import CpuExperts

    runtime = model.moecache.runtime
    old = runtime.cpu
    runtime.cpu = CpuExperts(
        old.w13_GIH, old.w2_GHI, threads=threads, backend=old.backend, host_thread=host_thread
    )
    old.close()


@contextlib.contextmanager
def visit_first():
    """The fast loop's host points with each layer's visit before its CPU half, on the step's critical
    path (the order before the visit was deferred past it), for an A/B on one machine: as then, only a
    visit whose every entry hits is deferred, and only on CUDA."""
    from moecache.runtime.segments import ExpertsTaps

    deferred = ExpertsTaps._defer_visit

    def covered_only(taps, layer, ids_TK):
        return taps.is_cuda and taps.manager.covers(layer, ids_TK) and deferred(taps, layer, ids_TK)

    ExpertsTaps._defer_visit = covered_only
    try:
        yield
    finally:
        ExpertsTaps._defer_visit = deferred


def offload_session(model, capacity, policy: str, device: torch.device, params=None, on_miss: str = "cpu"):
    """Offload the model's experts once (moecache.offload); later calls reconfigure its session
    (`model.moecache.reconfigure`): a new manager of this capacity, policy and on_miss on the same host
    store, the previous slot pool freed first."""
    from moecache.offloading import offload_model

    gc.collect()  # earlier runs' decoders and graph pools
    if device.type == "cuda":
        torch.cuda.empty_cache()
    session = getattr(model, "moecache", None)
    if session is None:
        return offload_model(
            model, capacity=capacity, policy=policy, params=params, device=str(device), on_miss=on_miss
        )
    session.reconfigure(capacity=capacity, policy=policy, params=params, on_miss=on_miss)
    return model


def agree(tokens: list[int], reference: list[int]) -> int:
    """Leading generated tokens equal to the reference's."""
    n = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


# ---- strategies: the validate baselines on the fast loop -------------------------------------------------

STRATEGIES = ("all_resident", "all_cpu", "lru_sync", "policy")
TARGETS = {"all_cpu": 2.0, "lru_sync": 1.5}  # policy / baseline decode tokens/s the issue asks for
TARGET_CAPACITY = "25%"


def strategy_names(value: str) -> list[str]:
    names = list(STRATEGIES) if value.strip() == "all" else [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names or len(set(names)) != len(names):
        raise MoecacheError(
            f"--strategies {value!r}: expected a comma list of distinct {', '.join(STRATEGIES)}, or all"
        )
    return [n for n in STRATEGIES if n in names]


def strategy_plan(names: list[str], capacities: list[str], policy: str) -> list[dict]:
    """One run per (strategy, capacity): what the manager is reconfigured to."""
    plan = []
    for name in names:
        if name == "all_resident":
            plan.append(dict(strategy=name, capacity="100%", policy="static_cold", params={}, on_miss="cpu"))
        elif name == "all_cpu":
            plan.append(dict(strategy=name, capacity="0", policy="static_cold", params={}, on_miss="cpu"))
        elif name == "lru_sync":
            plan += [
                dict(strategy=name, capacity=c, policy="lru_per_layer", params={"split": "equal"}, on_miss="wait")
                for c in capacities
            ]  # fmt: skip
        else:
            plan += [
                dict(strategy=name, capacity=c, policy=policy, params={}, on_miss="cpu") for c in capacities
            ]
    return plan


def forced_workload(args, described: dict):
    """(forced routing, [(request id, prompt [1, P], new tokens)], description) of `--forced-trace`."""
    from moecache.runtime.forced_routing import ForcedRouting
    from moecache.trace.esft_import import EsftArrays, esft_to_table, load_esft_npz
    from moecache.trace.schema import TraceMeta

    path = Path(args.forced_trace)
    shape = {k: described[k] for k in ("num_layers", "num_experts", "top_k")}
    if path.suffix == ".npz":
        arrays = load_esft_npz(path, **shape)
        n = min(args.warm_requests + args.requests, arrays.num_sequences)
        end = int(arrays.seq_offsets[n])
        arrays = EsftArrays(arrays.expert_ids[:end], arrays.gate_weights[:end], arrays.seq_offsets[: n + 1])
        meta = TraceMeta(**shape, expert_bytes=described["expert_bytes"], model=described["name"])
        table = esft_to_table(
            arrays, name=path.stem, run_id="bench_decode", tokens_per_step=args.prompt_tokens, meta=meta
        )
        forced = ForcedRouting.from_trace(table, **shape, max_tokens=args.prompt_tokens + args.new_tokens - 1)
    else:
        forced = ForcedRouting.from_trace(path, **shape)
    requests = []
    for rid in forced.request_ids[: args.warm_requests + args.requests]:
        new = min(args.new_tokens, forced.decode_steps(rid) + 1)
        if new < 2:
            raise MoecacheError(
                f"--forced-trace {path}: request {rid!r} has {forced.decode_steps(rid)} decode steps; the "
                "benchmark times decode steps (at least 1 after the first token)"
            )
        requests.append((rid, forced.input_ids(rid, described["vocab"]), new))
    if len(requests) <= args.warm_requests:
        raise MoecacheError(
            f"--forced-trace {path}: {len(requests)} requests, none left to time after --warm-requests "
            f"{args.warm_requests}"
        )
    about = {
        "path": str(path), "warm_requests": args.warm_requests, "requests": [r for r, _, _ in requests],
        "prompt_tokens": [int(p.shape[1]) for _, p, _ in requests], "new_tokens": [n for _, _, n in requests],
    }  # fmt: skip
    return forced, requests, about


def _stats_since(before: dict, after: dict) -> dict:
    """`model.moecache.stats()` counters between two snapshots (the hit rate of the accesses between)."""
    out = dict(after)
    for key in ("hits", "misses", "accesses", "copies", "waited_copies", "fallback_entries", "gpu_entries"):
        out[key] = after[key] - before[key]
    out["hit_rate"] = out["hits"] / out["accesses"] if out["accesses"] else None
    return out


def run_strategy(
    model, spec: dict, requests, forced, device: torch.device, warm_requests: int = 0, compile: bool = False
) -> dict:
    """One strategy: reconfigure, one FastDecoder, a warm-up request (kernels, capture), reset, the first
    `warm_requests` requests untimed (the cache warmed by earlier traffic), then the others timed; the
    counters are those of the timed requests. `compile`: the decoder's step through torch.compile."""
    from moecache.runtime.decode_loop import FastDecoder
    from moecache.runtime.layer_counters import LayerCounters

    t0 = time.perf_counter()
    offload_session(model, spec["capacity"], spec["policy"], device, spec["params"], spec["on_miss"])
    reconfigure_s = time.perf_counter() - t0
    max_len = max(int(p.shape[-1]) + n for _, p, n in requests)
    decoder = FastDecoder(model, max_cache_len=max_len, forced=forced, compile=compile)

    def one(rid, prompt, new):
        if forced is not None:
            forced.start_request(rid)
        model.moecache.begin_request()
        return decoder.generate(prompt, new)

    t0 = time.perf_counter()
    one(*requests[0])  # warm-up: kernels, capture
    warmup_s = time.perf_counter() - t0
    model.moecache.reset()
    for r in requests[:warm_requests]:  # earlier traffic: the timed requests find the cache it left
        one(*r)
    before = model.moecache.stats()
    results = [one(*r) for r in requests[warm_requests:]]
    stats = _stats_since(before, model.moecache.stats())
    timed, decode_s = sum(r.timed_steps for r in results), sum(r.decode_s for r in results)
    ms = 1e3 * decode_s / timed
    host = sum((r.host for r in results), LayerCounters())
    return {
        **{k: spec[k] for k in ("strategy", "capacity", "on_miss")},
        "policy": stats["policy"], "slots": stats["capacity"],
        "loop": ("fast-graphs" if results[0].graphs_per_step else "fast-eager") + ("+compile" if compile else ""),
        "mode": results[0].mode, "graphs_per_step": results[0].graphs_per_step,
        "timed_steps": timed, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
        "prefill_ms": 1e3 * statistics.median(r.prefill_s for r in results), "warmup_s": warmup_s,
        "reconfigure_s": reconfigure_s, "hit_rate": stats["hit_rate"], "copies": stats["copies"],
        "waited_copies": stats["waited_copies"], "fallback_entries": stats["fallback_entries"],
        "gpu_entries": stats["gpu_entries"],
        **host.rates(),
        "tokens": [r.tokens[0, r.prompt_tokens :].tolist() for r in results],
    }  # fmt: skip


def strategy_ratios(runs: list[dict], capacities: list[str]) -> dict:
    """Per capacity: policy / all_cpu and policy / lru_sync decode tokens/s (the targets at 25%)."""

    def at(strategy, capacity=None):
        found = [
            r for r in runs if r["strategy"] == strategy and (capacity is None or r["capacity"] == capacity)
        ]
        return found[0]["tokens_per_s"] if found else None

    out = {}
    for cap in capacities:
        policy = at("policy", cap)
        if policy is None:
            continue
        row = {}
        for base, baseline in (("all_cpu", at("all_cpu")), ("lru_sync", at("lru_sync", cap))):
            if baseline:
                ratio = policy / baseline
                row[f"policy_over_{base}"] = ratio
                if cap == TARGET_CAPACITY:
                    row[f"meets_{base}_target"] = ratio >= TARGETS[base]
        out[cap] = row
    return out


def strategies_bench(args, model, described: dict, device: torch.device, prompt: torch.Tensor) -> dict:
    names = strategy_names(args.strategies)
    capacities = [c.strip() for c in args.capacities.split(",") if c.strip()]
    if args.forced_trace:
        forced, requests, about = forced_workload(args, described)
    else:
        forced, requests, about = None, [("random", prompt.view(1, -1).cpu(), args.new_tokens)], None
    runs = []
    for spec in strategy_plan(names, capacities, args.policy):
        run = run_strategy(model, spec, requests, forced, device, args.warm_requests, args.compile)
        runs.append(run)
        print(f"  {run['strategy']:<12} {run['capacity']:>5} {run['ms_per_token']:9.3f} ms/token", flush=True)
    reference = next((r["tokens"] for r in runs if r["strategy"] == "all_resident"), None)
    for run in runs:
        if reference is not None:
            run["equal_all_resident"] = run["tokens"] == reference
            run["agree_all_resident"] = sum(
                agree(a, b) for a, b in zip(run["tokens"], reference, strict=True)
            )
    return {
        "bench": "decode-strategies",
        **environment(device, described),
        "args": vars(args),
        "forced": about,
        "runs": runs,
        "ratios": strategy_ratios(runs, capacities),
        "targets": {"capacity": TARGET_CAPACITY, **{f"policy_over_{k}": v for k, v in TARGETS.items()}},
    }


def print_strategies(r: dict) -> None:
    m = r["model"]
    forced = r["forced"]
    how = "natural routing"
    if forced:
        warm = forced.get("warm_requests", 0)
        timed = len(forced["requests"]) - warm
        how = f"forced by {forced['path']} ({timed} requests timed" + (
            f", after {warm} untimed)" if warm else ")"
        )
    print(
        f"strategies on {r['gpu'] or r['device']}: {m['name']} ({m['num_layers']} MoE layers, "
        f"{m['num_experts']} experts, top-{m['top_k']}, {m['dtype']}), {how}"
    )
    print(
        f"{'strategy':<12} | {'capacity':>8} | {'policy':<26} | {'on_miss':<7} | {'mode':<5} | {'graphs':>6} | "
        f"{'ms/token':>9} | {'tokens/s':>9} | {'hit rate':>8} | {'= all_resident':>14}"
    )
    for run in r["runs"]:
        hit = run["hit_rate"]
        same = run.get("equal_all_resident")
        print(
            f"{run['strategy']:<12} | {run['capacity']:>8} | {run['policy']:<26} | {run['on_miss']:<7} | "
            f"{run['mode']:<5} | {run['graphs_per_step']:>6} | {run['ms_per_token']:>9.3f} | "
            f"{run['tokens_per_s']:>9.1f} | {'-' if hit is None else f'{hit:.3f}':>8} | "
            f"{'-' if same is None else ('yes' if same else 'no'):>14}"
        )
    for cap, row in r["ratios"].items():
        parts = [
            f"{k.replace('_', ' ')} = {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
            for k, v in row.items()
        ]
        print(f"at {cap}: " + "; ".join(parts))


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and device arguments `build_model` reads (profile_decode.py's too)."""
    ap.add_argument("--model", default=str(REPO / "conf/model/tiny.yaml"))
    ap.add_argument("--config-json", default=None)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the yaml's dtype)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (full models: 32768)")
    ap.add_argument("--layers", type=int, default=None, help="full models: the first N decoder layers only")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--capacities", default="100%,25%")
    ap.add_argument(
        "--policy",
        default="lru",
        help="comma list: the policies of capacities below 100%% (each capacity runs once per policy)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--hf-new-tokens", type=int, default=16, help="transformers' generate (slow) decodes fewer"
    )
    ap.add_argument("--hf-reps", type=int, default=3, help="medians of this many transformers runs")
    ap.add_argument(
        "--experts-impl", default="batched_mm", help="the unmodified model's experts_implementation"
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of: hf (transformers' own generate), offloaded, unmodified (the unmodified model's "
        "fast loop), eager (the fast loop without graphs)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also the fast loop with torch.compile (slow to build); with --strategies: every strategy compiled",
    )
    ap.add_argument(
        "--strategies", default=None, help=f"comma list of {', '.join(STRATEGIES)} or all (module docstring)"
    )
    ap.add_argument(
        "--forced-trace", default=None, help="a canonical trace or an ESFT .npz forcing the routing"
    )
    ap.add_argument("--requests", type=int, default=2, help="with --forced-trace: its first N requests")
    ap.add_argument(
        "--cpu-teams",
        default=None,
        help="comma list of THREADS:work|idle: capacities below 100%% run once per CPU-path team (its OpenMP "
        "threads; the GPU-driving thread working in it, or idle in it); default: the executor's own",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="each loop's runs this many times, every other round in reverse order (A/B pairs with the "
        "order effect of a process balanced); a table of medians follows",
    )
    ap.add_argument(
        "--split-all",
        action="store_true",
        help="capacities below 100%%: each run again with every layer split (host_points=always: no fused or "
        "CPU-only layers under a fixed placement), an A/B",
    )
    ap.add_argument(
        "--visit-first",
        action="store_true",
        help="capacities below 100%%: each run again with the layer's visit before its CPU half (A/B)",
    )
    ap.add_argument(
        "--decode-stream-share",
        type=float,
        default=None,
        help="capacities below 100%%: each run again with runtime.decode_stream_share at this share (a decode "
        "visit's misses partly run on the device, moecache/runtime/decode_stream.py), an A/B",
    )
    ap.add_argument(
        "--router-topk-ab",
        action="store_true",
        help="each offloaded run again with the routers' own torch.topk (moecache/runtime/router_topk.py "
        "switched off for the run), an A/B",
    )
    ap.add_argument(
        "--warm-requests",
        type=int,
        default=0,
        help="with --strategies and --forced-trace: run this many of the trace's requests untimed first, "
        "without a reset, so the timed ones (the next --requests) find a warm cache",
    )
    args = ap.parse_args()
    if args.forced_trace and args.strategies is None:
        args.strategies = "all"
    if args.decode_stream_share is not None:
        from moecache.errors import MoecacheError
        from moecache.runtime.decode_stream import check_share

        try:
            check_share(args.decode_stream_share)
        except MoecacheError as exc:
            ap.error(f"--decode-stream-share: {exc}")
    if args.strategies is not None and "," in args.policy:
        ap.error(f"--policy {args.policy}: one policy with --strategies (its 'policy' strategy)")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be >= 1")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: must be >= 1")
    if args.warm_requests < 0 or (args.warm_requests and not args.forced_trace):
        ap.error(f"--warm-requests {args.warm_requests}: must be >= 0, and > 0 only with --forced-trace")
    if args.new_tokens < 3 or args.hf_new_tokens < 2:
        ap.error("--new-tokens must be >= 3 and --hf-new-tokens >= 2 (decode steps to time)")
    teams = cpu_teams(ap, args.cpu_teams)
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg_yaml = yaml.safe_load(Path(args.model).read_text())
    if args.vocab is None and not cfg_yaml.get("build"):
        args.vocab = 32768
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {"hf", "offloaded", "unmodified", "eager"}
    if unknown:
        ap.error(f"--skip {args.skip}: unknown {sorted(unknown)} (want hf, offloaded, unmodified, eager)")
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
    if args.strategies is not None:
        result = strategies_bench(args, model, described, device, prompt)
        result["build_s"] = build_s
        print_strategies(result)
        print(json.dumps(result))
        return
    graphs = ["off", "on"] if device.type == "cuda" else ["off"]
    if "eager" in skip and device.type == "cuda":
        graphs = ["on"]
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
    for g, compiled in variants if "unmodified" not in skip else ():
        record("unmodified", None, run_fast(model, prompt, args.new_tokens, g, compile=compiled), hf_ref)
    if "offloaded" not in skip:
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        runs_of = [
            (capacity, policy)
            for capacity in filter(None, args.capacities.split(","))
            for policy in (["static_cold"] if capacity.strip() == "100%" else policies)
        ]
        for capacity, policy in runs_of:
            full = capacity.strip() == "100%"
            t1 = time.perf_counter()
            offload_session(model, capacity, policy, device)
            offload_s = time.perf_counter() - t1
            print(f"offloaded at {capacity} ({policy}) in {offload_s:.1f} s", flush=True)
            switched = model.moecache.router_topk
            if switched is not None:
                print(
                    f"routers' top-k kernel: {len(switched.layers)} layers; refused {switched.refused}",
                    flush=True,
                )
            if "hf" not in skip:
                model.moecache.reset()
                record(
                    capacity, policy, run_hf(model, prompt, args.hf_new_tokens, device, args.hf_reps), hf_ref
                )
            for team in teams if not full else [None]:
                label = capacity if team is None else f"{capacity} {team[0]}:{team[1]}"
                if team is not None:
                    set_cpu_team(model, *team)
                # the runs of one loop: the default, and the A/B variants asked for (the host points
                # everywhere at 100%); rounds > 1 repeat them, every other round in reverse order
                jobs = [(label, {})]
                if args.visit_first and not full:
                    jobs.append((label + " visit-first", {"visit_first": True}))
                if args.decode_stream_share and not full:
                    jobs.append(
                        (label + f" stream{args.decode_stream_share:g}", {"share": args.decode_stream_share})
                    )
                if args.split_all and not full:
                    jobs.append((label + " split", {"host_points": "always"}))
                if full:
                    jobs.append(("100% split", {"host_points": "always"}))
                if args.router_topk_ab and model.moecache.router_topk is not None:
                    jobs += [(name + " torch-topk", how | {"torch_topk": True}) for name, how in jobs]
                for g, compiled in variants:
                    for rnd, _, (name, how) in rounds(jobs, args.rounds):
                        model.moecache.reset()
                        model.moecache.runtime.stream_decode(how.get("share", 0))  # the decoder takes it
                        with (
                            visit_first() if how.get("visit_first") else contextlib.nullcontext(),
                            model.moecache.router_topk.suspended()
                            if how.get("torch_topk")
                            else contextlib.nullcontext(),
                        ):
                            r = run_fast(
                                model, prompt, args.new_tokens, g, host_points=how.get("host_points", "auto"),
                                compile=compiled,
                            )  # fmt: skip
                        if team is not None:
                            r["cpu_threads"], r["host_thread"] = team
                        r["round"] = rnd
                        r["streamed_experts"] = model.moecache.stats()["streamed_experts"]
                        record(name, policy, r, hf_ref)
    result = {
        "bench": "decode",
        **environment(device, described),
        "build_s": build_s,
        "args": vars(args),
        "runs": runs,
        "expert_path_overhead_us_per_layer": overhead(runs, described["num_layers"]),
        "medians": medians(runs),
        "skipped": skipped,
    }
    print_table(result)
    print(json.dumps(result))


def medians(runs: list[dict]) -> list[dict]:
    """Per (variant, policy, loop) measured more than once (`--rounds`): the median, least and most ms per
    token over its runs."""
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        groups.setdefault((r["variant"], r["policy"], r["loop"]), []).append(r["ms_per_token"])
    return [
        {"variant": v, "policy": p, "loop": loop, "runs": len(ms), "median_ms_per_token": statistics.median(ms),
         "min_ms_per_token": min(ms), "max_ms_per_token": max(ms)}
        for (v, p, loop), ms in groups.items() if len(ms) > 1
    ]  # fmt: skip


def overhead(runs: list[dict], num_layers: int) -> dict:
    """(100% split - 100% fused) per MoE layer per token, in us, for each loop measured (medians over
    `--rounds`)."""
    out = {}
    for loop in ("fast-eager", "fast-graphs", "fast-graphs+compile"):
        fused = [r["ms_per_token"] for r in runs if r["variant"] == "100%" and r["loop"] == loop]
        split = [r["ms_per_token"] for r in runs if r["variant"] == "100% split" and r["loop"] == loop]
        if fused and split:
            out[loop] = 1e3 * (statistics.median(split) - statistics.median(fused)) / num_layers
    return out


def print_table(r: dict) -> None:
    m = r["model"]
    print(
        f"decode benchmark on {r['gpu'] or r['device']}: {m['name']} ({m['num_layers']} MoE layers, "
        f"{m['num_experts']} experts, top-{m['top_k']}, {m['dtype']}, vocab {m['vocab']}); "
        f"kernels {r['kernels']}; torch {r['torch']}, transformers {r['transformers']}"
    )
    head = (
        f"{'variant':<12} | {'policy':<13} | {'loop':<19} | {'mode':<6} | {'graphs':>6} | {'ms/token':>9} | "
    )
    head += f"{'tokens/s':>9} | {'prefill ms':>10} | {'hit rate':>8} | {'= hf':>4} | {'mgr us/visit':>12}"
    # the host point's read-back wait; the CPU path per call, and of it the executor's library call alone
    head += f" | {'wait us/visit':>13} | {'cpu us/call':>11} | {'exec us/call':>12}"
    print(head)

    def cell(value, width):
        return f"{'-' if value is None else f'{value:.2f}':>{width}}"

    for run in r["runs"]:
        hit = run.get("hit_rate")
        print(
            f"{run['variant']:<12} | {run['policy'] or '-':<13} | {run['loop']:<19} | {run.get('mode', '-'):<6} | "
            f"{run['graphs_per_step']:>6} | {run['ms_per_token']:>9.3f} | {run['tokens_per_s']:>9.1f} | "
            f"{run['prefill_ms']:>10.1f} | {'-' if hit is None else f'{hit:.3f}':>8} | "
            f"{run.get('agree_with_transformers', '-'):>4} | {cell(run.get('manager_us_per_visit'), 12)} | "
            f"{cell(run.get('readback_wait_us_per_visit'), 13)} | {cell(run.get('cpu_path_us_per_call'), 11)} | "
            f"{cell(run.get('cpu_exec_us_per_call'), 12)}"
        )
    for loop, us in r["expert_path_overhead_us_per_layer"].items():
        print(f"expert path overhead ({loop}): {us:.1f} us per MoE layer per token (100% split - fused)")
    for m in r.get("medians", []):
        print(
            f"{m['variant']:<12} | {m['policy'] or '-':<13} | {m['loop']:<19} | median of {m['runs']}: "
            f"{m['median_ms_per_token']:.3f} ms/token ({m['min_ms_per_token']:.3f}-{m['max_ms_per_token']:.3f})"
        )
    for name, why in r["skipped"].items():
        print(f"{name}: skipped ({why})")


if __name__ == "__main__":
    try:
        main()
    except MoecacheError as exc:
        print(f"bench_decode: error: {exc}", file=sys.stderr)
        sys.exit(2)
