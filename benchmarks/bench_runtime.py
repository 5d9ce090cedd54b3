"""The runtime core's own costs: copy bandwidth of the transfer engine, copies overlapping compute, the
cache manager's time per layer visit, and pinning a store of N experts.

Sections (each skipped, with the reason printed, where the device cannot run it):
- copy: one expert (Qwen3.6: H 2048, I 512, bf16 = 6 MiB) and a burst of 8 through the transfer engine
  (device time between the copy's start and ready events; burst: first start to last ready) against
  raw `copy_(non_blocking=True)`s of pinned 6 MiB buffers on a side stream (one, and eight in a row).
  CUDA only.
- overlap: two compute kernels (bf16 matmuls; a 1 GiB device copy, HBM-bound) timed alone and while the
  engine copies `--overlap-copies` experts on its stream (enqueued after the compute). CUDA only.
- manager (`--device null`: a device whose operations do nothing, for the manager's host work alone):
  `CacheManager.visit` per layer visit at the Qwen3.6 shape (40 x 256 experts, top-8,
  capacity 2048, policy --policy) on synthetic skewed routing, warmed first; with routing already on
  the host, and (CUDA) with the routing read back from the device (the hot path's one read-back): by
  `visit` itself (a copy and a stream synchronize), and as the fast decode loop does it (the read-back
  copy and an event after it, `prepare`, a wait on the event, `visit` on the host copy, `commit`).
  The store's experts are small here (--manager-h/--manager-i): only the manager's time is measured.
  `--sweep-mib N`: before each visit of the host-routing fast-loop pass, N MiB are read through the
  caches (untimed), as the CPU path's expert weights go through them between two visits of a decode.
  `--on-miss split --cost-profile P`: the manager splits its misses weighing profile P; the table adds
  the host time per decision (visits with a copy in flight for a miss) and per waiting visit.
- cpu_call: one layer's CPU half at T = 1 with every entry missing, on tiny experts: the eager call's
  form (`ExpertsRuntime.cpu_half`) against the host point's (`cpu_half_bound`, bound to fixed buffers),
  warm and with --sweep-mib MiB read through the caches before each call. Not in the default sections.
- store: allocate and fill a store of --store-experts Qwen3.6-sized experts (40*256 = 10240 is the full
  60 GiB model; the H200 host has 128 GiB), then one cudaHostRegister; its time and the peak RSS.

    python benchmarks/bench_runtime.py [--device auto|cuda|standin] [--store-experts 10240] [--reps 50]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np
import torch

from moecache.errors import MoecacheError
from moecache.models.expert_store import ExpertStore
from moecache.offloading import runtime_cost
from moecache.runtime.device import Device, make_device
from moecache.runtime.manager import CacheManager
from moecache.runtime.slot_pool import SlotPool
from moecache.runtime.transfer import TransferEngine
from moecache.sim.policy import make_policy

H, INTER, DTYPE = 2048, 512, torch.bfloat16  # Qwen3.6-35B-A3B routed expert
EXPERT_BYTES = 3 * H * INTER * 2


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def filled_store(num_layers: int, num_experts: int, hidden: int, inter: int) -> ExpertStore:
    store = ExpertStore.allocate(num_layers, num_experts, hidden, inter, DTYPE)
    for layer in range(num_layers):  # layer by layer: no temporary beyond one layer's rows
        rows = slice(layer * num_experts, (layer + 1) * num_experts)
        store.w13_GIH[rows].normal_()
        store.w2_GHI[rows].normal_()
    return store


# ---- the host point's CPU-path call ---------------------------------------------------------------


def bench_cpu_call(device, args) -> dict:
    """Host time of one layer's CPU half at T = 1, every one of K entries missing, through the eager
    call's `ExpertsRuntime.cpu_half` (gather into new tensors, checked `run`) and the host point's
    `cpu_half_bound` (gathered into a call bound to fixed buffers), on experts so small (--manager-h /
    --manager-i) that the kernel's own time is a few us: what is left is the Python between the
    routing's arrival and the kernel. Warm, and with --sweep-mib MiB read through the caches before
    each call, as the CPU path's real weights are between two layers' calls."""
    from moecache.runtime.cpu_experts import CpuExperts
    from moecache.runtime.experts_module import ExpertsRuntime

    L, E, K = args.layers, args.experts, args.top_k
    store = filled_store(L, E, args.manager_h, args.manager_i)
    manager = CacheManager(store, device, 0, make_policy("lru"), top_k=K)
    runtime = ExpertsRuntime(manager, CpuExperts(store.w13_GIH, store.w2_GHI, threads=1))
    rng = np.random.default_rng(0)
    ids_NTK = np.stack([rng.choice(E, (1, K), replace=False) for _ in range(args.tokens)]).astype(np.int64)
    w_TK = np.full((1, K), 1.0 / K, np.float32)
    hit_TK = np.zeros((1, K), np.bool_)
    x_TH = torch.randn(1, args.manager_h).to(DTYPE)
    out_TH = torch.empty(1, args.manager_h)
    call = runtime.cpu.bind(x_TH, out_TH, K)
    sweep = np.ones(args.sweep_mib << 17) if args.sweep_mib else None
    forms = {
        "eager": lambda n: runtime.cpu_half(
            n % L, x_TH, ids_NTK[n], torch.from_numpy(w_TK), hit_TK, out_TH, place=lambda y: y
        ),
        "bound": lambda n: runtime.cpu_half_bound(n % L, call, ids_NTK[n], w_TK, hit_TK, round_product=False),
    }
    out = {"sweep_mib": args.sweep_mib}
    for name, run in forms.items():
        for swept in (False, True) if sweep is not None else (False,):
            samples = []
            for n in range(args.tokens):
                if swept:
                    sweep.sum()
                t0 = time.perf_counter_ns()
                run(n)
                samples.append(time.perf_counter_ns() - t0)
            out[f"{name}{'_swept' if swept else ''}_median_us"] = (
                float(np.median(samples[args.warm_tokens :])) / 1e3
            )
    return out


# ---- copy bandwidth ----------------------------------------------------------------------------


def bench_copy(device, reps: int) -> dict:
    store = filled_store(1, 64, H, INTER)
    store.pin("strict")
    pool = SlotPool.for_store(device, 8, store)
    engine = TransferEngine(device, store, pool)
    raw_src = torch.empty((8, EXPERT_BYTES), dtype=torch.uint8, pin_memory=True)
    raw_dst = torch.empty((8, EXPERT_BYTES), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    one_us, burst_us, raw_us, raw_burst_us = [], [], [], []
    for rep in range(reps + 3):
        torch.cuda.synchronize()
        copy = engine.enqueue(rep % 64, 0)
        torch.cuda.synchronize()
        copy.observe()
        torch.cuda.synchronize()
        copies = [engine.enqueue((rep * 8 + j) % 64, j) for j in range(8)]
        torch.cuda.synchronize()
        for c in copies:
            c.observe()
        burst = copies[-1].ready_event.elapsed_ns(copies[0].start_event) / 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        burst_start, burst_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            raw_dst[0].copy_(raw_src[0], non_blocking=True)
            end.record()
            burst_start.record()
            for j in range(8):  # eight separate 6 MiB copies, as the engine issues them
                raw_dst[j].copy_(raw_src[j], non_blocking=True)
            burst_end.record()
        torch.cuda.synchronize()
        if rep >= 3:  # warm-up
            one_us.append(copy.duration_ns / 1e3)
            burst_us.append(burst)
            raw_us.append(start.elapsed_time(end) * 1e3)
            raw_burst_us.append(burst_start.elapsed_time(burst_end) * 1e3)
    one, burst, raw, raw_burst = (float(np.median(x)) for x in (one_us, burst_us, raw_us, raw_burst_us))
    gbps = lambda nbytes, us: nbytes / us / 1e3  # noqa: E731
    return {
        "expert_bytes": EXPERT_BYTES,
        "engine_one_us": one,
        "engine_one_GBps": gbps(EXPERT_BYTES, one),
        "engine_burst8_us": burst,
        "engine_burst8_GBps": gbps(8 * EXPERT_BYTES, burst),
        "raw_one_us": raw,
        "raw_one_GBps": gbps(EXPERT_BYTES, raw),
        "raw_burst8_us": raw_burst,
        "raw_burst8_GBps": gbps(8 * EXPERT_BYTES, raw_burst),
        "engine_one_over_raw": raw / one,
        "engine_burst8_over_raw": raw_burst / burst,
    }


# ---- overlap -----------------------------------------------------------------------------------


def bench_overlap(device, reps: int, copies: int) -> dict:
    """Two compute kernels, each timed alone and while `copies` experts copy: bf16 matmuls (compute-bound)
    and a device-to-device copy of 1 GiB (HBM-bound, as decode's expert GEMVs are). The compute is
    enqueued FIRST and the copies after it, so the host's time enqueuing copies never delays the compute
    stream (an earlier version enqueued the copies first and timed the host's enqueue gap as slowdown)."""
    store = filled_store(1, max(copies, 8), H, INTER)
    store.pin("strict")
    pool = SlotPool.for_store(device, copies, store)
    engine = TransferEngine(device, store, pool)
    a = torch.randn(4096, 4096, device="cuda", dtype=DTYPE)
    src = torch.empty(2**29, device="cuda", dtype=DTYPE)  # 1 GiB
    dst = torch.empty_like(src)

    def matmuls():
        x = a
        for _ in range(20):
            x = x @ a

    def hbm_copies():
        for _ in range(4):
            dst.copy_(src)

    compute = device.compute_stream()

    def compute_us(kernel, with_copies: bool) -> tuple[float, bool]:
        torch.cuda.synchronize()
        start, end = device.new_event(timing=True), device.new_event(timing=True)
        start.record(compute)
        kernel()
        end.record(compute)
        copies_done = []
        if with_copies:
            copies_done = [engine.enqueue(j, j) for j in range(copies)]
        torch.cuda.synchronize()
        window = end.elapsed_ns(start)
        # the copies ran inside the compute window: their last ready event came before its end
        last_ready = max((c.ready_event.elapsed_ns(start) for c in copies_done), default=0)
        return window / 1e3, last_ready <= window

    out = {"copies": copies}
    for name, kernel in (("matmul", matmuls), ("hbm_copy", hbm_copies)):
        for _ in range(3):
            compute_us(kernel, False), compute_us(kernel, True)
        alone = [compute_us(kernel, False)[0] for _ in range(reps)]
        runs = [compute_us(kernel, True) for _ in range(reps)]
        overlapped = [us for us, _ in runs]
        out[name] = {
            "alone_us": float(np.median(alone)),
            "with_copies_us": float(np.median(overlapped)),
            "slowdown": float(np.median(overlapped) / np.median(alone)),
            "copies_inside_window": float(np.mean([inside for _, inside in runs])),
        }
    return out


# ---- manager -----------------------------------------------------------------------------------


class _NullEvent:
    timing = False

    def __init__(self, calls: dict):
        self.calls = calls

    def record(self, stream) -> None:
        self.calls["record"] += 1

    def query(self) -> bool:
        self.calls["query"] += 1
        return True

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1

    def elapsed_ns(self, start) -> None:
        return None


class _NullStream:
    def __init__(self, calls: dict):
        self.calls = calls

    def wait_event(self, event) -> None:
        self.calls["wait"] += 1


class NullDevice(Device):
    """`--device null`: every device operation does nothing (copies are not made) and is only counted,
    so the manager section times the manager's own host work alone (Python and its compiled calls) and
    counts the device calls a CUDA device would make (each a few microseconds through torch there)."""

    name = "null"
    torch_device = torch.device("cpu")

    def __init__(self):
        self.calls = dict.fromkeys(("copy", "record", "query", "synchronize", "wait"), 0)

    def new_stream(self):
        return _NullStream(self.calls)

    def compute_stream(self):
        return _NullStream(self.calls)

    def new_event(self, timing: bool = False):
        return _NullEvent(self.calls)

    def copy(self, dst, src, stream) -> None:
        self.calls["copy"] += 1

    def synchronize(self) -> None:
        pass


def skewed_routing(rng, num_layers: int, num_experts: int, top_k: int, tokens: int) -> np.ndarray:
    """int64 [tokens, L, 1, K]: expert e with probability proportional to 1 / (e + 8) (bench_step.py)."""
    p = 1.0 / (np.arange(num_experts) + 8.0)
    p /= p.sum()
    out = np.empty((tokens, num_layers, 1, top_k), np.int64)
    for t in range(tokens):
        for layer in range(num_layers):
            out[t, layer, 0] = rng.choice(num_experts, top_k, replace=False, p=p)
    return out


def bench_manager(device, args) -> dict:
    L, E, K = args.layers, args.experts, args.top_k
    store = filled_store(L, E, args.manager_h, args.manager_i)
    if device.is_cuda:
        store.pin("auto")
    policy = make_policy(args.policy)
    cost = runtime_cost(args.cost_profile, args.on_miss, policy, store.expert_bytes, "bench_runtime")
    manager = CacheManager(store, device, args.capacity, policy, top_k=K, on_miss=args.on_miss, cost=cost)
    rng = np.random.default_rng(0)
    routing = skewed_routing(rng, L, E, K, args.warm_tokens + args.tokens)
    device_routing = torch.as_tensor(routing).to(device.torch_device) if device.is_cuda else None
    clock = time.perf_counter_ns
    host_ns, readback_ns = [], []
    for t in range(routing.shape[0]):
        for layer in range(L):
            t0 = clock()
            manager.visit(layer, routing[t, layer])
            t1 = clock()
            if t >= args.warm_tokens:
                host_ns.append(t1 - t0)
    if device_routing is not None:
        manager.reset()
        torch.cuda.synchronize()
        for t in range(routing.shape[0]):
            for layer in range(L):
                ids = device_routing[t, layer]
                t0 = clock()
                manager.visit(layer, ids)
                t1 = clock()
                if t >= args.warm_tokens:
                    readback_ns.append(t1 - t0)
    fast_ns = []
    calls_per_visit = None
    if device_routing is None:  # the fast loop's manager calls on host routing: its host work alone
        manager.reset()
        counted = getattr(device, "calls", None)
        # --sweep-mib: that many MiB read through the caches before each visit, untimed, as the CPU path
        # streams its experts' weights between two layers' visits in a decode step
        sweep = np.ones(args.sweep_mib << 17) if args.sweep_mib else None
        for t in range(routing.shape[0]):
            if counted is not None and t == args.warm_tokens:
                before = dict(counted)
            for layer in range(L):
                if sweep is not None:
                    sweep.sum()
                t0 = clock()
                manager.prepare(layer)
                visit = manager.visit(layer, routing[t, layer], compute_done=True)
                if visit.waited:  # on_miss="split": the compute stream's wait and the wait row
                    manager.enqueue_waits(visit)
                manager.commit()
                t1 = clock()
                if t >= args.warm_tokens:
                    fast_ns.append(t1 - t0)
        if counted is not None:
            visits = (routing.shape[0] - args.warm_tokens) * L
            calls_per_visit = {k: (counted[k] - before[k]) / visits for k in counted}
    else:  # the fast decode loop's sequence (moecache/runtime/segments.py), its read-back included
        phases: dict[str, list[int]] = {}
        fast_ns = _fast_loop_sequence(manager, device_routing, args, captured=True, phases=phases)
        event_ns = _fast_loop_sequence(manager, device_routing, args, captured=False)
    s = manager.stats
    out = {
        "policy": args.policy,
        "shape": [L, E, K],
        "capacity": manager.capacity,
        "visits_timed": len(host_ns),
        "host_routing_median_us": float(np.median(host_ns)) / 1e3,
        "host_routing_p90_us": float(np.percentile(host_ns, 90)) / 1e3,
        "hit_rate": s.hits / max(1, s.hits + s.misses),
        "sweep_mib": args.sweep_mib if device_routing is None else None,
    }
    if readback_ns:
        out["device_routing_median_us"] = float(np.median(readback_ns)) / 1e3
        out["device_routing_p90_us"] = float(np.percentile(readback_ns, 90)) / 1e3
    if calls_per_visit is not None:
        out["device_calls_per_visit"] = calls_per_visit
    if fast_ns:
        out["fast_loop_median_us"] = float(np.median(fast_ns)) / 1e3
        out["fast_loop_p90_us"] = float(np.percentile(fast_ns, 90)) / 1e3
    if args.on_miss == "split":  # over all three passes: the decision's and a waiting visit's host time
        out["split"] = {
            "decisions": s.split_decisions,
            "waits": s.split_waits,
            "decide_us": s.split_decide_ns / s.split_decisions / 1e3 if s.split_decisions else None,
            "wait_us": s.split_wait_ns / s.split_waits / 1e3 if s.split_waits else None,
        }
    if device_routing is not None:
        out["fast_loop_event_median_us"] = float(np.median(event_ns)) / 1e3
        out["fast_loop_phase_median_us"] = {k: float(np.median(v)) / 1e3 for k, v in phases.items()}
    return out


def _fast_loop_sequence(manager, device_routing, args, *, captured: bool, phases=None) -> list[int]:
    """Host ns per visit of the fast loop's sequence, prepare -> wait for the read-back -> visit -> commit.
    captured=True (what segments.py does): segment A's graph ends with the routing's copy to pinned
    memory, a device counter's bump and its copy; the host spins on the counter; the manager writes
    mapping rows to staging only and each layer's segment B graph copies its row (row_uploads="executor";
    B's replay is not timed). The graph is replayed
    and has run before the timer starts: in the loop it is segment A, whose compute the host waits for
    whoever reads its routing; what the manager adds is the spin's check, not the GPU's latency.
    captured=False (the previous loop): the host enqueues the copy and an event after A, and waits on
    the event (the timer covers those calls and the copy's latency). `phases` (captured only) gets the
    host ns of each part per visit: prepare, spin (the read-back check), visit, commit."""
    L = manager.shape.num_layers
    clock = time.perf_counter_ns
    manager.reset()
    ids_dev = torch.empty(device_routing.shape[2:], dtype=device_routing.dtype, device="cuda")
    host = torch.empty(ids_dev.shape, dtype=ids_dev.dtype, pin_memory=True)
    host_np = host.numpy()
    count_dev = torch.zeros(1, dtype=torch.int64, device="cuda")
    count_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    count_np = count_host.numpy()
    graph, rows = None, []
    if captured:  # segment A's tail, and each layer's segment B copying its row (row_uploads="executor")
        manager.row_uploads = "executor"
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            host.copy_(ids_dev, non_blocking=True)
            count_dev.add_(1)
            count_host.copy_(count_dev, non_blocking=True)
        for layer in range(L):
            rows.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(rows[-1]):
                manager.slot_of_LE[layer].copy_(manager.staging_row(layer), non_blocking=True)
    read_back = manager.device.new_event()
    torch.cuda.synchronize()
    out, expected = [], 0
    for t in range(device_routing.shape[0]):
        for layer in range(L):
            ids_dev.copy_(device_routing[t, layer])  # segment A's router output
            if captured:
                graph.replay()
                expected += 1
                torch.cuda.synchronize()
                t0 = clock()
                manager.prepare(layer)
                t_prepared = clock()
                rows[layer].replay()  # segment B(l): the executor's, not the manager's time
                t_replayed = clock()
                while count_np[0] < expected:
                    pass
                t_landed = clock()
                replay_ns = t_replayed - t_prepared  # B(l)'s replay: not the manager's time
            else:
                replay_ns = 0
                t0 = clock()
                host.copy_(ids_dev, non_blocking=True)
                read_back.record(manager.compute)
                manager.prepare(layer)
                read_back.synchronize()
            visit = manager.visit(layer, host_np, compute_done=True)
            if visit.waited:  # on_miss="split": the compute stream's wait and the wait row
                manager.enqueue_waits(visit)
            t_visited = clock()
            manager.commit()
            t1 = clock()
            if t >= args.warm_tokens:
                out.append(t1 - t0 - replay_ns)
                if phases is not None:
                    for name, ns in (
                        ("prepare", t_prepared - t0),
                        ("spin", t_landed - t_replayed),
                        ("visit", t_visited - t_landed),
                        ("commit", t1 - t_visited),
                    ):
                        phases.setdefault(name, []).append(ns)
    manager.row_uploads = "manager"
    return out


# ---- store -------------------------------------------------------------------------------------


def bench_store(num_experts: int, fill: str) -> dict:
    E = 256
    layers = -(-num_experts // E)
    rss0 = peak_rss_bytes()
    t0 = time.perf_counter()
    store = ExpertStore.allocate(layers, E, H, INTER, DTYPE) if num_experts % E == 0 else None
    if store is None:
        raise SystemExit("--store-experts must be a multiple of 256 (whole Qwen3.6 layers)")
    if fill == "random":
        store = filled_store(layers, E, H, INTER)
    else:  # touch every page (memset speed), as loading a checkpoint does
        store.flat_GB.fill_(1)
    fill_s = time.perf_counter() - t0
    pinned = store.pin("auto")
    out = {
        "experts": num_experts,
        "bytes": store.nbytes,
        "fill": fill,
        "fill_seconds": fill_s,
        "pinned": pinned,
        "register_seconds": store.register_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_before_bytes": rss0,
        "rss_over_store": (peak_rss_bytes() - rss0) / store.nbytes,
    }
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "standin", "null"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--overlap-copies", type=int, default=8)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity", default="2048")
    ap.add_argument("--policy", default="lfu")
    ap.add_argument("--on-miss", default="cpu", choices=["cpu", "split"])
    ap.add_argument("--cost-profile", default=None, help="a cost_profile.json (needed by --on-miss split)")
    ap.add_argument("--warm-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--sweep-mib",
        type=int,
        default=0,
        help="manager (host routing) and cpu_call: MiB read through the caches before each visit or call",
    )
    ap.add_argument("--manager-h", type=int, default=64)
    ap.add_argument("--manager-i", type=int, default=32)
    ap.add_argument(
        "--store-experts", type=int, default=1024, help="0 skips; 10240 = all of Qwen3.6 (60 GiB)"
    )
    ap.add_argument("--store-fill", default="constant", choices=["constant", "random"])
    ap.add_argument("--sections", default="copy,overlap,manager,store")
    args = ap.parse_args()
    if args.sweep_mib < 0:
        ap.error(f"--sweep-mib {args.sweep_mib}: must be >= 0")
    device = NullDevice() if args.device == "null" else make_device(args.device)
    sections = set(args.sections.split(","))
    result: dict = {"bench": "runtime", "device": device.name, "args": vars(args)}
    if device.is_cuda:
        result["gpu"] = torch.cuda.get_device_name()
    skipped = {}
    if "copy" in sections:
        if device.is_cuda:
            result["copy"] = bench_copy(device, args.reps)
        else:
            skipped["copy"] = "needs CUDA"
    if "overlap" in sections:
        if device.is_cuda:
            result["overlap"] = bench_overlap(device, args.reps, args.overlap_copies)
        else:
            skipped["overlap"] = "needs CUDA"
    if "manager" in sections:
        result["manager"] = bench_manager(device, args)
    if "cpu_call" in sections:
        result["cpu_call"] = bench_cpu_call(device, args)
    if "store" in sections and args.store_experts:
        result["store"] = bench_store(args.store_experts, args.store_fill)
    result["skipped"] = skipped
    print_table(result)
    print(json.dumps(result))


def print_table(r: dict) -> None:
    print(f"runtime benchmark on {r.get('gpu', r['device'])}")
    print(f"{'measure':<52} | {'value':>14}")
    rows = []
    if "copy" in r:
        c = r["copy"]
        rows += [
            ("engine: one 6 MiB expert (us, GB/s)", f"{c['engine_one_us']:.1f}, {c['engine_one_GBps']:.1f}"),
            ("engine: burst of 8 (us, GB/s)", f"{c['engine_burst8_us']:.1f}, {c['engine_burst8_GBps']:.1f}"),
            ("raw pinned copy, one expert (us, GB/s)", f"{c['raw_one_us']:.1f}, {c['raw_one_GBps']:.1f}"),
            (
                "raw pinned copies, burst of 8 (us, GB/s)",
                f"{c['raw_burst8_us']:.1f}, {c['raw_burst8_GBps']:.1f}",
            ),
            (
                "engine / raw bandwidth: one, burst of 8",
                f"{c['engine_one_over_raw']:.3f}, {c['engine_burst8_over_raw']:.3f}",
            ),
        ]
    if "overlap" in r:
        o = r["overlap"]
        for name in ("matmul", "hbm_copy"):
            k = o[name]
            rows += [
                (
                    f"{name}: alone / while copying {o['copies']} experts (us)",
                    f"{k['alone_us']:.1f} / {k['with_copies_us']:.1f}",
                ),
                (
                    f"{name}: slowdown, copies inside the window",
                    f"{k['slowdown']:.4f}, {k['copies_inside_window']:.2f}",
                ),
            ]
    if "cpu_call" in r:
        c = r["cpu_call"]
        for key, value in c.items():
            if key.endswith("_median_us"):
                form = key.removesuffix("_median_us").replace(
                    "_swept", f", {c['sweep_mib']} MiB swept before each"
                )
                rows.append((f"CPU half, T=1, every entry missing: {form} (us)", f"{value:.2f}"))
    if "manager" in r:
        m = r["manager"]
        label = f"manager visit, {m['policy']} {m['shape']} cap {m['capacity']}"
        rows.append((label + ", host ids (us)", f"{m['host_routing_median_us']:.2f}"))
        if "device_routing_median_us" in m:
            rows.append((label + ", + read-back (us)", f"{m['device_routing_median_us']:.2f}"))
        if "fast_loop_median_us" in m and r["device"] != "cuda":
            swept = f", {m['sweep_mib']} MiB swept before each" if m.get("sweep_mib") else ""
            rows.append(
                (
                    f"fast loop: prepare + visit + commit, host ids{swept} (us)",
                    f"{m['fast_loop_median_us']:.2f}",
                )
            )
        elif "fast_loop_median_us" in m:
            rows.append(
                (
                    "fast loop: prepare + read-back check (captured, landed) + visit + commit (us)",
                    f"{m['fast_loop_median_us']:.2f}",
                )
            )
            for name, us in m.get("fast_loop_phase_median_us", {}).items():
                rows.append((f"fast loop (captured), median of its {name} (us)", f"{us:.2f}"))
            rows.append(
                (
                    "fast loop, previous: read-back copy + event + prepare + wait + visit + commit (us)",
                    f"{m['fast_loop_event_median_us']:.2f}",
                )
            )
        rows.append(("manager hit rate", f"{m['hit_rate']:.3f}"))
        if "split" in m:
            sp = m["split"]
            for what, key, n in (
                ("decision", "decide_us", "decisions"),
                ("waiting visit", "wait_us", "waits"),
            ):
                us = "-" if sp[key] is None else f"{sp[key]:.2f}"
                rows.append((f"split: host us per {what} ({sp[n]} of them)", us))
        if "device_calls_per_visit" in m:
            for name, n in m["device_calls_per_visit"].items():
                rows.append((f"device calls per visit (fast loop, host ids): {name}", f"{n:.3f}"))
    if "store" in r:
        s = r["store"]
        reg = "n/a" if s["register_seconds"] is None else f"{s['register_seconds']:.2f}"
        rows += [
            (f"store of {s['experts']} experts ({s['bytes'] / 2**30:.1f} GiB): register s", reg),
            ("store: pinned", str(s["pinned"])),
            ("store: peak RSS (GiB)", f"{s['peak_rss_bytes'] / 2**30:.2f}"),
        ]
    for name, why in r["skipped"].items():
        rows.append((f"{name}: skipped", why))
    for name, value in rows:
        print(f"{name:<52} | {value:>14}")


if __name__ == "__main__":
    try:
        main()
    except MoecacheError as exc:  # bad input: one line, exit 2
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
