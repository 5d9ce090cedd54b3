"""Timing primitives for the cost profile: one SwiGLU expert on the CPU and on CUDA, and host-to-device copies.

Each function measures one thing and returns a `Timing` (median and p10/p90 over `repeats` calls after
`warmup` untimed ones), every one through the same primitive: `time_calls(call, repeats, warmup, clock)`
under a `HostClock` (wall time, the runtime's device drained around the call) or `CudaEvents` (device
time between events). The functions only build what is timed; the fit of the profile's derived fields
is `moecache.calibration_fit`. Expert weights rotate over a pool of synthetic experts whose bytes exceed the cache
(the CPU's last-level cache, the GPU's L2), so every call reads its weights from memory as a real miss does.
No model weights are needed: only the expert shape.

Shape legend: P experts in the rotating pool, M tokens per call, H hidden size, I intermediate size.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moecache.generation import fast_generate, transformers_generate
from moecache.models.host_pages import huge_page_bytes
from moecache.token_clock import TokenStamps

MiB = 1 << 20


@dataclass(frozen=True)
class ExpertShape:
    """The shape of one SwiGLU expert: gate_up (2I, H) and down (H, I)."""

    hidden_size: int
    moe_intermediate_size: int

    def params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def bytes(self, dtype: torch.dtype) -> int:
        return self.params() * dtype.itemsize


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timings, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    repeats: int

    def as_dict(self) -> dict:
        return {
            "median_us": self.median_us,
            "p10_us": self.p10_us,
            "p90_us": self.p90_us,
            "repeats": self.repeats,
        }


def summarize(samples_us: list[float]) -> Timing:
    """Median and 10th/90th percentiles (linear interpolation between order statistics)."""
    if not samples_us:
        raise ValueError("no timing samples")
    ordered = sorted(samples_us)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return Timing(statistics.median(ordered), pct(0.1), pct(0.9), len(ordered))


class HostClock:
    """Host wall time (perf_counter_ns) of one call. With a runtime `device` (CudaDevice or
    StandinDevice: `is_cuda`, `synchronize()`) it is drained before and after the call. On CUDA the time
    stops when the call returns: what it enqueued (a visit's expert copies, ~0.3 ms each on the copy
    stream) runs on the device, priced on its own (the copy engine's rows), not host time. On the
    stand-in the drain is in the time: its queued work is host work, which a run pays at the next visit."""

    def __init__(self, device=None):
        self._device = device

    def sample_us(self, fn) -> float:
        """Microseconds of one `fn()`."""
        device = self._device
        if device is None:
            t0 = time.perf_counter_ns()
            fn()
            return (time.perf_counter_ns() - t0) / 1e3
        device.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        device.synchronize()
        return ((t1 if device.is_cuda else time.perf_counter_ns()) - t0) / 1e3

    def time_calls(self, call, repeats: int, warmup: int) -> Timing:
        samples_us = [self.sample_us(lambda n=n: call(n)) for n in range(warmup + repeats)]
        return summarize(samples_us[warmup:])


class CudaEvents:
    """Device time between CUDA events recorded around each call on `device`'s current stream: the
    `warmup` calls first, the device drained, then the timed calls enqueued back to back, their events
    read once all are done (no host wait between calls: a launch's host cost is hidden when the device
    is behind, as in a run)."""

    def __init__(self, device: torch.device):
        self._device = device

    def time_calls(self, call, repeats: int, warmup: int) -> Timing:
        with torch.cuda.device(self._device):
            for n in range(warmup):
                call(n)
            torch.cuda.synchronize(self._device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(repeats)
            ]
            for n, (begin, end) in enumerate(events):
                begin.record()
                call(warmup + n)
                end.record()
            torch.cuda.synchronize(self._device)
        return summarize([begin.elapsed_time(end) * 1e3 for begin, end in events])


def time_calls(call, repeats: int, warmup: int, clock: HostClock | CudaEvents) -> Timing:
    """The one timing primitive: `call(n)` for n = 0 .. warmup + repeats - 1 under `clock`, the first
    `warmup` calls untimed; the Timing of the others."""
    return clock.time_calls(call, repeats, warmup)


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype '{name}'")
    return dtype


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest cache of CPU 0 as sysfs reports it (the L3 on most x86 machines); None if unreadable."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = None
    try:
        for index in sysfs.glob("index*"):
            text = (index / "size").read_text().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
            best = size if best is None else max(best, size)
    except (OSError, ValueError):
        return None
    return best


def gpu_l2_bytes(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def pool_experts(expert_bytes: int, cache_bytes: int, max_pool_bytes: int, min_experts: int = 2) -> int:
    """Experts in a pool of more than twice `cache_bytes`, capped at `max_pool_bytes` (at least `min_experts`)."""
    want = 2 * cache_bytes // expert_bytes + 1
    cap = max_pool_bytes // expert_bytes
    return max(min_experts, min(want, cap))


def make_pool(
    shape: ExpertShape,
    num_experts: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    pages: str = "huge",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct memory for `num_experts` experts: gate_up (P, 2I, H) and down (P, H, I).

    One random expert is drawn and copied into every slot: the values do not change the timing, the
    distinct memory does, and a copy fills gigabytes much faster than a random generator. On the CPU
    the pool is in the pages the expert store uses (`pages`: moecache/models/host_pages.py).
    """
    gen = torch.Generator().manual_seed(seed)
    h, i = shape.hidden_size, shape.moe_intermediate_size
    gate_up_2IH = (torch.randn(2 * i, h, generator=gen) * h**-0.5).to(device=device, dtype=dtype)
    down_HI = (torch.randn(h, i, generator=gen) * i**-0.5).to(device=device, dtype=dtype)
    if torch.device(device).type != "cpu":
        return gate_up_2IH.expand(num_experts, 2 * i, h).clone(), down_HI.expand(num_experts, h, i).clone()

    def filled(one_XY):
        nbytes = num_experts * one_XY.numel() * one_XY.element_size()
        pool_PXY = huge_page_bytes(nbytes, pages).view(dtype).view(num_experts, *one_XY.shape)
        return pool_PXY.copy_(one_XY.expand_as(pool_PXY))

    return filled(gate_up_2IH), filled(down_HI)


def _input(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)


HOST_LOOP_ITEMS = 20_000  # one host-loop sample: this many iterations of a plain Python loop (815 us, dev VM)


def time_host_loop(repeats: int = 31, warmup: int = 3) -> Timing:
    """Wall time of a fixed plain Python loop on this thread: the host thread's own speed, which the
    runtime's host points (the manager's visit, the segments' launches) run at. calibrate records it
    (`machine.host_loop`) and validate times it again (moecache/validation/machine_check.py)."""

    def loop(n: int) -> int:
        acc = 0
        for i in range(HOST_LOOP_ITEMS):
            acc += i * i
        return acc

    return time_calls(loop, repeats, warmup, HostClock())


def native_expert(x_MH: torch.Tensor, gate_up_2IH: torch.Tensor, down_HI: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert in its tensors' own dtype, as transformers' eager loop runs one: what a torch
    expert call costs (the reference's float32 emulation would time its widening copies instead)."""
    gate_up_M2I = F.linear(x_MH, gate_up_2IH)
    inter = down_HI.shape[1]
    return F.linear(F.silu(gate_up_M2I[:, :inter]) * gate_up_M2I[:, inter:], down_HI)


@torch.inference_mode()
def time_cpu_expert(
    pool: tuple[torch.Tensor, torch.Tensor], tokens: int, repeats: int, warmup: int, start: int = 0
) -> Timing:
    """Wall time of one expert call on M=`tokens` tokens, each call on the next expert of the pool.

    `start` is the pool position of the first call, so consecutive measurements keep rotating.
    """
    gate_up_P2IH, down_PHI = pool
    num = gate_up_P2IH.shape[0]
    x_MH = _input(tokens, gate_up_P2IH.shape[2], gate_up_P2IH.dtype, "cpu")

    def call(n: int):
        e = (start + n) % num
        return native_expert(x_MH, gate_up_P2IH[e], down_PHI[e])

    return time_calls(call, repeats, warmup, HostClock())


@torch.inference_mode()
def time_cuda_expert(
    pool: tuple[torch.Tensor, torch.Tensor], tokens: int, repeats: int, warmup: int, start: int = 0
) -> Timing:
    """CUDA-event time of one expert call (its launches included) on M=`tokens` tokens, rotating over a GPU pool."""
    gate_up_P2IH, down_PHI = pool
    device = gate_up_P2IH.device
    num = gate_up_P2IH.shape[0]
    x_MH = _input(tokens, gate_up_P2IH.shape[2], gate_up_P2IH.dtype, device)

    def call(n: int):
        e = (start + n) % num
        return native_expert(x_MH, gate_up_P2IH[e], down_PHI[e])

    return time_calls(call, repeats, warmup, CudaEvents(device))


def time_h2d_copy(nbytes: int, pinned: bool, repeats: int, warmup: int, device: torch.device) -> Timing:
    """CUDA-event time of one host-to-device copy of `nbytes` from a pinned or a pageable host buffer.

    The copy is issued with non_blocking=True on the current stream (from pageable memory the driver
    stages it through its own pinned buffer, as a real pageable copy does).
    """
    host_B = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host_B.fill_(1)  # touch every page before timing
    dev_B = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return time_calls(lambda n: dev_B.copy_(host_B, non_blocking=True), repeats, warmup, CudaEvents(device))


def gbps(nbytes: int, time_us: float) -> float:
    """Bytes over microseconds, in GB/s (1e9 bytes per second)."""
    return nbytes / time_us / 1e3


def fit_latency_bandwidth(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of `time_us = latency_us + bytes / (gbps * 1e3)`; returns (latency_us, gbps).

    Residuals are weighted by 1/time (relative error), so small copies, which the fixed latency dominates,
    count as much as large ones, which the bandwidth dominates. A negative latency is clamped to zero and
    the bandwidth refitted through the origin.
    """
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("the latency/bandwidth fit needs at least two distinct copy sizes")
    # Weighted normal equations for t = a + s * b, weights w = 1 / t^2.
    sw = swb = swbb = swt = swbt = 0.0
    for nbytes, t in points:
        w = 1.0 / (t * t)
        sw += w
        swb += w * nbytes
        swbb += w * nbytes * nbytes
        swt += w * t
        swbt += w * nbytes * t
    det = sw * swbb - swb * swb
    latency_us = (swbb * swt - swb * swbt) / det
    slope = (sw * swbt - swb * swt) / det  # microseconds per byte
    if latency_us < 0:
        latency_us, slope = 0.0, swbt / swbb
    if slope <= 0:
        raise ValueError(f"copy times do not grow with size; cannot fit a bandwidth to {points}")
    return latency_us, 1.0 / slope / 1e3


# ---------------------------------------------------------------------------------------------------
# The runtime's own costs (cost profile schema 2): the code paths `moecache.offload` runs, timed as the
# runtime calls them (moecache/runtime/experts_module.py), on a synthetic store of the model's shape.
#
# Legend (runtime): T tokens of a layer step, K top-k, E experts of a layer, R resident experts (slots),
# N resident (token, k) entries of a step, U experts of one CPU-path call, M tokens per expert.


@dataclass(frozen=True)
class RuntimeShape:
    """What the runtime measurements need of the model: one MoE layer's shape and its weight dtype."""

    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    dtype: torch.dtype

    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * self.dtype.itemsize


def synthetic_runtime(
    shape: RuntimeShape,
    store_experts: int,
    slots: int,
    device,
    *,
    cpu_threads: int | None = None,
    cpu_backend: str = "auto",
    policy: str = "lru",
):
    """An `ExpertsRuntime` (the object every offloaded layer calls) over a one-layer store of
    `store_experts` random experts of `shape` and a slot pool of `slots` filled with the first of them,
    its manager running `policy`. `device`: a runtime Device (CudaDevice or StandinDevice). The store is
    pinned on CUDA, as `moecache.offload` pins it."""
    from moecache.models.expert_store import ExpertStore
    from moecache.runtime.cpu_experts import CpuExperts
    from moecache.runtime.experts_module import ExpertsRuntime
    from moecache.runtime.manager import CacheManager

    if store_experts < max(shape.num_experts, slots):
        raise ValueError(f"store of {store_experts} experts < E={shape.num_experts} or slots={slots}")
    h, i = shape.hidden_size, shape.moe_intermediate_size
    store = ExpertStore.allocate(1, store_experts, h, i, shape.dtype)
    gate_up_P2IH, down_PHI = make_pool(ExpertShape(h, i), 1, shape.dtype)
    store.w13_GIH.copy_(gate_up_P2IH.expand(store_experts, 2 * i, h))
    store.w2_GHI.copy_(down_PHI.expand(store_experts, h, i))
    store.pin("auto" if device.is_cuda else "off")
    manager = CacheManager.from_policy(store, device, slots, policy, top_k=shape.top_k)
    manager.pool.flat_SB.copy_(store.flat_GB[:slots])
    cpu = CpuExperts(store.w13_GIH, store.w2_GHI, threads=cpu_threads, backend=cpu_backend)
    return ExpertsRuntime(manager, cpu)


def _entries_routing(
    tokens: int, entries: int, shape: RuntimeShape, resident: int, gen: torch.Generator
) -> torch.Tensor:
    """int64 [T, K] routing with exactly `entries` (token, k) entries on the first `resident` experts
    (spread evenly over the tokens, the first ones in each row) and the rest on the others; distinct
    experts within a token, drawn at random."""
    k, e = shape.top_k, shape.num_experts
    ids_TK = torch.empty(tokens, k, dtype=torch.int64)
    for t in range(tokens):
        hits = entries // tokens + (t < entries % tokens)
        ids_TK[t, :hits] = torch.randperm(resident, generator=gen)[:hits]
        ids_TK[t, hits:] = resident + torch.randperm(e - resident, generator=gen)[: k - hits]
    return ids_TK


def _weights(tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    w_TK = torch.rand(tokens, k, generator=gen) + 0.1
    return w_TK / w_TK.sum(dim=1, keepdim=True)


def entries_grid(tokens: int, top_k: int, resident: int) -> list[int]:
    """Resident entries at which the operator is timed for `tokens` tokens: 1, 2, 4, ... and the most a
    step can have, tokens x min(top_k, resident)."""
    most = tokens * min(top_k, resident)
    grid, n = set(), 1
    while n < most:
        grid.add(n)
        n *= 2
    return sorted(grid | {most})


def _time_graphs(dev, calls, repeats: int, warmup: int) -> Timing:
    """Device time of a CUDA graph replay of each of `calls` (captured once each, after an eager call),
    in turn: `warmup` replays untimed, then `repeats` between events."""
    graphs = []
    for call in calls:
        call()  # Triton's compile and launch caches, before the capture
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)

    def replay(n: int):  # the warmup replays from the first graph, and the timed ones again
        graphs[(n if n < warmup else n - warmup) % len(graphs)].replay()

    return time_calls(replay, repeats, warmup, CudaEvents(dev))


@torch.inference_mode()
def time_slot_moe(
    runtime,
    shape: RuntimeShape,
    tokens: int,
    entries: int,
    repeats: int,
    warmup: int,
    seed: int = 0,
    *,
    graphs: bool = False,
) -> Timing:
    """One call of the runtime's GPU half (`ExpertsRuntime.resident`: `slot_moe` on CUDA, its torch
    reference queued and run on the stand-in) for a step of `tokens` tokens with `entries` resident
    entries. CUDA: device time between events around the call, launched eagerly or (`graphs`, as the
    fast loop runs it) as a CUDA graph of the call replayed; stand-in: host wall time."""
    device = runtime.device
    dev = device.torch_device
    slot_of_E, calls = _operator_calls(runtime, shape, tokens, entries, min(warmup + repeats, 8), seed)
    x_TH = _input(tokens, shape.hidden_size, shape.dtype, dev)

    def one(n: int):
        ids_TK, w_TK = calls[n % len(calls)]
        return runtime.resident(x_TH, ids_TK, w_TK, slot_of_E)

    if device.is_cuda and graphs:
        return _time_graphs(dev, [lambda n=n: one(n) for n in range(len(calls))], repeats, warmup)
    return time_calls(one, repeats, warmup, CudaEvents(dev) if device.is_cuda else HostClock(device))


def time_in_model(
    model, adapter, tokens: int, call, repeats: int, warmup: int, *, vocab_size: int, step=None, seed=0
) -> Timing:
    """Host wall time of `call(n, x_TH)` (one piece of the runtime's layer step) where the runtime runs it:
    inside the model's forward, at every MoE layer, between the model's own work. A host call alone in a
    tight loop finds its code and data in the core's caches; in a run the layer's attention and router
    have evicted them, and the same call costs more (1.4-1.6x for the stand-in's operator on the tiny CPU
    model: docs/benchmarks.md). Steps of T=`tokens`: the decode steps for T=1 (after a 4-token prompt),
    else prefills of a `tokens`-token prompt; `warmup` calls untimed, then `repeats` timed. Every MoE
    block's `.experts` is replaced by the probe for the measurement and restored after. `step`: the
    decode loop (`transformers_generate` when None), as in `time_model_steps`. The probe is a `ZeroExperts`
    whose work is the timed call."""
    step = step or transformers_generate
    layers = adapter.moe_layers()
    want = warmup + repeats
    samples: list[float] = []
    saved = [layer.block.experts for layer in layers]

    clock = HostClock()

    def timed_call(x_TH):  # at every call of `tokens` tokens: `call` timed (n: the calls timed so far)
        if x_TH.shape[0] == tokens:
            samples.append(clock.sample_us(lambda: call(len(samples), x_TH)))

    probe = ZeroExperts(timed_call, [0.0])  # the routing read back as the runtime does, zeros returned
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed + tokens)
    decode = tokens == 1
    prompt_1T = torch.randint(0, vocab_size, (1, 4 if decode else tokens), generator=gen).to(device)
    per_run = 1 + -(-want // len(layers)) if decode else 1  # the first token is the prefill's
    try:
        for layer in layers:
            layer.block.experts = probe
        with torch.inference_mode():  # as `moecache validate` runs the model
            step(model, prompt_1T, 1, TokenStamps(False))  # the model's first-call costs, untimed
            samples.clear()
            while len(samples) < want:
                step(model, prompt_1T, per_run, TokenStamps(False))
    finally:
        for layer, experts in zip(layers, saved, strict=True):
            layer.block.experts = experts
    return summarize(samples[warmup:want])


def _random_layout(num_experts: int, resident: int, gen: torch.Generator, dev) -> torch.Tensor:
    """slot_of_E on `dev`: the pool's `resident` slots in a random order over the first experts."""
    slot_of_E = torch.full((num_experts,), -1, dtype=torch.int32)
    slot_of_E[:resident] = torch.randperm(resident, generator=gen).to(torch.int32)
    return slot_of_E.to(dev)


def _operator_calls(runtime, shape: RuntimeShape, tokens: int, entries: int, count: int, seed: int):
    """slot_of_E (a random layout of the pool's slots over the first experts) and `count` routings of
    `tokens` tokens with `entries` resident entries, on the runtime's device (time_slot_moe's inputs)."""
    resident = runtime.pool.capacity
    gen = torch.Generator().manual_seed(seed + 1000 * tokens + entries)
    dev = runtime.device.torch_device
    slot_of_E = _random_layout(shape.num_experts, resident, gen, dev)
    calls = [
        (
            _entries_routing(tokens, entries, shape, resident, gen).to(dev),
            _weights(tokens, shape.top_k, gen).to(device=dev, dtype=shape.dtype),
        )
        for _ in range(count)
    ]
    return slot_of_E, calls


def time_slot_moe_in_model(
    model, adapter, runtime, shape: RuntimeShape, tokens: int, entries: int, repeats: int, warmup: int, **kw
) -> Timing:
    """`time_slot_moe`'s call (the runtime's GPU half, `entries` resident entries of `tokens` tokens) on
    the model's hidden states inside its forward (`time_in_model`; `kw`: its vocab_size, step, seed)."""
    slot_of_E, calls = _operator_calls(
        runtime, shape, tokens, entries, min(warmup + repeats, 8), kw.get("seed", 0)
    )

    def call(n, x_TH):
        ids_TK, w_TK = calls[n % len(calls)]
        runtime.resident(x_TH, ids_TK, w_TK, slot_of_E)

    return time_in_model(model, adapter, tokens, call, repeats, warmup, **kw)


def time_cpu_path_in_model(
    model, adapter, runtime, shape: RuntimeShape, tokens_per_expert: int, experts: int, repeats, warmup, **kw
) -> Timing:
    """`time_cpu_path`'s call (the runtime's CPU half, `experts` missed experts of `tokens_per_expert`
    tokens each, rotating over the store) on the model's hidden states inside its forward (`time_in_model`)."""
    store_experts = runtime.manager.shape.num_experts
    m, u = tokens_per_expert, experts
    gen = torch.Generator().manual_seed(7 * m + u)
    w_TU = _weights(m, u, gen).to(device=runtime.device.torch_device, dtype=shape.dtype)
    miss_TU = np.zeros((m, u), np.bool_)

    def call(n, x_TH):
        first = (n * u) % (store_experts - u + 1)
        ids_TU = np.tile(np.arange(first, first + u, dtype=np.int64), (m, 1))
        cpu_half(runtime, x_TH, ids_TU, w_TU, miss_TU)

    return time_in_model(model, adapter, m, call, repeats, warmup, **kw)


def time_layer_call_in_model(
    model, adapter, runtime, shape: RuntimeShape, tokens: int, repeats: int, warmup: int, **kw
) -> Timing:
    """`time_layer_call`'s call (a whole experts-module call, its two halves stubbed to zeros) on the
    model's hidden states inside its forward (`time_in_model`)."""
    calls = _layer_call_routings(
        shape, tokens, min(warmup + repeats, 8), kw.get("seed", 0), runtime.device.torch_device
    )

    stubbed = halves_stubbed(runtime)
    return time_in_model(
        model, adapter, tokens, lambda n, x_TH: stubbed.run(0, x_TH, *calls[n % len(calls)]),
        repeats, warmup, **kw,
    )  # fmt: skip


@torch.inference_mode()
def time_cpu_path(
    runtime, shape: RuntimeShape, tokens_per_expert: int, experts: int, repeats: int, warmup: int
) -> Timing:
    """Host wall time of the runtime's CPU half (`cpu_half`: the x read to the host, the routing's missed
    entries gathered, `CpuExperts.run`, the result back on x's device) for `experts` missed experts of
    `tokens_per_expert` tokens each (every token selects all of them). Successive calls rotate over the
    store, so weights come from memory as the run's own do when its store outgrows the cache."""
    device = runtime.device
    dev = device.torch_device
    store_experts = runtime.manager.shape.num_experts
    m, u = tokens_per_expert, experts
    gen = torch.Generator().manual_seed(7 * m + u)
    x_TH = _input(m, shape.hidden_size, shape.dtype, dev)
    w_TU = _weights(m, u, gen).to(device=dev, dtype=shape.dtype)
    miss_TU = np.zeros((m, u), np.bool_)
    ids_nTU = [
        np.tile(np.arange(first, first + u, dtype=np.int64), (m, 1))
        for first in ((n * u) % (store_experts - u + 1) for n in range(warmup + repeats))
    ]
    return time_calls(
        lambda n: cpu_half(runtime, x_TH, ids_nTU[n], w_TU, miss_TU), repeats, warmup, HostClock(device)
    )


def time_visit(manager, shape: RuntimeShape, tokens: int, repeats: int, warmup: int, seed: int = 0) -> Timing:
    """Host wall time of one cache-manager layer visit and its commit (`manager.visit` + `commit`:
    publication, the compiled policy step, evictions, admissions and their copies enqueued) for random
    routings of `tokens` tokens, the manager's policy and capacity as given."""
    gen = np.random.default_rng(seed + tokens)
    e, k = shape.num_experts, shape.top_k
    routings = [
        np.stack([gen.choice(e, size=k, replace=False) for _ in range(tokens)]).astype(np.int64)
        for _ in range(warmup + repeats)
    ]

    def one(n: int) -> None:
        manager.visit(0, routings[n])
        manager.commit()

    return time_calls(one, repeats, warmup, HostClock(manager.device))


@torch.inference_mode()
def _layer_call_routings(shape: RuntimeShape, tokens: int, count: int, seed: int, dev) -> list[tuple]:
    """`count` (ids_TK, weights_TK) of `tokens` tokens on `dev`: K distinct random experts per token,
    equal weights (time_layer_call's inputs, in a loop or inside the model)."""
    gen = np.random.default_rng(seed + tokens)
    e, k = shape.num_experts, shape.top_k
    return [
        (
            torch.from_numpy(
                np.stack([gen.choice(e, size=k, replace=False) for _ in range(tokens)]).astype(np.int64)
            ).to(dev),
            torch.full((tokens, k), 1.0 / k, dtype=shape.dtype, device=dev),
        )
        for _ in range(count)
    ]


def time_layer_call(
    runtime, shape: RuntimeShape, tokens: int, repeats: int, warmup: int, seed: int = 0
) -> Timing:
    """Host wall time of one whole experts-module call (`ExpertsRuntime.run`: the routing read back, the
    manager's visit and commit, the hit mask split, the two halves' results combined) with its two halves
    stubbed to return zeros: what a layer step costs besides the operator and the CPU path, which are
    timed on their own (`time_slot_moe`, `time_cpu_path`). Random routings of `tokens` tokens."""
    dev = runtime.device.torch_device
    x_TH = _input(tokens, shape.hidden_size, shape.dtype, dev)
    calls = _layer_call_routings(shape, tokens, warmup + repeats, seed, dev)
    stubbed = halves_stubbed(runtime, torch.zeros_like(x_TH))
    return time_calls(lambda n: stubbed.run(0, x_TH, *calls[n]), repeats, warmup, HostClock(runtime.device))


def cpu_half(runtime, x_TH, ids_host_TK, weights_TK, hit_TK) -> torch.Tensor:
    """The runtime's CPU half as the eager layer step runs it (`ExpertsRuntime.run`): x read to the host,
    the missed entries (`hit_TK` False) run from the store, their sum back on x's device."""
    y_TH, _ = runtime.cpu_half(
        0, x_TH.detach().to("cpu"), ids_host_TK, weights_TK, hit_TK,
        place=lambda y_host_TH: y_host_TH.to(x_TH.device, non_blocking=False),
    )  # fmt: skip
    return y_TH


def halves_stubbed(runtime, zeros_TH: torch.Tensor | None = None):
    """An `ExpertsRuntime` over `runtime`'s manager and CPU executor whose two halves (`resident` and
    `cpu_half`) return zeros (`zeros_TH` when given, else zeros like x) without computing: `run` then
    costs the routing read-back, the manager's visit and commit, the split and the combine only
    (time_layer_call*). A subclass over the public pieces, so the runtime given is left as it is."""
    from moecache.runtime.experts_module import ExpertsRuntime

    class HalvesStubbed(ExpertsRuntime):
        def resident(self, x_TH, *args, **kwargs):
            return zeros_TH if zeros_TH is not None else torch.zeros_like(x_TH)

        def cpu_half(self, layer, x_host_TH, *args, **kwargs):
            return (zeros_TH if zeros_TH is not None else torch.zeros_like(x_host_TH)), 0

    return HalvesStubbed(runtime.manager, runtime.cpu)


def time_copy_engine(runtime, copies: int, repeats: int, warmup: int) -> tuple[Timing, Timing]:
    """The runtime's copy engine (`TransferEngine.enqueue` from the pinned store into a slot): host time
    from enqueue to its ready event seen complete, for one copy alone and for `copies` copies enqueued
    back to back (to the last one complete). CUDA only. Returns (single, batch)."""
    engine = runtime.manager.engine
    device = runtime.device
    store_experts = runtime.manager.shape.num_experts
    slots = runtime.pool.capacity
    if slots < copies:
        raise ValueError(f"copy engine timing: {copies} copies need as many slots, the pool has {slots}")

    clock = HostClock(device)  # on CUDA: the time stops when the last copy is seen complete

    def run(n_copies: int, first_key: int) -> float:
        done = []

        def enqueue_and_wait() -> None:
            done.extend(engine.enqueue((first_key + j) % store_experts, j) for j in range(n_copies))
            while not done[-1].ready_event.query():
                pass

        elapsed = clock.sample_us(enqueue_and_wait)
        for copy in done:  # the slots back, untimed
            copy.observe()
            engine.release(copy)
        return elapsed

    single = [run(1, n) for n in range(warmup + repeats)][warmup:]
    batch = [run(copies, n * copies) for n in range(warmup + repeats)][warmup:]
    return summarize(single), summarize(batch)


# ---- non-expert time: the model itself, its routed experts replaced by zeros ------------------------


class ZeroExperts(torch.nn.Module):
    """Stands in for a sparse MoE block's `.experts` (the runtime's signature): reads the routing back to
    the host, as the runtime's experts module does at every layer visit (that read waits for the router),
    and returns zeros. The router, the shared expert and everything else stay the model's.

    `work(x_TH)`, if given, runs at every call and its host time is added to `spent_s[0]` (seconds), which
    `time_model_steps` subtracts: the model's own work then runs behind expert work, as in a run, whose
    cache pressure it pays (the stand-in: docs/simulator.md), and is timed without it."""

    def __init__(self, work=None, spent_s: list[float] | None = None):
        super().__init__()
        self._work, self._spent_s = work, spent_s

    def forward(self, hidden_states, top_k_index, top_k_weights):
        top_k_index.detach().to("cpu", torch.int64)
        if self._work is not None:
            self._spent_s[0] += HostClock().sample_us(lambda: self._work(hidden_states)) / 1e6
        return torch.zeros_like(hidden_states)


def zero_experts(adapter, work=None, spent_s: list[float] | None = None) -> int:
    """Replace every MoE block's routed experts of the adapter's model by `ZeroExperts` (with `work` and
    `spent_s`, shared by all layers); the number of MoE layers."""
    layers = adapter.moe_layers()
    for layer in layers:
        layer.block.experts = ZeroExperts(work, spent_s)
    return len(layers)


def resident_operator_work(runtime, shape: RuntimeShape, seed: int = 0):
    """`work(x_TH)` for `ZeroExperts`: the runtime's GPU half on x's T tokens, every entry resident (K
    distinct resident experts per token, drawn at random): the expert work of an all-resident layer step."""
    gen = torch.Generator().manual_seed(seed)
    resident = runtime.pool.capacity
    dev = runtime.device.torch_device
    slot_of_E = _random_layout(shape.num_experts, resident, gen, dev)
    k = min(shape.top_k, resident)

    def work(x_TH):
        t = x_TH.shape[0]
        ids_TK = torch.stack([torch.randperm(resident, generator=gen)[:k] for _ in range(t)]).to(dev)
        runtime.resident(x_TH, ids_TK, _weights(t, k, gen).to(device=dev, dtype=x_TH.dtype), slot_of_E)

    return work


class _StampsLess(TokenStamps):
    """Token stamps less the host time spent in `ZeroExperts` work so far (`spent_s[0]`, seconds)."""

    def __init__(self, cuda: bool, spent_s: list[float]):
        super().__init__(cuda)
        self._spent_s = spent_s

    def __call__(self, input_ids, scores):
        scores = super().__call__(input_ids, scores)
        self.times[-1] -= self._spent_s[0]
        return scores


def fast_eager_generate(model, prompt_1T: torch.Tensor, new_tokens: int, stamp) -> None:
    """moecache's fast decode loop (`generation.fast_generate`) eager (graphs off): `time_in_model` runs
    it with a probe as every layer's experts (`ZeroExperts`), whose routing read-back no CUDA graph
    could hold. The offloaded model's own fast loop is timed by `time_fast_steps`."""
    fast_generate(model, prompt_1T, new_tokens, stamp, graphs="off")


# The decode loop of each cost.runtime.step: the non-expert time of step=transformers (time_model_steps)
# and, on the stand-in, the loop the in-model host timings run in (time_in_model); step=fast times its
# non-expert time on the offloaded model instead (time_fast_steps).
STEP_FUNCTIONS = {"transformers": transformers_generate, "fast": fast_eager_generate}


def random_forcing(shape, prompt_tokens: int, tokens: int, seed: int = 0):
    """A ForcedRouting of one request "calibrate" of `tokens` tokens (the first `prompt_tokens` its
    prefill) for a model of `shape` (a ModelShape: L, E, K): per token and MoE layer K distinct experts
    drawn uniformly at random, random weights summing to 1. What `time_fast_steps` forces."""
    from moecache.runtime.forced_routing import ForcedRouting

    ids_LNK, w_LNK = random_routing(shape, tokens, seed)
    return ForcedRouting.from_arrays(
        {"calibrate": (ids_LNK, w_LNK, prompt_tokens)}, num_experts=shape.num_experts
    )


def random_routing(shape, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [L, tokens, K], weights float32 [L, tokens, K]): `random_forcing`'s routing."""
    rng = np.random.default_rng(seed)
    L, E, K = shape.num_layers, shape.num_experts, shape.top_k
    ids_LNK = np.argsort(rng.random((L, tokens, E)), axis=-1)[..., :K].astype(np.int64)
    w_LNK = rng.random((L, tokens, K), dtype=np.float32) + np.float32(0.1)
    w_LNK /= w_LNK.sum(axis=-1, keepdims=True)
    return ids_LNK, w_LNK


# A timed whole-model run (a prefill and its decode steps) costs as much as many calls of one piece: it
# is repeated a quarter as often as cost.runtime.repeats says, at least MODEL_RUN_MIN_REPEATS times (a
# median), after at most MODEL_RUN_WARMUP untimed runs (the first pays the one-time costs).
MODEL_RUN_REPEATS_DIVISOR, MODEL_RUN_MIN_REPEATS, MODEL_RUN_WARMUP = 4, 3, 1


def in_loop_repeats(rs: dict) -> int:
    """Timed runs of each whole-model measurement (the non-expert runs, the in-loop CPU-path and
    split-host runs of step=fast), from the cost.runtime settings `rs`; the fit replays the in-loop
    runs' routing (calibration_fit)."""
    return max(MODEL_RUN_MIN_REPEATS, int(rs["repeats"]) // MODEL_RUN_REPEATS_DIVISOR)


def decode_steps_per_generation(decode_steps: int, repeats: int) -> int:
    """`time_fast_steps`' decode steps timed per generation: its routing covers prompt + these tokens."""
    return max(1, -(-decode_steps // max(repeats, 1)))


def time_fast_steps(
    model, *, make_loop, prompt_tokens: int, decode_steps: int, repeats: int, warmup: int, vocab_size: int,
    seed: int = 0, cpu_log: list | None = None, timed_start=None, publish_lag_log: list | None = None,
    warmup_log: list | None = None,
) -> tuple[Timing, Timing]:  # fmt: skip
    """(prefill, decode) of an offloaded model (`moecache.offload`) in moecache's fast decode loop, run
    as `moecache validate validate.loop=fast` runs a request: `make_loop(model, max_cache_len, forced)`
    is validate's `FastLoop` (`FastDecoder(model, forced=...)`, split at the host
    points, CUDA graphs on CUDA, tokens stamped by a streamer; its `generate(prompt_ids, new_tokens)`
    gives `ttft_s`, `gaps_s` and `warmup_gaps`), passed in by the stage, which sits above validation.
    The time to the first token over `repeats` generations from a prompt of `prompt_tokens` tokens
    (`warmup` generations untimed first), and the gaps between later tokens, the decoder's warm-up gaps
    left out (`time_model_steps`' measurements, in the fast loop). The fast loop decodes forced
    (validate's fast runs do): the routing is random (`random_forcing`), every token of every layer K
    distinct experts, as the operator's rows are timed. `cpu_log`: a list that receives the timed
    generations' CPU-path calls, (tokens, entries, ns, uses: each expert's token count) each
    (`FastDecoder.log_cpu_calls`); `publish_lag_log`: a list that receives the timed generations' publish
    lags in ns (`FastDecoder.log_publish_lags`); `warmup_log`: a list that receives the decoder's warm-up
    gaps in us (its first decode steps: eager, then the capture; in the first, untimed, generation);
    `timed_start`: called once, before the first timed generation (its caller's counters start there)."""
    per_run = decode_steps_per_generation(decode_steps, repeats)
    gen = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(0, vocab_size, (prompt_tokens,), generator=gen).tolist())
    session = model.moecache
    forced = random_forcing(session.manager.shape, prompt_tokens, prompt_tokens + per_run, seed)
    loop = make_loop(model, prompt_tokens + per_run + 1, forced)
    prefill, decode = [], []
    try:
        for n in range(warmup + repeats):
            session.begin_request()
            forced.start_request("calibrate")
            if cpu_log is not None and n == warmup:
                loop.decoder.log_cpu_calls(cpu_log)
            if publish_lag_log is not None and n == warmup:
                loop.decoder.log_publish_lags(publish_lag_log)
            if timed_start is not None and n == warmup:
                timed_start()
            got = loop.generate(prompt, per_run + 1)
            if warmup_log is not None:
                warmup_log += [gap * 1e6 for gap in got.gaps_s[: got.warmup_gaps]]
            if n >= warmup:
                prefill.append(got.ttft_s * 1e6)
                decode += [gap * 1e6 for gap in got.gaps_s[got.warmup_gaps :]]
    finally:
        loop.close()
    return summarize(prefill), summarize(decode)


@torch.inference_mode()
def time_model_steps(
    model,
    *,
    prompt_tokens: int,
    decode_steps: int,
    repeats: int,
    warmup: int,
    vocab_size: int,
    step=transformers_generate,
    seed: int = 0,
    spent_s: list[float] | None = None,
) -> tuple[Timing, Timing]:
    """(prefill, decode): host wall time from the call to the first token's logits, over `repeats`
    generations from a prompt of `prompt_tokens` tokens, and between consecutive tokens' logits over the
    `decode_steps` decode steps of those generations (`warmup` generations untimed first). `step(model,
    prompt_1T, new_tokens, stamp)` is the decode loop (`transformers_generate`, or a faster one): this is
    how `moecache validate` times a run, so the loop's own per-token work counts as it does there.
    `spent_s`: the `ZeroExperts` work's time (zero_experts), subtracted from every stamp."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    prompt_1T = torch.randint(0, vocab_size, (1, prompt_tokens), generator=gen).to(device)
    per_run = decode_steps_per_generation(decode_steps, repeats)
    prefill, decode = [], []
    for n in range(warmup + repeats):
        stamp = (
            TokenStamps(device.type == "cuda")
            if spent_s is None
            else _StampsLess(device.type == "cuda", spent_s)
        )
        if spent_s is not None:
            spent_s[0] = 0.0
        start = time.perf_counter()
        step(model, prompt_1T, per_run + 1, stamp)
        if n >= warmup:
            prefill.append((stamp.times[0] - start) * 1e6)
            decode += [(b - a) * 1e6 for a, b in zip(stamp.times, stamp.times[1:], strict=False)]
    return summarize(prefill), summarize(decode)
