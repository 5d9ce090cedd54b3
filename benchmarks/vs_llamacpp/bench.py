"""moecache against llama.cpp on the same random weights: prefill and decode tokens/s at equal GPU expert memory.

One seeded random checkpoint in the Hugging Face layout (`write`, moecache's own random model and writer)
is read by moecache through its real loader and, converted to a bf16 GGUF by llama.cpp's converter
(convert.py), by llama-bench. At each point both sides hold the same bytes of routed experts on the GPU:

| point | llama-bench | moecache |
| --- | --- | --- |
| all on GPU | `-ngl 99 -ncmoe 0` | `capacity=<every expert's bytes>B` |
| 50% / 25% | `-ngl 99 -ncmoe N`: the experts of the first N blocks in host memory | `capacity=<the bytes -ncmoe N leaves on the GPU>B` |
| all in host | `-ngl 99 -ncmoe <all blocks>` (what `--cpu-moe` does) | `capacity=0B` |

llama.cpp places experts by whole layers, so a share is met as `floor(share x MoE layers)` layers on the GPU
and moecache gets exactly those bytes as its memory budget (`plan_points`; both sides' own view of the
expert bytes is checked against it: the GGUF's tensors, moecache's adapter). Measured at each point: prefill
(pp, a prompt of `--pp` tokens) and decode (tg, `--tg` tokens after a one-token prompt), the median of
`--reps` runs after one warm-up, batch 1, `--threads` CPU threads on both sides.

- llama.cpp: one llama-bench call over every point (`-p PP -n TG -r REPS -t THREADS -o jsonl`); each sample
  of its `samples_ts`.
- moecache: the model loaded once (`load_model` with an offload request, as `moecache generate` loads it),
  `offload_model` with generate's defaults (its default policy), then per point a new cache
  (`model.moecache.reconfigure(capacity=...)`) and moecache's fast decode loop (`FastDecoder`, the loop
  `moecache generate` runs): pp = prompt tokens / the prefill's time (first token included, as generate
  reports it), tg = decode steps / their time. Per test one untimed warm-up request (kernels, CUDA graph
  capture, the cache's first fill), then the timed requests; the cache is not reset between them (a serving
  process's steady state). Token ids are random, as llama-bench's. With `--forced-trace` (DeepSeek-V2-Lite
  shape only: 26 MoE layers x 64 experts, top-6) each point runs again with the routing forced by real
  DeepSeek-V2-Lite traces (moecache/runtime/forced_routing.py): pp from requests of at least PP tokens,
  tg from their first TG + 1 tokens.

    python benchmarks/vs_llamacpp/bench.py write --shape dsv2 --out /dev/shm/ckpt
    python benchmarks/vs_llamacpp/bench.py llama --shape dsv2 --checkpoint CKPT --gguf FILE --llama-bench BIN
    python benchmarks/vs_llamacpp/bench.py moecache --shape dsv2 --checkpoint CKPT --forced-trace NPZ
    python benchmarks/vs_llamacpp/bench.py report --results DIR --shapes dsv2 qwen

`llama` and `moecache` each save their results as JSON under `--results` (so either can run in a device call
of its own); `report` prints the Markdown table and ends with one JSON line. benchmarks/vs_llamacpp/run.sh
drives the phases on the device machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The model shapes: moecache's model yaml and llama.cpp's architecture name.
SHAPES = {
    "dsv2": {"yaml": "deepseek_v2_lite", "arch": "deepseek2"},
    "qwen": {"yaml": "qwen3_6_35b_a3b", "arch": "qwen35moe"},
}
# `--size tiny`: hidden sizes and vocabulary cut (text config fields of moecache's random model,
# `model.random.overrides`), the routing shape (experts, top-k) kept: the CPU proof of the whole pipeline.
TINY = {
    "dsv2": {
        "vocab_size": 1024,
        "overrides": {
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        },
    },
    "qwen": {
        "vocab_size": 1024,
        "overrides": {
            "hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256,
            "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
    },
}  # fmt: skip
# The shares of the MoE layers' experts kept on the GPU, in the order the points run.
SHARES = (("all on GPU", 1.0), ("50%", 0.5), ("25%", 0.25), ("all in host", 0.0))
SIDECAR = "vs_llamacpp.json"  # beside the checkpoint: how `write` made it
ESFT_SHAPE = {"num_layers": 26, "num_experts": 64, "top_k": 6}  # the real DeepSeek-V2-Lite traces' routing


class BadInput(Exception):
    """A bad argument or input file: one line on stderr and exit code 2."""


# ---- the points (pure: tests/benchmarks/test_vs_llamacpp.py) ------------------------------------------


def moe_blocks(config: dict) -> list[int]:
    """The decoder blocks with routed experts, from a checkpoint's config.json (text fields)."""
    text = config.get("text_config") or config
    n = int(text["num_hidden_layers"])
    model_type = text.get("model_type", "")
    if model_type == "deepseek_v2":
        first, freq = int(text.get("first_k_dense_replace", 0)), int(text.get("moe_layer_freq", 1))
        return [i for i in range(n) if i >= first and i % freq == 0]
    if model_type.startswith("qwen3_5_moe"):
        dense = set(text.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense]
    raise BadInput(f"config.json: model_type {model_type!r}: expected deepseek_v2 or qwen3_5_moe")


def expert_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """One routed expert's bytes (gate, up and down projections) at `dtype_bytes` per weight."""
    text = config.get("text_config") or config
    return 3 * int(text["hidden_size"]) * int(text["moe_intermediate_size"]) * dtype_bytes


def num_experts(config: dict) -> int:
    text = config.get("text_config") or config
    return int(text.get("n_routed_experts") or text["num_experts"])


@dataclass(frozen=True)
class Point:
    """One memory point: the experts of `gpu_layers` MoE layers on the GPU on both sides."""

    label: str
    share: float  # the share asked for
    gpu_layers: int  # MoE layers whose experts are on the GPU
    n_cpu_moe: int  # llama-bench -ncmoe: the experts of blocks 0 .. n_cpu_moe - 1 in host memory
    gpu_expert_bytes: int
    capacity: str  # moecache's capacity: the same bytes as a memory budget
    slots: int  # the slots that budget gives moecache
    gpu_fraction: float  # gpu_layers / MoE layers


def n_cpu_moe_for(blocks: list[int], cpu_layers: int) -> int:
    """The smallest -ncmoe N whose blocks 0 .. N-1 hold exactly the first `cpu_layers` MoE layers."""
    if not 0 <= cpu_layers <= len(blocks):
        raise BadInput(f"cpu_layers={cpu_layers}: expected 0 .. {len(blocks)}")
    return 0 if cpu_layers == 0 else blocks[cpu_layers - 1] + 1


def plan_points(
    blocks: list[int], n_blocks: int, experts: int, expert_size: int, shares=SHARES
) -> list[Point]:
    """The points of `shares`: floor(share x MoE layers) layers' experts on the GPU (llama.cpp places them
    by layer, the last layers on the GPU), -ncmoe N for the rest, moecache's budget the same bytes. The
    all-in-host point is -ncmoe n_blocks, as llama.cpp's --cpu-moe (every block's experts in host memory)."""
    if sorted(set(blocks)) != list(blocks) or not blocks or blocks[-1] >= n_blocks or blocks[0] < 0:
        raise BadInput(f"MoE blocks {blocks}: expected increasing indices below {n_blocks}")
    points = []
    for label, share in shares:
        if not 0.0 <= share <= 1.0:
            raise BadInput(f"share {share}: expected 0 .. 1")
        gpu = math.floor(share * len(blocks) + 1e-9)
        n_cpu = n_blocks if gpu == 0 else n_cpu_moe_for(blocks, len(blocks) - gpu)
        nbytes = gpu * experts * expert_size
        points.append(Point(label, share, gpu, n_cpu, nbytes, f"{nbytes}B", nbytes // expert_size,
                            gpu / len(blocks)))  # fmt: skip
    return points


def gpu_layers_of(blocks: list[int], n_cpu: int) -> int:
    """MoE layers whose experts llama-bench keeps on the GPU with -ncmoe n_cpu (and -ngl 99)."""
    return sum(1 for b in blocks if b >= n_cpu)


# ---- llama-bench output (pure) ----------------------------------------------------------------------


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's `-o json` (one array) or `-o jsonl` (one object a line; a run cut short keeps the
    lines it finished) as a list of test objects."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"llama-bench output: not JSON ({exc})") from exc
    else:
        rows = []
        lines = text.splitlines()
        for n, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if n == len(lines) and n > 1 and line.lstrip().startswith("{"):
                    break  # the line being written when llama-bench was stopped
                raise BadInput(f"llama-bench output line {n}: not JSON ({exc})") from exc
    for row in rows:
        if not isinstance(row, dict) or "samples_ts" not in row or "n_prompt" not in row:
            raise BadInput(f"llama-bench output: a test without samples_ts / n_prompt: {str(row)[:120]}")
    return rows


def llama_test_label(row: dict) -> str:
    """llama-bench's name of a test: pp512, tg128, or pp512+tg128 (-pg)."""
    p, g = int(row["n_prompt"]), int(row["n_gen"])
    return f"pp{p}" if g == 0 else f"tg{g}" if p == 0 else f"pp{p}+tg{g}"


def summarize_llama(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """{n_cpu_moe: {"pp"|"tg": {"test", "median_ts", "samples_ts", "avg_ts", "stddev_ts"}}}."""
    out: dict[int, dict[str, dict]] = {}
    for row in rows:
        name = llama_test_label(row)
        kind = "pp" if name.startswith("pp") and "+" not in name else "tg" if name.startswith("tg") else None
        if kind is None:
            continue
        samples = [float(s) for s in row["samples_ts"]]
        out.setdefault(int(row.get("n_cpu_moe", 0)), {})[kind] = {
            "test": name, "median_ts": statistics.median(samples) if samples else None, "samples_ts": samples,
            "avg_ts": row.get("avg_ts"), "stddev_ts": row.get("stddev_ts"),
        }  # fmt: skip
    return out


# ---- write: the random checkpoint ------------------------------------------------------------------


def model_cfg(shape: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(
        OmegaConf.load(REPO / "conf/model" / f"{SHAPES[shape]['yaml']}.yaml"), resolve=True
    )


def write(args) -> None:
    """The seeded random model of the shape (moecache/models/random_full.py) written with `save_pretrained`
    plus moecache's byte tokenizer: the Hugging Face layout moecache's loader and llama.cpp's converter read."""
    import torch

    from moecache.models.random_full import build_random_model, random_options, text_config
    from moecache.models.tokenizer import build_byte_tokenizer

    cfg = model_cfg(args.shape)
    tiny = TINY[args.shape] if args.size == "tiny" else {"vocab_size": None, "overrides": {}}
    cfg["path"] = None
    cfg["random"].update(seed=args.seed, vocab_size=tiny["vocab_size"], overrides=dict(tiny["overrides"]))
    full_layers = text_config(cfg, {**random_options(cfg), "overrides": {}}).num_hidden_layers
    if args.layers is not None and not 1 <= args.layers <= full_layers:
        raise BadInput(
            f"--layers {args.layers}: the {args.shape} shape has 1 .. {full_layers} decoder layers"
        )
    cfg["random"]["num_layers"] = args.layers if args.layers != full_layers else None
    # The checkpoint's bytes (the model's parameters in bf16, from its shapes alone) against the free space
    meta, _ = build_random_model(cfg, "meta", torch.bfloat16)
    need = sum(p.numel() for p in meta.parameters()) * 2
    args.out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.out).free
    if need > free:
        raise BadInput(
            f"--out {args.out}: the checkpoint needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free there"
        )
    del meta
    start = time.perf_counter()
    model, _ = build_random_model(cfg, args.device, torch.bfloat16)
    model.save_pretrained(args.out, max_shard_size=args.shard)
    build_byte_tokenizer().save_pretrained(args.out)
    cut = sorted(tiny["overrides"]) + (["num_hidden_layers"] if cfg["random"]["num_layers"] else [])
    sidecar = {
        "shape": args.shape, "size": args.size, "seed": args.seed, "layers": args.layers or full_layers,
        "full_layers": full_layers, "vocab_size": tiny["vocab_size"], "overrides": tiny["overrides"],
        "cut_fields": cut,
    }  # fmt: skip
    (args.out / SIDECAR).write_text(json.dumps(sidecar, indent=1))
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"wrote {args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s ({args.shape}, "
          f"{sidecar['layers']} of {full_layers} layers, {args.size})")  # fmt: skip


# ---- the checkpoint both sides read ---------------------------------------------------------------


def checkpoint_plan(folder: Path) -> tuple[dict, dict, list[int], list[Point]]:
    """(config.json, the writer's sidecar or {}, MoE blocks, points) of a checkpoint folder."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"{folder}/config.json: {' '.join(str(exc).split())}") from exc
    sidecar_file = folder / SIDECAR
    sidecar = json.loads(sidecar_file.read_text()) if sidecar_file.is_file() else {}
    blocks = moe_blocks(config)
    text = config.get("text_config") or config
    points = plan_points(blocks, int(text["num_hidden_layers"]), num_experts(config), expert_bytes(config))
    return config, sidecar, blocks, points


def gguf_experts(gguf: Path, llama_src: Path) -> tuple[str | None, dict[int, int]]:
    """(llama.cpp architecture, {block: bytes of its routed-expert tensors}) of a GGUF file, read with
    llama.cpp's own gguf-py."""
    import re

    sys.path.insert(0, str(llama_src / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    out: dict[int, int] = {}
    for tensor in reader.tensors:
        m = re.match(r"blk\.(\d+)\.ffn_(?:gate|up|down|gate_up)_(?:ch)?exps\.", tensor.name)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + int(tensor.n_bytes)
    return arch, out


# ---- llama: llama-bench at every point ----------------------------------------------------------


def llama(args) -> dict:
    config, sidecar, blocks, points = checkpoint_plan(args.checkpoint)
    for path, what in ((args.gguf, "--gguf"), (args.llama_bench, "--llama-bench")):
        if not path.is_file():
            raise BadInput(f"{what} {path}: no such file")
    # The GGUF holds the shape's architecture and the checkpoint's routed experts: the same blocks, the same
    # bytes each.
    arch, per_block = gguf_experts(args.gguf, args.llama_src)
    if arch != SHAPES[args.shape]["arch"]:
        raise BadInput(
            f"{args.gguf}: llama.cpp architecture {arch!r}, the {args.shape} shape is {SHAPES[args.shape]['arch']!r}"
        )
    layer_bytes = num_experts(config) * expert_bytes(config)
    if sorted(per_block) != blocks or set(per_block.values()) != {layer_bytes}:
        raise BadInput(
            f"{args.gguf}: expert tensors in blocks {sorted(per_block)} of {sorted(set(per_block.values()))} bytes;"
            f" the checkpoint has blocks {blocks} of {layer_bytes} bytes"
        )
    cmd = [
        str(args.llama_bench), "-m", str(args.gguf), "-ngl", "99",
        "-ncmoe", ",".join(str(p.n_cpu_moe) for p in points),
        "-p", str(args.pp), "-n", str(args.tg), "-r", str(args.reps), "-t", str(args.threads), "-o", "jsonl",
        *args.llama_args,
    ]  # fmt: skip
    print("llama-bench:", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - start
    raw = args.results / f"{args.shape}-llama-bench.jsonl"
    args.results.mkdir(parents=True, exist_ok=True)
    raw.write_text(proc.stdout)
    (args.results / f"{args.shape}-llama-bench.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise BadInput(
            f"llama-bench exited with {proc.returncode} (its stderr: {raw.with_suffix('.stderr')})"
        )
    rows = parse_llama_bench(proc.stdout)
    by_n = summarize_llama(rows)
    first = rows[0] if rows else {}
    result = {
        "side": "llama.cpp", "shape": args.shape, "settings": settings_of(args), "checkpoint": sidecar,
        "gguf": str(args.gguf), "arch": arch,
        "gguf_bytes": args.gguf.stat().st_size, "command": cmd, "seconds": seconds,
        "build": {k: first.get(k) for k in ("build_commit", "build_number", "backends", "cpu_info", "gpu_info")},
        "flash_attn": sorted({str(r.get("flash_attn")) for r in rows}),
        "points": [
            {**asdict(p), "llama_gpu_layers": gpu_layers_of(blocks, p.n_cpu_moe), **by_n.get(p.n_cpu_moe, {})}
            for p in points
        ],
    }  # fmt: skip
    build_info = args.llama_bench.parent.parent / "build-info.txt"
    if build_info.is_file():
        result["build"]["info"] = build_info.read_text().splitlines()
    save(args.results / f"{args.shape}-llama.json", result)
    return result


# ---- moecache: the same checkpoint through its loader, at every point ------------------------------


def forced_requests(path: Path, prompt: int, new: int, count: int, expert_size: int):
    """(ForcedRouting, request ids) of the first `count` sequences of an ESFT trace with at least
    prompt + new - 1 tokens, cut to that many: step 0 their first `prompt` tokens, then one token a step."""
    import numpy as np

    from moecache.runtime.forced_routing import ForcedRouting
    from moecache.trace.esft_import import EsftArrays, esft_to_table, load_esft_npz
    from moecache.trace.schema import TraceMeta

    arrays = load_esft_npz(path, **ESFT_SHAPE)
    need = prompt + new - 1
    keep = [
        s for s in range(arrays.num_sequences) if arrays.seq_offsets[s + 1] - arrays.seq_offsets[s] >= need
    ]
    if len(keep) < count:
        raise BadInput(f"--forced-trace {path}: {len(keep)} sequences of >= {need} tokens; {count} needed")
    spans = [slice(int(arrays.seq_offsets[s]), int(arrays.seq_offsets[s]) + need) for s in keep[:count]]
    cut = EsftArrays(
        np.concatenate([arrays.expert_ids[s] for s in spans]),
        np.concatenate([arrays.gate_weights[s] for s in spans]),
        np.arange(0, need * (count + 1), need, dtype=np.int64),
    )
    meta = TraceMeta(**ESFT_SHAPE, expert_bytes=expert_size, model="deepseek_v2_lite", source=str(path))
    table = esft_to_table(cut, name=path.stem, run_id="vs_llamacpp", tokens_per_step=prompt, meta=meta)
    forced = ForcedRouting.from_trace(table, **ESFT_SHAPE, max_tokens=need)
    return forced, list(forced.request_ids)


def time_test(model, requests, new: int, forced=None, compile: bool = False) -> dict:
    """One test at one point: the first request untimed (warm-up: with `compile` the step's compilation
    too), the others timed, the cache kept."""
    from moecache.runtime.decode_loop import FastDecoder

    decoder = FastDecoder(model, max_cache_len=max(int(ids.shape[-1]) for _, ids in requests) + new,
                          forced=forced, compile=compile)  # fmt: skip

    session = getattr(model, "moecache", None)  # None: the unmodified model

    def one(rid, ids):
        if forced is not None:
            forced.start_request(rid)
        if session is not None:
            session.begin_request()
        return decoder.generate(ids, new)

    one(*requests[0])
    before = session.stats() if session is not None else None
    results = [one(*r) for r in requests[1:]]
    pp = [r.prompt_tokens / r.prefill_s for r in results]
    tg = [r.timed_steps / r.decode_s for r in results if r.timed_steps and r.decode_s > 0]
    out = {
        "pp_samples_ts": pp, "tg_samples_ts": tg, "timed_steps": [r.timed_steps for r in results],
        "modes": sorted({r.mode for r in results}), "hit_rate": None, "copies": None, "streamed_experts": None,
    }  # fmt: skip
    if session is not None:
        after = session.stats()
        hits, accesses = after["hits"] - before["hits"], after["accesses"] - before["accesses"]
        out.update(hit_rate=hits / accesses if accesses else None, copies=after["copies"] - before["copies"],
                   streamed_experts=after["streamed_experts"] - before["streamed_experts"])  # fmt: skip
        out["host"] = host_points(results)
    return out


def host_points(results) -> dict:
    """The timed requests' decode host points (DecodeResult.host, summed; LayerCounters.rates) and the CPU
    calls per token."""
    from moecache.runtime.layer_counters import LayerCounters

    host = sum((r.host for r in results), LayerCounters())
    steps = sum(r.timed_steps for r in results)
    return {**host.rates(), "cpu_calls_per_token": host.cpu_calls / steps if steps else None}


def own_requests(args, vocab: int) -> tuple[list, list]:
    """The pp and tg requests of every point: random token ids of the seed, one warm-up request first."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    n = args.reps + 1
    pp_requests = [(f"pp-{i}", torch.randint(0, vocab, (1, args.pp), generator=gen)) for i in range(n)]
    tg_requests = [(f"tg-{i}", torch.randint(0, vocab, (1, 1), generator=gen)) for i in range(n)]
    return pp_requests, tg_requests


def measure_unmodified(cfg, args) -> dict:
    """pp and tg of the unmodified model (every expert on the device, no offloading) on the same loop and
    requests: the bar moecache's all-on-GPU point is held to. The model is freed before returning."""
    import gc

    import torch

    from moecache.models import load_model

    loaded = load_model(cfg.model, cfg.output_root, args.device)
    model = loaded.model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    pp_requests, tg_requests = own_requests(args, vocab)
    t0 = time.perf_counter()
    compile = bool(cfg.runtime.compile)
    result = summarize_moecache(
        time_test(model, pp_requests, 1, compile=compile),
        time_test(model, tg_requests, args.tg + 1, compile=compile),
    )
    print(f"unmodified: pp {result['pp']['median_ts']:.1f} tg {result['tg']['median_ts'] or float('nan'):.1f} "
          f"tok/s ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    del loaded, model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def measure_point(model, point: Point, args, vocab: int, forced_sets, compile: bool = False) -> dict:
    """pp and tg at one point, with the model's own routing and, where given, trace-forced."""
    pp_requests, tg_requests = own_requests(args, vocab)
    pp = time_test(model, pp_requests, 1, compile=compile)
    tg = time_test(model, tg_requests, args.tg + 1, compile=compile)
    out = {"own": summarize_moecache(pp, tg)}
    if forced_sets is not None:
        (pp_forced, pp_ids), (tg_forced, tg_ids) = forced_sets
        pp_requests = [(rid, pp_forced.input_ids(rid, vocab)) for rid in pp_ids]
        tg_requests = [(rid, tg_forced.input_ids(rid, vocab)) for rid in tg_ids]
        out["forced"] = summarize_moecache(
            time_test(model, pp_requests, 1, pp_forced, compile),
            time_test(model, tg_requests, args.tg + 1, tg_forced, compile),
        )
    return out


def summarize_moecache(pp: dict, tg: dict) -> dict:
    return {
        "pp": {"median_ts": statistics.median(pp["pp_samples_ts"]), "samples_ts": pp["pp_samples_ts"],
               "hit_rate": pp["hit_rate"], "copies": pp["copies"], "streamed_experts": pp["streamed_experts"]},
        "tg": {"median_ts": statistics.median(tg["tg_samples_ts"]) if tg["tg_samples_ts"] else None,
               "samples_ts": tg["tg_samples_ts"], "timed_steps": tg["timed_steps"], "modes": tg["modes"],
               "hit_rate": tg["hit_rate"], "copies": tg["copies"], "host": tg.get("host")},
    }  # fmt: skip


def moecache_side(args) -> dict:
    import torch

    from moecache.config import compose
    from moecache.models import load_model
    from moecache.models.loading import OffloadRequest
    from moecache.models.memory_fit import headroom_bytes
    from moecache.models.random_full import CHANGES
    from moecache.offloading import offload_model

    config, sidecar, blocks, points = checkpoint_plan(args.checkpoint)
    yaml_arch = model_cfg(args.shape).get("architecture") or {}
    # The architecture check of the model yaml, less the keys a cut checkpoint changes (as a random model's)
    skipped = sorted({k for f in sidecar.get("cut_fields", []) for k in CHANGES.get(f, ())} & set(yaml_arch))
    overrides = [
        f"model={SHAPES[args.shape]['yaml']}",
        f"model.path={args.checkpoint}",
        f"device={args.device}",
        f"runtime.compile={'true' if args.compile else 'false'}",
    ]
    overrides += [f"model.architecture.{k}=null" for k in skipped]
    cfg = compose(overrides)
    compile = bool(cfg.runtime.compile)
    torch.set_num_threads(args.threads)
    on_cuda = args.device.startswith("cuda")
    unmodified = measure_unmodified(cfg, args) if args.unmodified else None
    request = OffloadRequest(
        points[0].capacity, headroom_bytes(cfg.runtime.headroom), "auto" if on_cuda else "off"
    )
    start = time.perf_counter()
    loaded = load_model(cfg.model, cfg.output_root, args.device, offload=request)
    load_s = time.perf_counter() - start
    print(loaded.times.line(), file=sys.stderr)
    described = loaded.adapter.describe()
    if list(described["model_layer_indices"]) != blocks or described["expert_bytes"] != expert_bytes(config):
        raise BadInput(
            f"moecache loaded MoE blocks {described['model_layer_indices']} of {described['expert_bytes']}-byte "
            f"experts; the plan has {blocks} of {expert_bytes(config)}"
        )
    model = offload_model(loaded.model, capacity=points[0].capacity, policy=args.policy, device=args.device,
                          store=loaded.store, cpu_threads=args.threads, stream_min_tokens=args.stream_min_tokens,
                          **({} if args.stream_chunk is None else {"stream_chunk": args.stream_chunk}))  # fmt: skip
    vocab = int(model.get_output_embeddings().weight.shape[0])
    forced_sets, forced_about = None, None
    if args.forced_trace is not None:
        routing = {k: described[k] for k in ESFT_SHAPE}
        if routing != ESFT_SHAPE:
            print(
                f"forced: skipped, the {args.shape} routing {routing} is not the traces' {ESFT_SHAPE}",
                file=sys.stderr,
            )
        else:
            n = args.reps + 1
            forced_sets = (forced_requests(args.forced_trace, args.pp, 1, n, described["expert_bytes"]),
                           forced_requests(args.forced_trace, 1, args.tg + 1, n, described["expert_bytes"]))  # fmt: skip
            forced_about = {"trace": str(args.forced_trace), "pp_requests": forced_sets[0][1],
                            "tg_requests": forced_sets[1][1]}  # fmt: skip
    rows = []
    for i, point in enumerate(points):
        if i:
            model.moecache.reconfigure(capacity=point.capacity, policy=args.policy)
        if model.moecache.capacity != point.slots:
            raise BadInput(
                f"{point.label}: moecache gave {model.moecache.capacity} slots for {point.capacity}"
            )
        t0 = time.perf_counter()
        measured = measure_point(model, point, args, vocab, forced_sets, compile)
        rows.append({**asdict(point), **measured, "seconds": time.perf_counter() - t0})
        own = measured["own"]
        print(f"{point.label}: pp {own['pp']['median_ts']:.1f} tg {own['tg']['median_ts'] or float('nan'):.1f} tok/s "
              f"({rows[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "side": "moecache", "shape": args.shape, "settings": settings_of(args), "checkpoint": sidecar,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if on_cuda else None, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "load_s": load_s,
        "policy": model.moecache.stats()["policy"], "cpu_threads": args.threads, "forced": forced_about,
        "compile": compile, "stream_option": args.stream_min_tokens,
        "stream_min_tokens": model.moecache.runtime.stream_settings[0],
        "stream_chunk": model.moecache.runtime.stream_settings[1],
        "model": {k: described[k] for k in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_bytes")},
        "points": rows, "unmodified": unmodified,
    }  # fmt: skip
    save(
        args.results / f"{args.shape}-{moecache_results(compile, args.policy, args.stream_min_tokens)}.json",
        result,
    )
    return result


# The policy whose runs the report shows beside the default's: llama.cpp's own placement, whole layers
SPLIT_POLICY = "static_layers"


def moecache_results(compile: bool, policy: str | None = None, stream: int | str = "auto") -> str:
    """The moecache side's results name: the fast loop as generate runs it by default, or compiled; with
    its default policy, or `policy` (`bench.py moecache --policy`); a prompt's misses streamed to the
    device as generate does by default (`--stream-min-tokens auto`), from a given count (-stream) or never
    (0: -nostream)."""
    tag = "" if stream == "auto" else "-stream" if stream else "-nostream"
    return "moecache" + (f"-{policy}" if policy else "") + tag + ("-compiled" if compile else "")


# ---- report -------------------------------------------------------------------------------------------


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def settings_of(args) -> dict:
    """What both sides must share: prompt and decode lengths, repetitions, CPU threads, the ids' seed."""
    return {k: getattr(args, k) for k in ("pp", "tg", "reps", "threads", "seed")}


def build_summary(llama_result: dict | None) -> dict | None:
    """llama-bench's own build fields, the cmake command line and the build time (the options in full are in
    <shape>-llama.json)."""
    if not llama_result:
        return None
    build = dict(llama_result.get("build") or {})
    info = build.pop("info", [])
    build["cmake"] = next((line for line in info if line.startswith("cmake -")), None)
    build["build_time"] = next((line for line in info if line.startswith("configure ")), None)
    return build


# Each moecache column of a report row against llama.cpp's of the same test (`ratios`)
RATIO_COLUMNS = {
    "llama_pp": ("moecache_pp", "forced_pp", "streamed_pp", "streamed_forced_pp", "compiled_pp", "compiled_streamed_pp"),
    "llama_tg": ("moecache_tg", "forced_tg", "compiled_tg", "compiled_forced_tg", f"{SPLIT_POLICY}_tg",
                 f"{SPLIT_POLICY}_compiled_tg"),
}  # fmt: skip


def ratios(row: dict) -> dict:
    """moecache / llama.cpp for each column of RATIO_COLUMNS; None where either side is missing."""
    return {
        col: (row[col] / row[base] if row.get(col) and row.get(base) else None)
        for base, cols in RATIO_COLUMNS.items()
        for col in cols
    }


# Where the host's speed moved by more than this between a shape's runs, the report says so
HOST_DRIFT = 0.10


def host_probes(results: Path, shape: str) -> dict:
    """run.sh's host probes of `shape` (<shape>-<run>-host-<before|after>.json, bench_cpu_experts.py's JSON
    line): {run: {"before": us, "after": us}}, the cold 8-expert call's median; a probe that did not
    run or failed is absent."""
    probes: dict = {}
    for f in sorted(results.glob(f"{shape}-*-host-*.json")):
        run, when = f.stem[len(shape) + 1 :].rsplit("-host-", 1)
        try:
            rows = json.loads(f.read_text()).get("rows") or []
        except (json.JSONDecodeError, AttributeError):
            continue
        if when in ("before", "after") and rows:
            probes.setdefault(run, {})[when] = rows[0]["call_median_us"]
    return probes


def report(results: Path, shapes: list[str]) -> dict:
    """One table over every shape's saved results, and the JSON summary it prints last."""
    header = ("| shape | point | experts on GPU | llama-bench | moecache capacity | llama.cpp pp | moecache pp "
              "| forced pp | streamed pp | streamed forced pp | compiled pp | compiled streamed pp | llama.cpp tg "
              "| moecache tg | forced tg | compiled tg "
              f"| compiled forced tg | {SPLIT_POLICY} tg | {SPLIT_POLICY} compiled tg |")  # fmt: skip
    lines = [header, "|" + " --- |" * 19]
    summary = {"shapes": {}}
    for shape in shapes:
        sides = {}
        for side in ("llama", moecache_results(False), moecache_results(True)):
            f = results / f"{shape}-{side}.json"
            sides[side] = json.loads(f.read_text()) if f.is_file() else None
        compiled = sides.pop(moecache_results(True))
        streamed_runs, streamed = (
            {},
            {},
        )  # the streamed runs, uncompiled and compiled; {compiled: {label: point}}
        for c in (False, True):
            f = results / f"{shape}-{moecache_results(c, stream=1)}.json"
            streamed_runs[c] = json.loads(f.read_text()) if f.is_file() else None
            streamed[c] = {p["label"]: p for p in (streamed_runs[c] or {}).get("points", [])}
        split_by = {}  # the SPLIT_POLICY runs, uncompiled and compiled: {compiled: {label: tg}}
        for c in (False, True):
            f = results / f"{shape}-{moecache_results(c, SPLIT_POLICY)}.json"
            runs = json.loads(f.read_text())["points"] if f.is_file() else []
            split_by[c] = {p["label"]: ((p.get("own") or {}).get("tg") or {}).get("median_ts") for p in runs}
        # the points: the first run saved (any side: a moecache variant may run before llama.cpp's)
        points = next(
            (r["points"] for r in (sides["llama"], sides["moecache"], compiled) if r),
            list(streamed[False].values()) or list(streamed[True].values()),
        )
        if not points:
            raise BadInput(f"{results}: no results of {shape} ({shape}-llama.json, {shape}-moecache*.json)")
        llama_by = {p["label"]: p for p in (sides["llama"] or {}).get("points", [])}
        moe_by = {p["label"]: p for p in (sides["moecache"] or {}).get("points", [])}
        compiled_by = {p["label"]: p for p in (compiled or {}).get("points", [])}
        rows = []
        for p in points:
            lp, mp = llama_by.get(p["label"], {}), moe_by.get(p["label"], {})
            own, forced = mp.get("own", {}), mp.get("forced") or {}
            cp = compiled_by.get(p["label"], {})
            c_own, c_forced = cp.get("own", {}), cp.get("forced") or {}
            sp = streamed[False].get(p["label"], {})
            s_own, s_forced = sp.get("own", {}), sp.get("forced") or {}
            cs_own = streamed[True].get(p["label"], {}).get("own", {})
            row = {
                "point": p["label"], "gpu_fraction": p["gpu_fraction"], "gpu_expert_bytes": p["gpu_expert_bytes"],
                "n_cpu_moe": p["n_cpu_moe"], "capacity": p["capacity"], "slots": p["slots"],
                "llama_pp": (lp.get("pp") or {}).get("median_ts"), "llama_tg": (lp.get("tg") or {}).get("median_ts"),
                "moecache_pp": (own.get("pp") or {}).get("median_ts"),
                "moecache_tg": (own.get("tg") or {}).get("median_ts"),
                "forced_pp": (forced.get("pp") or {}).get("median_ts"),
                "streamed_pp": (s_own.get("pp") or {}).get("median_ts"),
                "streamed_forced_pp": (s_forced.get("pp") or {}).get("median_ts"),
                "compiled_pp": (c_own.get("pp") or {}).get("median_ts"),
                "compiled_streamed_pp": (cs_own.get("pp") or {}).get("median_ts"),
                "forced_tg": (forced.get("tg") or {}).get("median_ts"),
                "compiled_tg": (c_own.get("tg") or {}).get("median_ts"),
                "compiled_forced_tg": (c_forced.get("tg") or {}).get("median_ts"),
                f"{SPLIT_POLICY}_tg": split_by[False].get(p["label"]),
                f"{SPLIT_POLICY}_compiled_tg": split_by[True].get(p["label"]),
                "moecache_tg_hit_rate": (own.get("tg") or {}).get("hit_rate"),
                "forced_tg_hit_rate": (forced.get("tg") or {}).get("hit_rate"),
            }  # fmt: skip
            row["vs_llama"] = ratios(row)
            rows.append(row)
            gib = p["gpu_expert_bytes"] / 2**30
            lines.append(
                f"| {shape} | {p['label']} | {100 * p['gpu_fraction']:.1f}% ({gib:.2f} GiB) | -ngl 99 -ncmoe "
                f"{p['n_cpu_moe']} | {p['capacity']} ({p['slots']} slots) | {fmt(row['llama_pp'])} | "
                f"{fmt(row['moecache_pp'])} | {fmt(row['forced_pp'])} | {fmt(row['streamed_pp'])} | "
                f"{fmt(row['streamed_forced_pp'])} | {fmt(row['compiled_pp'])} | "
                f"{fmt(row['compiled_streamed_pp'])} | {fmt(row['llama_tg'])} | "
                f"{fmt(row['moecache_tg'])} | {fmt(row['forced_tg'])} | {fmt(row['compiled_tg'])} | "
                f"{fmt(row['compiled_forced_tg'])} | {fmt(row[f'{SPLIT_POLICY}_tg'])} | "
                f"{fmt(row[f'{SPLIT_POLICY}_compiled_tg'])} |"
            )
        meta = sides["moecache"] or {}
        # what every moecache run shares (checkpoint, device, policy, load): from the first one saved
        about = meta or compiled or streamed_runs[False] or streamed_runs[True] or {}
        unmodified = meta.get("unmodified")
        c_unmodified = (compiled or {}).get("unmodified")
        if unmodified or c_unmodified:
            upp = unmodified["pp"]["median_ts"] if unmodified else None
            utg = unmodified["tg"]["median_ts"] if unmodified else None
            cpp = c_unmodified["pp"]["median_ts"] if c_unmodified else None
            ctg = c_unmodified["tg"]["median_ts"] if c_unmodified else None
            lines.append(f"| {shape} | unmodified model (moecache's loop, no offloading) | 100% | - | - | - | "
                         f"{fmt(upp)} | - | - | - | {fmt(cpp)} | - | - | {fmt(utg)} | - | {fmt(ctg)} | - | - | - |")  # fmt: skip
        settings = {side: r.get("settings") for side, r in sides.items() if r}
        if len({json.dumps(v, sort_keys=True) for v in settings.values()}) > 1:
            print(f"{shape}: the two sides ran with different settings: {settings}", file=sys.stderr)
        probes = host_probes(results, shape)
        calls = [us for p in probes.values() for us in p.values()]
        drift = max(calls) / min(calls) - 1 if calls else None
        summary["shapes"][shape] = {
            "host_probes_us": probes, "host_drift": drift,
            "settings": settings,
            "checkpoint": (sides["llama"] or about).get("checkpoint"),
            "llama_cpp": build_summary(sides["llama"]), "flash_attn": (sides["llama"] or {}).get("flash_attn"),
            "moecache": {k: about.get(k) for k in ("device", "gpu", "policy", "cpu_threads", "load_s", "forced")},
            "points": rows,
            "unmodified": {"pp": unmodified["pp"]["median_ts"], "tg": unmodified["tg"]["median_ts"]}
            if unmodified else None,
            "compiled_unmodified_tg": c_unmodified["tg"]["median_ts"] if c_unmodified else None,
            "compiled": {k: (compiled or {}).get(k) for k in ("device", "gpu", "policy", "load_s")} if compiled else None,
        }  # fmt: skip
    print("\n".join(lines))
    for shape, entry in summary["shapes"].items():
        probes, drift = entry["host_probes_us"], entry["host_drift"]
        if not probes:
            continue
        print(f"\n{shape}: the host's CPU executor, a cold 8-expert call (us) before / after each run:")
        for run, p in probes.items():
            print(f"  {run}: {fmt(p.get('before'))} / {fmt(p.get('after'))}")
        if drift > HOST_DRIFT:
            print(
                f"  the host's speed moved by {100 * drift:.0f}% across these runs: compare only runs close in time"
            )
    cols = [c for cs in RATIO_COLUMNS.values() for c in cs]
    print("\nmoecache / llama.cpp, each column against llama.cpp's pp or tg at the same point:\n")
    print("| shape | point | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 2))
    for shape, entry in summary["shapes"].items():
        for row in entry["points"]:
            cells = ["-" if row["vs_llama"][c] is None else f"{row['vs_llama'][c]:.3f}x" for c in cols]
            print(f"| {shape} | {row['point']} | " + " | ".join(cells) + " |")
    print(
        "pp / tg: tokens/s, medians; 'forced': moecache with the routing of real DeepSeek-V2-Lite traces "
        "(that routing shape only); 'compiled': moecache with runtime.compile=true (`bench.py moecache --compile`); "
        f"'{SPLIT_POLICY}': moecache with llama.cpp's placement, whole layers (`bench.py moecache --policy "
        f"{SPLIT_POLICY}`); 'streamed': a prompt's misses used by at least N of a visit's entries copied to "
        "the device and run there (`bench.py moecache --stream-min-tokens N`; generate's default, auto, is "
        "32 on CUDA: the plain moecache columns of a CUDA run)."
    )
    print(json.dumps(summary))
    return summary


# ---- the command line ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p, checkpoint=True):
        p.add_argument("--shape", required=True, choices=sorted(SHAPES))
        if checkpoint:
            p.add_argument("--checkpoint", type=Path, required=True)
            p.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1))
            p.add_argument("--pp", type=int, default=512)
            p.add_argument("--tg", type=int, default=128)
            p.add_argument("--reps", type=int, default=3)
            p.add_argument("--results", type=Path, default=Path("/tmp/vs_llamacpp/results"))
            p.add_argument("--seed", type=int, default=0)

    w = sub.add_parser("write", help="the seeded random checkpoint")
    common(w, checkpoint=False)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--layers", type=int, default=None)
    w.add_argument("--size", choices=["full", "tiny"], default="full")
    w.add_argument("--device", default="cuda")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shard", default="4GB")
    lb = sub.add_parser("llama", help="llama-bench at every point")
    common(lb)
    lb.add_argument("--gguf", type=Path, required=True)
    lb.add_argument("--llama-bench", type=Path, required=True)
    lb.add_argument("--llama-src", type=Path, default=REPO / ".vendor/llama.cpp")
    lb.add_argument("--timeout", type=float, default=None, help="seconds before llama-bench is stopped")
    lb.add_argument(
        "--llama-args", nargs=argparse.REMAINDER, default=[],
        help="more llama-bench arguments, last (e.g. -lm none: weights read into memory instead of mapped)",
    )  # fmt: skip
    mc = sub.add_parser("moecache", help="moecache at every point")
    common(mc)
    mc.add_argument("--device", default="cuda")
    mc.add_argument("--forced-trace", type=Path, default=None, help="an ESFT .npz (DeepSeek-V2-Lite shape)")
    mc.add_argument(
        "--unmodified", action=argparse.BooleanOptionalAction, default=True,
        help="first the unmodified model (every expert on the device) on the same loop and requests",
    )  # fmt: skip
    mc.add_argument(
        "--policy", default=None,
        help="a placement policy instead of generate's default (e.g. static_layers: llama.cpp's whole layers); "
        "results saved apart (<shape>-moecache-<policy>[-compiled].json)",
    )  # fmt: skip
    mc.add_argument(
        "--compile", action="store_true",
        help="runtime.compile=true (generate's option): the decode step through torch.compile; results "
        "saved apart (<shape>-moecache-compiled.json) and reported in columns of their own",
    )  # fmt: skip
    mc.add_argument(
        "--stream-min-tokens", default="auto",
        help="runtime.stream_min_tokens (generate's option, default auto: 32 on CUDA, 0 on the CPU stand-in): a "
        "prompt visit's missed expert used by at least N entries runs on the device; a number's results saved "
        "apart (<shape>-moecache-stream.json; 0: <shape>-moecache-nostream.json)",
    )  # fmt: skip
    mc.add_argument(
        "--stream-chunk",
        type=int,
        default=None,
        help="runtime.stream_chunk: staging slots per pool (its default)",
    )
    rp = sub.add_parser("report", help="the table and one JSON line from saved results")
    rp.add_argument("--results", type=Path, default=Path("/tmp/vs_llamacpp/results"))
    rp.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    args = ap.parse_args(argv)
    try:
        for key in ("threads", "pp", "tg", "reps"):
            value = getattr(args, key, 1)
            if value < 1:
                raise BadInput(f"--{key} {value}: expected an integer >= 1")
        if args.command == "moecache":
            stream = args.stream_min_tokens
            if stream != "auto" and not stream.isdigit():
                raise BadInput(f"--stream-min-tokens {stream}: expected auto or an integer >= 0")
            args.stream_min_tokens = stream if stream == "auto" else int(stream)
            if args.stream_chunk is not None and args.stream_chunk < 1:
                raise BadInput(f"--stream-chunk {args.stream_chunk}: expected an integer >= 1")
        if getattr(args, "tg", 2) < 2 and args.command == "moecache":
            raise BadInput(f"--tg {args.tg}: the decode test times at least 2 steps")
        run(args)
    except BadInput as exc:
        print(f"vs_llamacpp: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # moecache's own one-line errors (MoecacheError) likewise
        if type(exc).__name__ != "MoecacheError":
            raise
        print(f"vs_llamacpp: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args) -> None:
    """One subcommand; `llama` and `moecache` end with the table of what is saved for the shape so far."""
    if args.command == "write":
        write(args)
    elif args.command == "report":
        report(args.results, args.shapes)
    else:
        if args.command == "llama":
            llama(args)
        else:
            if args.forced_trace is not None and not args.forced_trace.is_file():
                raise BadInput(f"--forced-trace {args.forced_trace}: no such file")
            moecache_side(args)
        report(args.results, [args.shape])


if __name__ == "__main__":
    sys.exit(main())
