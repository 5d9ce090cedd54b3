"""Refuse early what cannot fit, and size `capacity=auto`, before a byte of the checkpoint is read.

Host memory holds the expert store (every routed expert once, pinned) and, when the model computes on
the CPU, the rest of the model too. The compute device holds the rest of the model (the non-expert
weights), the slot pool (slots x expert bytes) and a stated headroom for the KV cache, activations and
CUDA graphs (`runtime.headroom`). `fit_offload` compares these with what the machine has free now
(`MemAvailable` of /proc/meminfo; `torch.cuda.mem_get_info`), and `fit_dense` does the same for the
unmodified model (every weight on the device). A shortfall is one line saying how much is needed, how
much there is and which setting changes it.

`capacity=auto`: the most slots that fit the device's free memory after the rest of the model and the
headroom (on the CPU stand-in: the host's, after the store and the model), at most every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecache.capacity import capacity_spec, parse_capacity
from moecache.errors import MoecacheError

AUTO = "auto"
DEFAULT_HEADROOM = "3GiB"
HOST_RESERVE = 1 << 30  # host memory left to the process itself (interpreter, libraries, buffers)


def gib(nbytes: int | float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_free(device: torch.device) -> int | None:
    """Free memory of a CUDA device in bytes (None for the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def headroom_bytes(value) -> int:
    """`runtime.headroom` in bytes: a memory size such as "3GiB"."""
    spec = capacity_spec(value, key="runtime.headroom")
    if spec.kind != "bytes":
        raise MoecacheError(f"runtime.headroom={value}: expected a memory size such as 3GiB")
    return int(spec.amount)


@dataclass(frozen=True)
class OffloadFit:
    """What an offloaded load will hold where, checked against the machine."""

    slots: int
    capacity: str  # as asked ("auto" or the user's text)
    store_bytes: int
    dense_bytes: int  # the non-expert weights
    slot_bytes: int
    headroom: int
    host_available: int | None
    device_free: int | None

    def describe(self) -> str:
        where = "device" if self.device_free is not None else "host (CPU stand-in)"
        free = self.device_free if self.device_free is not None else self.host_available
        shown = f"{gib(free)} free" if free is not None else "free memory unknown"
        return (
            f"capacity={self.capacity}: {self.slots} slots ({gib(self.slot_bytes)}) + {gib(self.dense_bytes)} of "
            f"non-expert weights + {gib(self.headroom)} headroom on the {where} ({shown}); expert store "
            f"{gib(self.store_bytes)} in host memory"
        )


def _check_host(need: int, what: str, knob: str) -> int | None:
    available = host_available()
    if available is not None and need + HOST_RESERVE > available:
        raise MoecacheError(
            f"{what} needs {gib(need)} of host memory (+ {gib(HOST_RESERVE)} for the process); this machine "
            f"has {gib(available)} available: {knob}"
        )
    return available


def fit_offload(
    capacity, *, num_keys: int, expert_bytes: int, dense_bytes: int, device: torch.device, headroom: int
) -> OffloadFit:
    """Check the offloaded model against host and device memory; resolve `capacity` (module docstring)."""
    store_bytes = num_keys * expert_bytes
    on_cpu = device.type == "cpu"
    host_need = store_bytes + (dense_bytes if on_cpu else 0)
    available = _check_host(
        host_need,
        "the expert store" + (" and the model's other weights" if on_cpu else ""),
        "every expert's canonical copy lives in host memory; model.dtype=bfloat16 halves a float32 store, "
        "or run on a machine with more memory",
    )
    free = device_free(device)
    if on_cpu and available is not None:  # the stand-in's slot pool is host memory too
        room = available - HOST_RESERVE - host_need - headroom
    elif free is not None:
        room = free - dense_bytes - headroom
        if room < 0:
            raise MoecacheError(
                f"the model's non-expert weights ({gib(dense_bytes)}) + runtime.headroom ({gib(headroom)}) "
                f"need {gib(dense_bytes + headroom)} on {device}, which has {gib(free)} free"
            )
    else:
        room = None
    if capacity == AUTO:
        if room is None:
            raise MoecacheError(
                "capacity=auto: the free memory of this machine is unknown; give capacity=25% or a budget"
            )
        slots = max(0, min(num_keys, room // expert_bytes))
    else:
        capacity_spec(capacity, key="capacity")
        slots = parse_capacity(capacity, key="capacity", num_keys=num_keys, expert_bytes=expert_bytes)
        if room is not None and slots * expert_bytes > room:
            fits = max(0, room // expert_bytes)
            raise MoecacheError(
                f"capacity={capacity}: {slots} slots need {gib(slots * expert_bytes)}, but {device} has room for "
                f"{fits} ({gib(max(0, room))} after {gib(dense_bytes)} of non-expert weights and runtime.headroom "
                f"{gib(headroom)}): give capacity={fits} or capacity=auto"
            )
    return OffloadFit(
        slots=int(slots), capacity=str(capacity), store_bytes=store_bytes, dense_bytes=dense_bytes,
        slot_bytes=int(slots) * expert_bytes, headroom=headroom, host_available=available, device_free=free,
    )  # fmt: skip


def fit_dense(total_bytes: int, device: torch.device) -> None:
    """Check the unmodified model (every weight on `device`) against its memory."""
    if device.type == "cpu":
        _check_host(
            total_bytes, "the model", "run it offloaded (moecache generate with runtime.enabled=true)"
        )
        return
    free = device_free(device)
    if free is not None and total_bytes > free:
        raise MoecacheError(
            f"the model needs {gib(total_bytes)} on {device}, which has {gib(free)} free: run it offloaded "
            "(runtime.enabled=true with a capacity)"
        )
