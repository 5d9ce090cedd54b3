"""Does a decode visit's miss set finish sooner split between the CPU and the host link?

A decode step's missed experts of one layer visit run on the CPU today: the executor streams each one's
weights out of host memory (`CpuExperts`). The host link is a second reader of the same memory: an
expert copied into a device slot by DMA and run there does not pass through the CPU's cores. If the two
readers do not slow each other down, a visit of N misses that sends k of them over the link (and N-k to
the CPU) ends at max(CPU time of N-k, copy time of k) instead of the CPU time of N; if they share one
memory bandwidth, it does not. This measures which, on the machine it runs on, for the expert shapes of
Qwen3.6-35B-A3B (H 2048, I 512) and DeepSeek-V2-Lite (H 2048, I 1408), bf16, one token:

for each split k = 0..N: the executor alone on N-k experts, the k copies alone (from the pinned store to
device slots, on a stream of their own, `CudaDevice.copy`: the transfer engine's driver copies), then
both at once (the copies enqueued first, then the executor called): the CPU call's time, the copies'
time on their stream (between two timing events) and the wall time until both are done. Every call reads experts it has not read
for a while (a pool of more than twice the last-level cache, rotated), as a decode's misses are. The
kernel that would run the k copied experts on the device (microseconds at one token) is not timed.

    python benchmarks/bench_split_misses.py [--shapes qwen3.6,dsv2-lite --misses 6 --threads 15
        --repeats 30 --warmup 3 --max-pool-mib 4096]

Prints a table per shape and ends with one JSON line. Needs CUDA (exit 2 without it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moecache.calibration import ExpertShape, available_memory_bytes, last_level_cache_bytes, pool_experts
from moecache.models.expert_store import ExpertStore
from moecache.runtime.cpu_experts import CpuExperts
from moecache.runtime.device import make_device

SHAPES = {"qwen3.6": ExpertShape(2048, 512), "dsv2-lite": ExpertShape(2048, 1408)}
MiB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3.6,dsv2-lite")
    p.add_argument("--misses", type=int, default=6, help="N: a visit's missed experts")
    p.add_argument("--threads", type=int, default=15)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-pool-mib", type=int, default=4096)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    for name in args.shapes:
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
    for key in ("misses", "threads", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key}: must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    return args


def make_store(shape: ExpertShape, experts: int, seed: int = 0) -> ExpertStore:
    """A pinned one-layer store of `experts` rows, each a copy of one random expert (distinct memory is
    what the timing needs; `moecache.calibration.make_pool`'s reasoning)."""
    gen = torch.Generator().manual_seed(seed)
    h, i = shape.hidden_size, shape.moe_intermediate_size
    store = ExpertStore.allocate(1, experts, h, i, torch.bfloat16)
    store.w13_GIH.copy_(
        (torch.randn(2 * i, h, generator=gen) * h**-0.5).to(torch.bfloat16).expand_as(store.w13_GIH)
    )
    store.w2_GHI.copy_(
        (torch.randn(h, i, generator=gen) * i**-0.5).to(torch.bfloat16).expand_as(store.w2_GHI)
    )
    store.pin("strict")
    return store


class Split:
    """One shape's executor, store, device slots and copy stream; `run(k, mode)` times one visit."""

    def __init__(self, shape: ExpertShape, misses: int, threads: int, pool: int):
        self.misses, self.pool = misses, pool
        self.store = make_store(shape, pool)
        self.device = make_device("cuda")
        self.stream = self.device.new_stream()
        self.began, self.done = self.device.new_event(timing=True), self.device.new_event(timing=True)
        self.slots_NB = torch.empty((misses, self.store.expert_bytes), dtype=torch.uint8, device="cuda")
        self.executor = CpuExperts(self.store.w13_GIH, self.store.w2_GHI, threads=threads, backend="cpp")
        self.x_1H = torch.randn(1, shape.hidden_size).to(torch.bfloat16)
        self.out_1H = torch.empty(1, shape.hidden_size, dtype=torch.float32)
        self.next_key = 0

    def keys(self, n: int) -> list[int]:
        first, self.next_key = self.next_key, (self.next_key + n) % self.pool
        return [(first + j) % self.pool for j in range(n)]

    def run(self, k: int, mode: str) -> tuple[float, float, float]:
        """(CPU call us, copies us, wall us) of one visit: `mode` "cpu" (the N-k CPU experts alone),
        "copy" (the k copies alone) or "both"; a part not run is 0."""
        cpu_keys = self.keys(self.misses - k) if mode != "copy" else []
        copy_keys = self.keys(k) if mode != "cpu" else []
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        self.began.record(self.stream)
        for slot, key in enumerate(copy_keys):
            self.device.copy(self.slots_NB[slot], self.store.flat_GB[key], self.stream)
        self.done.record(self.stream)
        t_cpu = t0
        if cpu_keys:
            n = len(cpu_keys)
            self.executor.run(
                self.x_1H, torch.tensor(cpu_keys), torch.zeros(n, dtype=torch.long),
                torch.full((n,), 1.0 / n), self.out_1H,
            )  # fmt: skip
            t_cpu = time.perf_counter_ns()
        self.done.synchronize()
        t_end = time.perf_counter_ns()
        # The copies' own time on the copy stream (its events), whatever the host was doing meanwhile.
        copy_us = self.done.elapsed_ns(self.began) / 1e3 if copy_keys else 0.0
        return (t_cpu - t0) / 1e3, copy_us, (t_end - t0) / 1e3

    def median(self, k: int, mode: str, repeats: int, warmup: int) -> tuple[float, float, float]:
        samples = [self.run(k, mode) for _ in range(warmup + repeats)][warmup:]
        return tuple(statistics.median(s[i] for s in samples) for i in range(3))

    def close(self) -> None:
        self.executor.close()
        self.store.close()


def bench_shape(args, name: str) -> list[dict]:
    shape = SHAPES[name]
    expert_bytes = 3 * shape.hidden_size * shape.moe_intermediate_size * 2
    max_pool = args.max_pool_mib * MiB
    free = available_memory_bytes()
    if free is not None:
        max_pool = min(max_pool, free // 2)
    cache = last_level_cache_bytes()  # None where sysfs does not say: the largest pool allowed
    pool = max_pool // expert_bytes if cache is None else pool_experts(expert_bytes, cache, max_pool)
    pool = max(pool, 4 * args.misses)
    split = Split(shape, args.misses, args.threads, pool)
    rows = []
    try:
        for k in range(args.misses + 1):
            cpu_alone = split.median(k, "cpu", args.repeats, args.warmup)[0] if k < args.misses else 0.0
            copy_alone = split.median(k, "copy", args.repeats, args.warmup)[1] if k else 0.0
            cpu_both, copy_both, wall = split.median(k, "both", args.repeats, args.warmup)
            rows.append({
                "shape": name, "misses": args.misses, "streamed": k, "cpu_alone_us": round(cpu_alone, 1),
                "copy_alone_us": round(copy_alone, 1), "cpu_both_us": round(cpu_both, 1),
                "copy_both_us": round(copy_both, 1), "wall_us": round(wall, 1),
                "wall_if_independent_us": round(max(cpu_alone, copy_alone), 1),
            })  # fmt: skip
    finally:
        split.close()
    print(f"\n{name}: {args.misses} misses a visit, 1 token, expert {expert_bytes / MiB:.2f} MiB, "
          f"pool {pool} experts ({pool * expert_bytes / MiB:.0f} MiB), {args.threads} CPU threads; us, "
          f"medians of {args.repeats}")  # fmt: skip
    print("| streamed | CPU alone | copies alone | CPU, both | copies, both | wall, both | max of alones |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['streamed']} | {r['cpu_alone_us']} | {r['copy_alone_us']} | {r['cpu_both_us']} | "
              f"{r['copy_both_us']} | {r['wall_us']} | {r['wall_if_independent_us']} |")  # fmt: skip
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_split_misses: needs CUDA (the host link is what it measures)", file=sys.stderr)
        raise SystemExit(2)
    results = {}
    for name in args.shapes:
        rows = bench_shape(args, name)
        best = min(rows, key=lambda r: r["wall_us"])
        results[name] = {
            "rows": rows, "best_streamed": best["streamed"],
            "cpu_only_us": rows[0]["wall_us"], "best_wall_us": best["wall_us"],
            "speedup": round(rows[0]["wall_us"] / best["wall_us"], 3),
        }  # fmt: skip
        print(f"best split: {best['streamed']} of {args.misses} streamed, {best['wall_us']} us against "
              f"{rows[0]['wall_us']} us all on the CPU ({results[name]['speedup']}x)")  # fmt: skip
    meta = {"device": torch.cuda.get_device_name(), "threads": args.threads, "repeats": args.repeats}
    print(json.dumps({"benchmark": "split_misses", **meta, "shapes": results}))


if __name__ == "__main__":
    main()
