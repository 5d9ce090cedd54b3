"""Tune slot_moe's launch configs on this CUDA device and write them as kernels/moecache_kernels/configs/ JSON.

For each token count T, times candidate block sizes (triton.testing.do_bench over CUDA-graph replays, L2
flushed, routings rotating over the whole expert pool so weights are cold) and keeps the fastest, checking each result
against the default config's. For T > 16 (prefill) the layout and TMA keys, BLOCK_M and the two stages'
tiles are searched likeliest first (PREFILL_LAYOUT below), the stages in turns; for T <= 16 the
decode's variant (slot_moe_config.DECODE_VARIANTS), its gate/up tile, its down tile, then the variant
again (the down tile may favour the other). The search stops at --budget-s (the best found so far is
kept), and the file is written atomically:
`E=..,N=..,device_name=..,dtype=bfloat16.json`, which `slot_moe` then loads for this device and shape.
With --merge-from DIR, entries of DIR's file for this shape whose T is not tuned now are kept.

    python benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 --top-k 8 --budget-s 150
    python benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 --top-k 8 --tokens 1 4 16 \
        --budget-s 120 --merge-from kernels/moecache_kernels/configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

TOKENS = (1, 4, 16, 64, 512, 4096)
DECODE_GATE_UP = [{"BLOCK_I": i, "BLOCK_H": h, "num_warps": w}
                  for i, h, w in itertools.product((2, 4, 8, 16, 32), (128, 256, 512), (4, 8))]  # fmt: skip
DECODE_DOWN = [{"BLOCK_H": h, "BLOCK_I": i, "num_warps": w}
               for h, i, w in itertools.product((1, 2, 4, 8, 16), (128, 256, 512), (4, 8))]  # fmt: skip
# prefill, likeliest first, so that a short --budget-s spends itself on these: each item is merged into the
# best entry so far (with_choice). The layout and TMA first (kernels/moecache_kernels/slot_moe_config.py), then BLOCK_M, then
# each stage's tile with its warps, its pipeline depth and its GROUP_M (the two stages in turns), then
# BLOCK_M and the layout again (the tiles may have moved them), then the rest of the full space
# PREFILL_STAGE (BLOCK_N 64/128/256 x BLOCK_K 32/64/128 x warps 4/8 x stages 2-5 x GROUP_M 1/8/16).
PREFILL_BLOCK_M = (16, 32, 64, 128)
PREFILL_LAYOUT = [("layout", "sorted"), ("tma", True), ("layout", "pairs"), ("tma", False)]
PREFILL_TILES = [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
    for n, k, w in (
        (128, 64, 8), (128, 64, 4), (64, 64, 4), (256, 64, 8), (128, 128, 8),
        (64, 128, 4), (128, 32, 4), (64, 32, 4), (256, 128, 8), (256, 32, 8),
    )
]  # fmt: skip
PREFILL_DEPTH = [{"num_stages": s} for s in (3, 4, 2, 5)]
PREFILL_GROUP = [{"GROUP_M": g} for g in (8, 16, 1)]
PREFILL_ALL_TILES = PREFILL_TILES + [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
    for n, k, w in itertools.product((64, 128, 256), (32, 64, 128), (4, 8))
    if {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} not in PREFILL_TILES
]
PREFILL_STAGE = [
    tile | depth | group
    for tile, depth, group in itertools.product(PREFILL_ALL_TILES, PREFILL_DEPTH, PREFILL_GROUP)
]


def candidates(num_tokens: int, default: dict, rows_per_expert: float | None = None):
    """(stage, choice) pairs to try in order, each merged into the best entry so far (with_choice): each
    stage's options with the other stage at its best. `rows_per_expert`: T*K/E, for prefill's BLOCK_M."""
    if "BLOCK_M" not in default:
        from moecache_kernels.slot_moe_config import DECODE_VARIANTS

        yield from (("variant", v) for v in DECODE_VARIANTS)
        yield from (("gate_up", c) for c in DECODE_GATE_UP)
        yield from (("down", c) for c in DECODE_DOWN)
        yield from (("variant", v) for v in DECODE_VARIANTS)
        return
    yield from prefill_candidates(num_tokens, rows_per_expert)


def prefill_candidates(num_tokens: int, rows_per_expert: float | None = None):
    """The prefill search, likeliest first (see PREFILL_LAYOUT): BLOCK_M nearest the mean rows per expert
    (T*K/E; T when not given) first, as padding each expert's run to BLOCK_M wastes about half a block."""
    mean = max(1.0, rows_per_expert if rows_per_expert is not None else float(num_tokens))
    fits = [m for m in PREFILL_BLOCK_M if m <= max(16, 4 * num_tokens)]
    block_ms = sorted(fits, key=lambda m: (abs(math.log2(m / mean)), -m))
    yield from PREFILL_LAYOUT[:2]
    yield from (("BLOCK_M", m) for m in block_ms)
    for choices in (PREFILL_TILES, PREFILL_DEPTH, PREFILL_GROUP[1:]):
        yield from _both_stages(choices)
    yield from (("BLOCK_M", m) for m in block_ms)
    yield from PREFILL_LAYOUT
    yield from _both_stages(PREFILL_STAGE)


def _both_stages(choices: list[dict]):
    """("gate_up", c) and ("down", c) for each choice c in turn."""
    for choice in choices:
        yield "gate_up", choice
        yield "down", choice


def prefill_smem_floor(entry: dict) -> int:
    """Bytes of shared memory a prefill entry's larger stage needs at least: its bf16 tiles (gate/up: x,
    gate and up; down: act and w2) times num_stages - 1 (Triton keeps up to num_stages buffers; on the
    H200 it asked num_stages - 1 or num_stages times the tiles). 0 for a decode entry."""
    if "BLOCK_M" not in entry:
        return 0
    block_m, need = entry["BLOCK_M"], 0
    for stage, operands in (("gate_up", 2), ("down", 1)):
        c = entry[stage]
        tiles = block_m * c["BLOCK_K"] + operands * c["BLOCK_K"] * c["BLOCK_N"]
        need = max(need, 2 * tiles * (c["num_stages"] - 1))
    return need


def device_smem_limit() -> int | None:
    """The device's opt-in shared memory per block (232,448 bytes on an H200), None where torch does not say."""
    return getattr(
        torch.cuda.get_device_properties(torch.cuda.current_device()), "shared_memory_per_block_optin", None
    )


def with_choice(best: dict, stage: str, choice) -> dict:
    """`best` with `choice` for `stage`: a stage's dict is updated key by key, a number replaced."""
    entry = json.loads(json.dumps(best))
    entry[stage] = entry[stage] | choice if isinstance(choice, dict) else choice
    return entry


def tune_one(
    num_tokens: int, args, pool, deadline: float, seed: dict | None = None
) -> tuple[dict, float, dict[str, float]]:
    """(best entry, its ms, {what: ms} of the default, of the search's best and, for decode, of the best
    entry of each variant tried) for one T; the search starts from `seed` (an entry already tuned for
    this T, e.g. from --merge-from) where it is of this T's path, else from the default."""
    from moecache_kernels.slot_moe import launch
    from moecache_kernels.slot_moe_config import DECODE_MAX_T, default_config
    from triton.testing import do_bench

    w13, w2, slot_of_E = pool
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    ids = [torch.randn(num_tokens, args.experts, generator=gen, device="cuda").topk(args.top_k, -1).indices
           for _ in range(8)]  # fmt: skip
    x = torch.randn(num_tokens, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(num_tokens, args.top_k, generator=gen, device="cuda"), -1).to(
        torch.bfloat16
    )
    out = torch.empty_like(x)

    def timed(entry) -> float:
        """ms per call inside one CUDA graph of a call per routing, as a MoE layer runs in the captured
        decode step: no Python launch overhead, no graph launch per call (bench_slot_moe's in-graph)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for routing in ids:
                launch(x, routing, w, slot_of_E, w13, w2, out, entry)
        return do_bench(graph.replay, warmup=3, rep=25) / len(ids)

    def checked_ms(entry, what: str) -> float | None:
        """The entry's time, or None (printed why) when it fails or its result is off the default's."""
        try:
            launch(x, ids[0], w, slot_of_E, w13, w2, out, entry)
            if not torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                print(f"  T={num_tokens} {what}: WRONG RESULT, skipped")
                return None
            return timed(entry)
        except Exception as err:  # out of shared memory / registers for this block shape
            print(f"  T={num_tokens} {what}: failed ({type(err).__name__}: {str(err)[:80]})")
            return None

    default = default_config(num_tokens)
    launch(x, ids[0], w, slot_of_E, w13, w2, out, default)
    want = out.float().clone()
    default_ms = timed(default)
    best, best_ms = default, default_ms
    by_variant: dict[str, float] = {}  # decode: the best ms of each variant tried

    def note(entry, ms) -> None:
        if "BLOCK_M" not in entry:
            v = entry.get("variant", "two_stage")
            by_variant[v] = min(ms, by_variant.get(v, ms))

    note(default, default_ms)
    if seed is not None and ("BLOCK_M" in seed) == (num_tokens > DECODE_MAX_T) and seed != default:
        ms = checked_ms(seed, "start")  # an entry of the other path is no start
        if ms is not None:  # the search starts from it even if the default is faster
            best, best_ms = seed, ms
            note(seed, ms)
    tried = {json.dumps(best, sort_keys=True), json.dumps(default, sort_keys=True)}
    smem_limit = device_smem_limit()
    for stage, choice in candidates(num_tokens, best, num_tokens * args.top_k / args.experts):
        if time.monotonic() > deadline:
            print(f"  T={num_tokens}: budget spent, keeping the best so far")
            break
        entry = with_choice(best, stage, choice)
        key = json.dumps(entry, sort_keys=True)
        if key in tried:
            continue
        tried.add(key)
        need = prefill_smem_floor(entry)
        if smem_limit is not None and need > smem_limit:  # it would fail to launch: no time spent on it
            print(f"  T={num_tokens} {stage}={choice}: skipped (>= {need} B of shared memory,"
                  f" the device has {smem_limit})")  # fmt: skip
            continue
        ms = checked_ms(entry, f"{stage}={choice}")
        if ms is not None:
            note(entry, ms)
        if ms is not None and ms < best_ms:
            best, best_ms = entry, ms
    times = {"default": default_ms, "best": best_ms} | {f"best {v}": ms for v, ms in by_variant.items()}
    if default_ms <= best_ms:  # e.g. a --merge-from start that nothing near it beat
        return default, default_ms, times
    return best, best_ms, times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop searching after this long")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "kernels" / "moecache_kernels" / "configs",
    )
    parser.add_argument(
        "--merge-from", type=Path, default=None,
        help="a config folder whose file for this shape gives the entries of token counts not tuned now",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_slot_moe: needs CUDA", file=sys.stderr)
        return 2
    from moecache_kernels.slot_moe_config import config_file_name, device_name, load_configs

    name = config_file_name(args.experts, args.inter, device_name(), torch.bfloat16)
    merged = {}
    if args.merge_from is not None:
        try:
            merged = load_configs(args.merge_from / name) or {}
        except ValueError as err:
            print(f"tune_slot_moe: --merge-from: {err}", file=sys.stderr)
            return 2
        print(f"{args.merge_from / name}: keeping T={sorted(t for t in merged if t not in args.tokens)},"
              f" starting from its T={sorted(t for t in merged if t in args.tokens)}")  # fmt: skip
    kept = {str(t): entry for t, entry in merged.items() if t not in args.tokens}

    gen = torch.Generator("cuda").manual_seed(0)
    pool = (
        torch.randn(args.experts, 2 * args.inter, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02,
        torch.randn(args.experts, args.hidden, args.inter, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02,
        torch.arange(args.experts, dtype=torch.int32, device="cuda"),
    )  # fmt: skip
    start = time.monotonic()
    table = dict(kept)
    for n, num_tokens in enumerate(args.tokens):
        # an equal share of what is left for each remaining T
        deadline = time.monotonic() + (start + args.budget_s - time.monotonic()) / (len(args.tokens) - n)
        best, best_ms, times = tune_one(num_tokens, args, pool, deadline, merged.get(num_tokens))
        table[str(num_tokens)] = best
        others = ", ".join(f"{what} {ms * 1e3:.1f} us" for what, ms in times.items())
        print(f"T={num_tokens}: {best_ms * 1e3:.1f} us ({others}) {json.dumps(best)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
