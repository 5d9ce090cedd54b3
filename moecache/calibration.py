"""Timing primitives for the cost profile: one SwiGLU expert on the CPU and on CUDA, and host-to-device copies.

Each function measures one thing and returns a `Timing` (median and p10/p90 over `repeats` calls after
`warmup` untimed ones). Expert weights rotate over a pool of synthetic experts whose bytes exceed the cache
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

import torch
from moecache_kernels import expert_forward

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct memory for `num_experts` experts: gate_up (P, 2I, H) and down (P, H, I).

    One random expert is drawn and copied into every slot: the values do not change the timing, the
    distinct memory does, and a copy fills gigabytes much faster than a random generator.
    """
    gen = torch.Generator().manual_seed(seed)
    h, i = shape.hidden_size, shape.moe_intermediate_size
    gate_up_2IH = (torch.randn(2 * i, h, generator=gen) * h**-0.5).to(device=device, dtype=dtype)
    down_HI = (torch.randn(h, i, generator=gen) * i**-0.5).to(device=device, dtype=dtype)
    gate_up_P2IH = gate_up_2IH.expand(num_experts, 2 * i, h).clone()
    down_PHI = down_HI.expand(num_experts, h, i).clone()
    return gate_up_P2IH, down_PHI


def _input(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)


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
    samples_us = []
    for n in range(warmup + repeats):
        e = (start + n) % num
        t0 = time.perf_counter_ns()
        expert_forward(x_MH, gate_up_P2IH[e], down_PHI[e])
        elapsed_us = (time.perf_counter_ns() - t0) / 1e3
        if n >= warmup:
            samples_us.append(elapsed_us)
    return summarize(samples_us)


@torch.inference_mode()
def time_cuda_expert(
    pool: tuple[torch.Tensor, torch.Tensor], tokens: int, repeats: int, warmup: int, start: int = 0
) -> Timing:
    """CUDA-event time of one expert call (its launches included) on M=`tokens` tokens, rotating over a GPU pool."""
    gate_up_P2IH, down_PHI = pool
    device = gate_up_P2IH.device
    num = gate_up_P2IH.shape[0]
    x_MH = _input(tokens, gate_up_P2IH.shape[2], gate_up_P2IH.dtype, device)
    with torch.cuda.device(device):
        for n in range(warmup):
            e = (start + n) % num
            expert_forward(x_MH, gate_up_P2IH[e], down_PHI[e])
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for n, (begin, end) in enumerate(events):
            e = (start + warmup + n) % num
            begin.record()
            expert_forward(x_MH, gate_up_P2IH[e], down_PHI[e])
            end.record()
        torch.cuda.synchronize(device)
    return summarize([begin.elapsed_time(end) * 1e3 for begin, end in events])


def time_h2d_copy(nbytes: int, pinned: bool, repeats: int, warmup: int, device: torch.device) -> Timing:
    """CUDA-event time of one host-to-device copy of `nbytes` from a pinned or a pageable host buffer.

    The copy is issued with non_blocking=True on the current stream (from pageable memory the driver
    stages it through its own pinned buffer, as a real pageable copy does).
    """
    host_B = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host_B.fill_(1)  # touch every page before timing
    dev_B = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        for _ in range(warmup):
            dev_B.copy_(host_B, non_blocking=True)
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for begin, end in events:
            begin.record()
            dev_B.copy_(host_B, non_blocking=True)
            end.record()
        torch.cuda.synchronize(device)
    return summarize([begin.elapsed_time(end) * 1e3 for begin, end in events])


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
