"""Output agreement of an offloaded model, within the tolerance of the existing implementation.

The plan: the operator must "preserve the model output within the tolerance of the existing CPU or ONNX
Runtime implementation". The baseline is the existing implementation as users run it, transformers'
default experts path (`--baseline grouped_mm`); the tolerance is the disagreement of the other
implementation transformers ships for the same layer (`--impls eager`, its per-expert loop) with it on the
same inputs. moecache offloaded at each capacity (policy lru, so hits run from the slot pool and misses on
the CPU in the same layer visits) must be within it on every figure (moecache/validation/agreement.py):
max and mean |logit - baseline logit| over all positions x vocabulary, and teacher-forced top-1
agreement. Every run is also compared with every transformers implementation (rows `vs <impl>`).

With `--fp32` (the default) the eager loop in float32 is the common truth (`agreement.float32_logits`: the
unmodified model's bfloat16 weights widened to float32 in place for one pass, exact both ways), the same
tokens and routing; every run is also compared with it (rows `vs fp32`): transformers' implementations'
and moecache's errors against the same truth.

One model of the `--model` yaml's shape (all its widths, the first `--layers` decoder layers, random
weights in bf16 on the device: moecache/models/random_full.py). Every run is trace-forced (moecache/
runtime/forced_routing.py), so all route the same (token, expert) entries with the same weights:
`--trace` an ESFT `.npz` (the real DeepSeek-V2-Lite routing, its first MoE layers), else the baseline's
own routing, captured in its greedy pass. Per request: a prompt (the trace's sequence id seeds it), the
baseline's greedy continuation, then every run fed those same tokens (prompt in one forward: the prefill
path; then one token per forward: the decode path) and its logits compared at every position.

    python benchmarks/bench_agreement.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 4
    python benchmarks/bench_agreement.py --model conf/model/deepseek_v2_lite.yaml --layers 3 \\
        --trace ../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz

On CUDA the hits run through the Triton slot-pool kernel; on the CPU through its torch reference (the
runtime's stand-in device). Prints a table and ends with one JSON line.

Legend: L MoE layers, N positions of a request, K top-k, E experts, P prompt tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CAPACITIES = ("10%", "25%", "50%")


def build(
    model_yaml: Path, layers: int, vocab: int, device: torch.device, dtype: torch.dtype, overrides=None
):
    """The yaml's model cut to its first `layers` decoder layers (moecache/models/random_full.py), its
    text config's `overrides` (a dict: narrower widths) applied."""
    from moecache.models.adapter import adapter_for
    from moecache.models.random_full import build_random_model

    cfg = yaml.safe_load(model_yaml.read_text())
    random = {
        "seed": 0,
        "vocab_size": vocab,
        "num_layers": layers,
        "config_json": None,
        "overrides": overrides or {},
    }
    model, _ = build_random_model({**cfg, "path": None, "random": random}, device, dtype)
    name = f"{cfg['name']} (first {layers} decoder layers)"
    return model, {"name": name, "vocab": vocab, **adapter_for(model).describe()}


def trace_requests(path: Path, arch: dict, requests: int, positions: int, prompt: int) -> dict:
    """The first `requests` ESFT sequences of at least `positions` tokens, cut to `positions` tokens and
    the model's first L MoE layers: {request id: (ids [L, N, K], weights [L, N, K], P)}."""
    from moecache.trace.esft_import import load_esft_npz

    with np.load(path) as npz:
        trace_layers = int(npz["expert_ids"].shape[1])
    arrays = load_esft_npz(
        path, num_layers=trace_layers, num_experts=arch["num_experts"], top_k=arch["top_k"]
    )
    L = arch["num_layers"]
    out = {}
    for s in range(arrays.num_sequences):
        a, b = int(arrays.seq_offsets[s]), int(arrays.seq_offsets[s + 1])
        if b - a < positions:
            continue
        ids_NLK = arrays.expert_ids[a : a + positions, :L]
        w_NLK = arrays.gate_weights[a : a + positions, :L]
        rid = f"{path.stem}/seq-{s:04d}"
        out[rid] = (
            ids_NLK.transpose(1, 0, 2).astype(np.int64),
            w_NLK.transpose(1, 0, 2).astype(np.float32),
            prompt,
        )
        if len(out) == requests:
            return out
    raise SystemExit(f"{path}: fewer than {requests} sequences of >= {positions} tokens")


def prompt_of(rid: str, prompt: int, vocab: int) -> list[int]:
    """The request's prompt tokens, seeded by its id (ForcedRouting.input_ids' rule)."""
    from moecache.runtime.forced_routing import ForcedRouting

    one = ForcedRouting.from_arrays(
        {rid: (np.zeros((1, prompt, 1), np.int64), np.ones((1, prompt, 1), np.float32), prompt)},
        num_experts=1,
    )
    return one.input_ids(rid, vocab)[0].tolist()


def vs_fp32(run: str, logits: dict, truth: dict) -> dict:
    """A transformers implementation's row against the float32 truth."""
    from moecache.validation.agreement import logit_errors

    return {"run": run, "vs": "fp32", **logit_errors(logits, truth).figures(), "cpu_entries": None,
            "gpu_entries": None}  # fmt: skip


def progress(started: float, what: str) -> None:
    print(f"  [{time.perf_counter() - started:6.0f} s] {what}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "conf/model/qwen3_6_35b_a3b.yaml"))
    ap.add_argument(
        "--layers", type=int, default=4,
        help="decoder layers kept (Qwen3.6: at least 4, to keep its first full-attention layer, from which "
        "transformers computes the attention mask)",
    )  # fmt: skip
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument(
        "--trace", default=None, help="an ESFT .npz forcing the routing (default: the baseline's)"
    )
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--positions", type=int, default=160, help="positions per request (prompt included)")
    ap.add_argument("--capacities", nargs="+", default=list(CAPACITIES))
    ap.add_argument("--policy", default="lru")
    ap.add_argument(
        "--baseline", default="grouped_mm", help="transformers' experts path every run is compared with"
    )
    ap.add_argument("--impls", nargs="+", default=["eager"], help="transformers' other paths: the tolerance")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--overrides", type=json.loads, default=None,
        help='text config fields as JSON, e.g. \'{"hidden_size": 64}\' (a narrower model; the tests\')',
    )  # fmt: skip
    ap.add_argument(
        "--fp32", action=argparse.BooleanOptionalAction, default=True,
        help="also compare every run with the eager loop in float32 (module docstring)",
    )  # fmt: skip
    args = ap.parse_args()
    from moecache.models.adapter import adapter_for
    from moecache.offloading import offload_model
    from moecache.runtime.forced_routing import ForcedRouting, moe_routers
    from moecache.validation.agreement import (
        FIGURES,
        RoutingCapture,
        float32_logits,
        logit_errors,
        teacher_forced,
        teacher_forced_all,
        within_spread,
    )

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    started = time.perf_counter()
    model, described = build(
        Path(args.model), args.layers, args.vocab, device, torch.bfloat16, args.overrides
    )
    arch = adapter_for(model).describe()
    P, N = args.prompt_tokens, args.positions
    if args.trace is not None:
        arrays = trace_requests(Path(args.trace), arch, args.requests, N, P)
        routing = f"forced by {Path(args.trace).name} (its first {arch['num_layers']} MoE layers)"
    else:
        arrays = {f"self/req-{r}": None for r in range(args.requests)}
        routing = "forced to the baseline's own (captured in its greedy pass)"
    prompts = {rid: prompt_of(rid, P, args.vocab) for rid in arrays}

    if args.baseline in args.impls:
        raise SystemExit(f"--impls {args.impls}: the baseline {args.baseline!r} cannot be its own tolerance")
    # 1. the baseline's greedy continuation (its own routing captured, or the trace's forced)
    model.set_experts_implementation(args.baseline)
    feed = {}
    if args.trace is not None:
        forced = ForcedRouting.from_arrays(arrays, num_experts=arch["num_experts"])
        with forced.attach(model):
            for rid, prompt in prompts.items():
                forced.start_request(rid)
                feed[rid] = teacher_forced(model, prompt, steps=N - P).tokens[P:]
    else:
        for rid, prompt in prompts.items():
            with RoutingCapture(moe_routers(model)) as capture:
                feed[rid] = teacher_forced(model, prompt, steps=N - P).tokens[P:]
            arrays[rid] = capture.arrays(P)  # N rows per layer: the prompt's P, then one per fed token
        forced = ForcedRouting.from_arrays(arrays, num_experts=arch["num_experts"])

    # 2. transformers' implementations, teacher-forced on the same tokens and routing
    progress(started, "baseline greedy pass done")
    logits = {args.baseline: teacher_forced_all(model, prompts, feed, forced)}
    for impl in args.impls:
        model.set_experts_implementation(impl)
        logits[impl] = teacher_forced_all(model, prompts, feed, forced)
        progress(started, f"{impl} done")
    base = logits[args.baseline]
    scale = float(torch.cat(list(base.values())).std())
    truth = None
    if args.fp32:
        model.set_experts_implementation("eager")
        truth = float32_logits(model, prompts, feed, forced)
        progress(started, "float32 eager done")
    rows = [
        {"run": impl, "vs": args.baseline, **logit_errors(logits[impl], base).figures(), "cpu_entries": None,
         "gpu_entries": None}
        for impl in args.impls
    ]  # fmt: skip
    tolerance = {r["run"]: logit_errors(logits[r["run"]], base) for r in rows}
    spread = []  # transformers' own implementations against the float32 truth
    if truth is not None:
        rows += [vs_fp32(run, logits[run], truth) for run in [args.baseline, *args.impls]]
        spread = [r for r in rows if r["vs"] == "fp32"]

    # 3. moecache offloaded (the model's experts go to the host store), a new cold cache per capacity
    gc.collect()
    offload_model(model, capacity=0, policy="static_cold", device=str(device))
    for capacity in args.capacities:
        session = model.moecache.reconfigure(capacity=capacity, policy=args.policy)
        stats = session.runtime.counters
        cpu0, gpu0 = stats.cpu_entries, stats.gpu_entries
        got = teacher_forced_all(model, prompts, feed, forced)
        errors = logit_errors(got, base)
        progress(started, f"moecache {capacity} done")
        within = {impl: errors.within(tol) for impl, tol in tolerance.items()}
        refs = [(args.baseline, base)] + [(impl, logits[impl]) for impl in args.impls]
        for vs, ref in refs + ([("fp32", truth)] if truth is not None else []):
            figures = logit_errors(got, ref).figures()
            rows.append({
                "run": f"moecache {capacity} {args.policy}", "vs": vs, **figures,
                "cpu_entries": stats.cpu_entries - cpu0, "gpu_entries": stats.gpu_entries - gpu0,
                "slots": session.manager.capacity,
                **({"within": within} if vs == args.baseline else {}),
                **({"within_spread": within_spread(figures, spread)} if vs == "fp32" else {}),
            })  # fmt: skip
        del got
        gc.collect()
    verdict = all(all(w.values()) for r in rows if "within" in r for w in r["within"].values())
    in_spread = all(r["within_spread"] for r in rows if "within_spread" in r) if truth is not None else None

    print(
        f"agreement on {device}, bf16: {described['name']}, {arch['num_layers']} MoE layers x "
        f"{arch['num_experts']} experts, top-{arch['top_k']}, vocab {args.vocab}; {len(prompts)} requests x "
        f"{N} positions ({P} prompt + {N - P} fed), teacher-forced on {args.baseline}'s greedy tokens; routing "
        f"{routing}; baseline {args.baseline} (logit std {scale:.4g}); {time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'run':<22} | {'vs':<10} | {'max |err|':>9} | {'mean |err|':>10} | {'top-1':>6} | "
        f"{'within':<12} | gpu / cpu entries"
    )
    for r in rows:
        mark = ""
        if "within" in r:
            mark = "yes" if all(all(w.values()) for w in r["within"].values()) else "NO"
        if "within_spread" in r:
            mark = "yes (spread)" if r["within_spread"] else "NO (spread)"
        entries = "" if r["cpu_entries"] is None else f"{r['gpu_entries']} / {r['cpu_entries']}"
        print(
            f"{r['run']:<22} | {r['vs']:<10} | {r['max_abs_logit_error']:9.4g} | "
            f"{r['mean_abs_logit_error']:10.4g} | {r['top1_agreement']:6.4f} | {mark:<12} | {entries}"
        )
    print(f"every moecache figure within every transformers pair's: {'yes' if verdict else 'NO'} ({FIGURES})")
    if in_spread is not None:
        print(
            "every moecache run as close to the float32 truth as transformers' own bf16 implementations (errors at"
            f" most the largest of theirs, top-1 at least the lowest): {'yes' if in_spread else 'NO'}"
        )
    print(json.dumps({
        "bench": "agreement", "device": str(device), "model": described, "routing": routing,
        "requests": len(prompts), "positions": N, "prompt_tokens": P, "policy": args.policy,
        "baseline": args.baseline, "impls": args.impls,
        "logit_std": scale, "rows": rows, "within": verdict, "within_float32_spread": in_spread,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
