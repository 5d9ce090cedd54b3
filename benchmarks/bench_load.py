"""Loading a model that does not fit, as a user runs it: `moecache generate` from a cold process.

    python benchmarks/bench_load.py --write /ckpt/dsv2 --model deepseek_v2_lite   # once: the checkpoint
    python benchmarks/bench_load.py --checkpoint /ckpt/dsv2 --model deepseek_v2_lite --capacity 25%
    python benchmarks/bench_load.py --random --model qwen3_6_35b_a3b --capacity 25%

`--write DIR` builds the model of conf/model/<model>.yaml with seeded random weights on the device
(moecache/models/random_full.py) and writes it with `save_pretrained` (the Hugging Face layout a real
checkpoint has, shards of `--shard`) plus the byte tokenizer, in a process of its own.

`--checkpoint DIR` then measures, each in a fresh process: the disk's sequential read rate (the largest
shard read with 16 MiB `readinto`s after the page cache is dropped, where the machine allows), and
`moecache generate model=<model> model.path=DIR device=<device> capacity=<capacity>` cold (page cache
dropped first) and warm (the same command again). `--random` measures `moecache generate` of the random
model (`model.path=null model.random.seed=0`). For each run: the wall time from the command's start to
its first token (as the stage reports it, from the process's start), the load's time and GB/s per
phase as the stage reports them, prefill and decode tokens/s, the process's peak RSS (VmHWM, as the stage
reports it) against the expert store's bytes, and the checks the issue sets (peak RSS <= store + 2 GiB; a
cold load within 1.2x of the checkpoint's bytes at the disk's rate; a warm load >= 2 GB/s; the random
Qwen3.6 shape's first token within 60 s). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = (
    "The expert cache keeps the experts that the next token will use on the GPU and the rest in host memory"
)
NAN = float("nan")  # a figure the run did not report (printed as nan, never as 0)


def drop_page_cache() -> bool:
    """Drop the kernel's page cache (needs root and a kernel that allows it); whether it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_read_rate(folder: Path) -> dict:
    """GB/s of one sequential read of the largest shard, the page cache dropped first."""
    shard = max(folder.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    dropped = drop_page_cache()
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    start, total = time.perf_counter(), 0
    with open(shard, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    seconds = time.perf_counter() - start
    return {
        "file": shard.name,
        "bytes": total,
        "seconds": seconds,
        "gb_s": total / 1e9 / seconds,
        "cache_dropped": dropped,
    }


def write_checkpoint(model: str, folder: Path, device: str, shard: str, layers: int | None) -> None:
    code = f"""
import torch
from omegaconf import OmegaConf
from moecache.models.random_full import build_random_model
from moecache.models.tokenizer import build_byte_tokenizer
cfg = OmegaConf.to_container(OmegaConf.load({str(REPO / "conf/model" / f"{model}.yaml")!r}), resolve=True)
cfg["path"] = None
cfg["random"]["seed"] = 0
cfg["random"]["num_layers"] = {layers!r}
model, _ = build_random_model(cfg, {device!r}, torch.bfloat16)
model.save_pretrained({str(folder)!r}, max_shard_size={shard!r})
build_byte_tokenizer().save_pretrained({str(folder)!r})
"""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"wrote {folder}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s", flush=True)


def run_generate(overrides: list[str], env: dict | None = None) -> dict:
    """One `moecache generate` in a fresh process (`env`: more environment variables): its reported
    times, wall time and peak RSS."""
    cmd = [sys.executable, "-m", "moecache.cli", "generate", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    err = proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"generate failed ({proc.returncode}): {err[-3000:]}")
    m = re.search(r"^peak host RSS: ([\d.]+) GiB", err, re.M)
    peak = float(m.group(1)) * 2**30 if m else float("nan")
    row = {"wall_s": wall, "peak_rss": peak, "stderr_tail": err.splitlines()[-40:]}
    for pattern, key in [
        (r"^load: ([\d.]+) s", "load_s"),
        (r"read ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)", "read"),
        (r"generate ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)", "generate"),
        (r"pin ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)", "pin"),
        (r"time to first token: ([\d.]+) s after the process started", "ttft_process_s"),
        (r"prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s", "prefill"),
        (r"decode: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s", "decode"),
        (r"expert store ([\d.]+) GiB", "store_gib"),
    ]:
        m = re.search(pattern, err, re.M)
        if m:
            row[key] = [float(g) for g in m.groups()] if len(m.groups()) > 1 else float(m.group(1))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek_v2_lite")
    ap.add_argument("--write", type=Path, help="write the random checkpoint here and stop")
    ap.add_argument("--shard", default="4GB")
    ap.add_argument(
        "--layers", type=int, default=None, help="with --write: decoder layers kept (default all)"
    )
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--capacity", default="25%")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for generate")
    ap.add_argument(
        "--read-threads", default="",
        help="with --checkpoint: also a cold load (2 new tokens) at each of these reading-thread counts, "
        "e.g. 1,2,4,8 ($MOECACHE_READ_THREADS)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.write:
        write_checkpoint(args.model, args.write, args.device, args.shard, args.layers)
        return
    common = [f"model={args.model}", f"device={args.device}", f"capacity={args.capacity}", f"prompt='{PROMPT}'",
              f"generation.max_new_tokens={args.new_tokens}", "generation.ignore_eos=true", *args.extra]  # fmt: skip
    result: dict = {"model": args.model, "capacity": args.capacity}
    runs = {}
    if args.checkpoint:
        files = sorted(args.checkpoint.glob("*.safetensors"))
        result["checkpoint_bytes"] = sum(f.stat().st_size for f in files)
        result["disk"] = disk_read_rate(args.checkpoint)
        result["cold_cache_dropped"] = drop_page_cache()
        runs["cold"] = run_generate([*common, f"model.path={args.checkpoint}"])
        runs["warm"] = run_generate([*common, f"model.path={args.checkpoint}"])
        sweep = {}
        for n in [int(v) for v in args.read_threads.split(",") if v]:
            drop_page_cache()
            row = run_generate([*common, f"model.path={args.checkpoint}", "generation.max_new_tokens=2"],
                               env={"MOECACHE_READ_THREADS": str(n)})  # fmt: skip
            sweep[n] = {k: row.get(k) for k in ("load_s", "read", "peak_rss")}
        if sweep:
            result["read_threads"] = sweep
    if args.random:
        runs["random"] = run_generate([*common, "model.path=null", "model.random.seed=0"])
    result["runs"] = runs

    print(f"{'run':8} {'wall s':>8} {'ttft s':>8} {'load s':>8} {'read GB/s':>10} {'pin s':>7} "
          f"{'pp tok/s':>9} {'tg tok/s':>9} {'peak RSS GiB':>13} {'store GiB':>10}")  # fmt: skip
    checks = {}
    for name, r in runs.items():
        read = r.get("read") or r.get("generate") or [NAN] * 3
        store = r.get("store_gib", NAN)
        print(f"{name:8} {r['wall_s']:8.1f} {r.get('ttft_process_s', NAN):8.1f} {r.get('load_s', NAN):8.1f} "
              f"{read[2]:10.2f} {(r.get('pin') or [NAN] * 2)[1]:7.1f} {(r.get('prefill') or [NAN] * 2)[1]:9.1f} "
              f"{(r.get('decode') or [NAN] * 2)[1]:9.1f} {r['peak_rss'] / 2**30:13.2f} {store:10.2f}")  # fmt: skip
        checks[f"{name}_peak_rss_within_store_plus_2GiB"] = r["peak_rss"] <= (store + 2) * 2**30
    if "cold" in runs:
        disk = result["disk"]["gb_s"]
        bound = 1.2 * result["checkpoint_bytes"] / 1e9 / disk
        result["cold_load_bound_s"] = bound
        checks["cold_load_within_1.2x_disk"] = runs["cold"].get("load_s", 1e9) <= bound
        warm_rate = result["checkpoint_bytes"] / 1e9 / runs["warm"].get("load_s", 1e9)
        result["warm_end_to_end_gb_s"] = warm_rate
        checks["warm_load_at_least_2_GB_s"] = warm_rate >= 2.0
        print(f"disk {disk:.2f} GB/s ({result['disk']['file']}, page cache dropped: {result['disk']['cache_dropped']});"
              f" cold bound {bound:.1f} s; warm end to end {warm_rate:.2f} GB/s")  # fmt: skip
    for n, row in result.get("read_threads", {}).items():
        read = row.get("read") or [NAN] * 3
        print(f"cold, {n} reading threads: load {row.get('load_s', NAN):.1f} s, read {read[2]:.2f} GB/s "
              f"({read[2] / result['disk']['gb_s']:.2f} of the disk's rate)")  # fmt: skip
    if "random" in runs:
        checks["random_first_token_within_60_s"] = runs["random"].get("ttft_process_s", 1e9) <= 60
    result["checks"] = checks
    for r in runs.values():
        r.pop("stderr_tail")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
