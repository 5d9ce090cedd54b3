"""`moecache.offload`: a Hugging Face MoE model whose routed experts live in host memory, a bounded set of
them cached on the compute device, run by the runtime (docs/runtime.md, "Using it").

    model = moecache.offload("/ckpt/Qwen3.6-35B-A3B", capacity="25%", policy="lru")
    model.generate(input_ids, max_new_tokens=64)       # as usual
    model.moecache.stats()                              # hit rate, copies, bytes, fallbacks, residents
    model.moecache.reset()

What happens: every sparse MoE block's `.experts` is replaced by an `OffloadedExperts` module
(moecache/runtime/experts_module.py) with the same call signature; the router, the shared expert and
everything else stay the model's and go to the compute device. The dense expert parameters are freed:
from a checkpoint path they are dropped before the store is filled straight from the safetensors
(`ExpertStore.from_checkpoint`), so they never reach the device; from a model already in memory they are
copied into the store, then dropped.

`capacity` takes the one capacity syntax (moecache/capacity.py): a slot count, `"25%"` of all experts or a
memory budget `"12GiB"`. `policy` + `params` name an online placement policy (conf/policy/), or
`decision` a decide stage's decision.json (its `selected` policy); the default is lfu, as in simulate.
`device`: "auto", "cpu" or "cuda[:N]", where the model computes. On CUDA the slot pool is device memory
and the hits run through `moecache_kernels.slot_moe`; on the CPU the pool is the runtime's stand-in
device (`standin_mode`: "before_visit", every copy completes before the next layer visit, as in the
simulator's instant replay; or "eager") and the hits run through the operator's torch reference.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moecache.capacity import capacity_spec, parse_capacity
from moecache.errors import MoecacheError

DEFAULT_POLICY = "lfu"  # moecache simulate's default (moecache/stages/simulate.py)
SWIGLU_ACTS = ("silu", "swish")  # the activation the slot-pool operator and the CPU path compute


class OffloadSession:
    """`model.moecache`: the offloaded model's runtime state and its statistics."""

    def __init__(self, manager, runtime, capacity: int, architecture: dict):
        self.manager = manager
        self.runtime = runtime
        self.capacity = capacity
        self.architecture = architecture
        self._baseline = dataclasses.replace(manager.stats)

    def stats(self) -> dict:
        """Counters since `offload` or the last `reset`. An access is one distinct expert of one layer
        visit (the simulator's unit); `hits` ran from the slot pool, `misses` on the CPU. `copies` and
        `copy_bytes` count the copies the policy asked for (a static policy's initial residents are
        loaded before the counters start); `fallback_entries` the (token, k) entries computed on the
        CPU; `residents_per_layer` the experts each layer's published mapping holds now."""
        now, base = self.manager.stats, self._baseline
        delta = {f.name: getattr(now, f.name) - getattr(base, f.name) for f in dataclasses.fields(now)}
        accesses = delta["hits"] + delta["misses"]
        exec_stats = self.runtime.stats
        return {
            "policy": self.manager.policy.label(),
            "capacity": self.capacity,
            "num_experts_total": self.manager.shape.num_keys,
            "visits": delta["visits"],
            "accesses": accesses,
            "hits": delta["hits"],
            "misses": delta["misses"],
            "hit_rate": delta["hits"] / accesses if accesses else None,
            "admissions": delta["admissions"],
            "evictions": delta["evictions"],
            "copies": delta["copies"],
            "copy_bytes": delta["copies"] * self.manager.store.expert_bytes,
            "deferred_copies": delta["deferred_copies"],
            "wasted_copies": delta["wasted_copies"],
            "fallback_entries": exec_stats.cpu_entries,
            "gpu_entries": exec_stats.gpu_entries,
            "residents_per_layer": (self.manager.published_LE >= 0).sum(axis=1).astype(np.int64).tolist(),
        }

    def reset(self) -> None:
        """Counters and residency back to the start (the manager's `reset`), statistics from zero."""
        self.manager.reset()
        self._baseline = dataclasses.replace(self.manager.stats)
        self.runtime.stats = type(self.runtime.stats)()

    def begin_request(self) -> None:
        """The next forward passes belong to a new request (policies with per-request state read it)."""
        self.manager.begin_request()


def offload(
    model_or_path,
    *,
    capacity,
    policy: str | None = None,
    params: dict | None = None,
    decision: str | Path | None = None,
    device: str = "auto",
    dtype: str = "auto",
    standin_mode: str = "before_visit",
    cpu_backend: str = "auto",
    cpu_threads: int | None = None,
    output_root: str | Path | None = None,
) -> nn.Module:
    """The model, offloaded (module docstring); `model_or_path` is a loaded Hugging Face MoE model or a
    local checkpoint folder (loaded through moecache/models/loading.py, `dtype` as model.dtype there;
    `output_root` holds its revision cache, default $MOECACHE_OUTPUT_ROOT or outputs)."""
    capacity_spec(capacity, key="capacity")  # the syntax, before anything is loaded
    if isinstance(model_or_path, str | Path):
        from moecache.models.loading import load_model

        root = output_root or os.environ.get("MOECACHE_OUTPUT_ROOT", "outputs")
        loaded = load_model({"path": str(model_or_path), "dtype": dtype}, root, "cpu")
        return offload_model(
            loaded.model, capacity=capacity, policy=policy, params=params, decision=decision,
            device=device, checkpoint=loaded.path, standin_mode=standin_mode,
            cpu_backend=cpu_backend, cpu_threads=cpu_threads,
        )  # fmt: skip
    if not isinstance(model_or_path, nn.Module):
        raise MoecacheError(
            f"moecache.offload: expected a Hugging Face model or a checkpoint folder, got "
            f"{type(model_or_path).__name__}"
        )
    return offload_model(
        model_or_path, capacity=capacity, policy=policy, params=params, decision=decision, device=device,
        standin_mode=standin_mode, cpu_backend=cpu_backend, cpu_threads=cpu_threads,
    )  # fmt: skip


def offload_model(
    model: nn.Module,
    *,
    capacity,
    policy: str | None = None,
    params: dict | None = None,
    decision: str | Path | None = None,
    device: str = "auto",
    checkpoint: Path | None = None,
    standin_mode: str = "before_visit",
    cpu_backend: str = "auto",
    cpu_threads: int | None = None,
) -> nn.Module:
    """`offload` of a model in memory; with `checkpoint` (the folder it was loaded from) the store is
    filled from the safetensors after the model's dense experts are dropped."""
    from moecache.models.adapter import adapter_for
    from moecache.runtime.cpu_experts import CpuExperts
    from moecache.runtime.device import CudaDevice, StandinDevice
    from moecache.runtime.experts_module import ExpertsRuntime, OffloadedExperts

    capacity_spec(capacity, key="capacity")
    if getattr(model, "moecache", None) is not None:
        raise MoecacheError("moecache.offload: this model is already offloaded (it has model.moecache)")
    if policy is not None and decision is not None:
        raise MoecacheError("moecache.offload: give policy= or decision=, not both")
    target = _target_device(device)
    runtime_device = CudaDevice(target.index) if target.type == "cuda" else StandinDevice(standin_mode)
    _check_activation(model)

    adapter = adapter_for(model)
    architecture = adapter.describe()
    blocks = [layer.block for layer in adapter.moe_layers()]
    top_k, dtype = adapter.top_k, adapter.dtype
    slots = parse_capacity(
        capacity, key="capacity", num_keys=adapter.num_layers * adapter.num_experts,
        expert_bytes=adapter.expert_bytes,
    )  # fmt: skip
    if checkpoint is not None:  # a model loaded for this call: drop its experts before the store fills
        del adapter
        _drop_experts(blocks)
        store = _checkpoint_store(checkpoint, dtype, architecture, target)
        manager = _manager(store, runtime_device, slots, policy, params, decision, top_k)
        cpu = CpuExperts(store.w13_GIH, store.w2_GHI, threads=cpu_threads, backend=cpu_backend)
    else:  # the caller's model: nothing of it changes until the store and the manager exist
        store = _store_from_model(adapter, target)
        manager = _manager(store, runtime_device, slots, policy, params, decision, top_k)
        cpu = CpuExperts(store.w13_GIH, store.w2_GHI, threads=cpu_threads, backend=cpu_backend)
        del adapter
        _drop_experts(blocks)
    model.to(target)  # no expert weights left in the model: only the rest goes to the device
    if target.type == "cuda":
        torch.cuda.empty_cache()
    runtime = ExpertsRuntime(manager, cpu)
    for layer_id, block in enumerate(blocks):
        block.experts = OffloadedExperts(layer_id, runtime)
    model.moecache = OffloadSession(manager, runtime, slots, architecture)
    return model


# ---------------------------------------------------------------------------------------------- parts


def _target_device(device: str) -> torch.device:
    if device == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MoecacheError(f"device={device!r}: expected auto, cpu or cuda[:N]") from exc
    if target.type not in ("cpu", "cuda"):
        raise MoecacheError(f"device={device!r}: expected auto, cpu or cuda[:N]")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise MoecacheError(f"device={device}: CUDA is not available on this machine")
        target = torch.device("cuda", torch.cuda.current_device() if target.index is None else target.index)
    return target


def _check_activation(model: nn.Module) -> None:
    """The slot-pool operator and the CPU path compute SwiGLU experts: refuse any other activation."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    act = getattr(config, "hidden_act", None)
    if act not in SWIGLU_ACTS:
        raise MoecacheError(
            f"moecache.offload: the model's hidden_act is {act!r}; the runtime computes SwiGLU experts "
            f"({' or '.join(SWIGLU_ACTS)}) only"
        )


def _pin_mode(target: torch.device) -> str:
    """Pinning only matters for copies to a CUDA device; on the CPU stand-in it is skipped."""
    return "auto" if target.type == "cuda" else "off"


def _store_from_model(adapter, target: torch.device):
    """Every expert of a model in memory, copied layer by layer into one host store."""
    from moecache.runtime.expert_store import ExpertStore

    E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
    store = ExpertStore.allocate(adapter.num_layers, E, H, inter, adapter.dtype)
    for layer_id in range(adapter.num_layers):
        gate_up_EIH, down_EHI = adapter.expert_weights(layer_id)
        rows = slice(layer_id * E, (layer_id + 1) * E)
        store.w13_GIH[rows].copy_(gate_up_EIH)
        store.w2_GHI[rows].copy_(down_EHI)
    store.pin(_pin_mode(target))
    return store


def _checkpoint_store(checkpoint: Path, dtype, architecture: dict, target: torch.device):
    from moecache.runtime.expert_store import ExpertStore

    store = ExpertStore.from_checkpoint(checkpoint, dtype=dtype, pin=_pin_mode(target))
    shape = (store.num_layers, store.num_experts, store.hidden_size, store.intermediate_size)
    want = tuple(
        architecture[k] for k in ("num_layers", "num_experts", "hidden_size", "moe_intermediate_size")
    )
    if shape != want:
        raise MoecacheError(
            f"model.path={checkpoint}: the safetensors' experts are (layers, experts, hidden, inter) = "
            f"{shape}, the loaded model has {want}"
        )
    return store


def _drop_experts(blocks: list[nn.Module]) -> None:
    """Remove the dense experts modules (their parameters are freed once nothing else holds them)."""
    for block in blocks:
        del block.experts
    gc.collect()


def _manager(store, runtime_device, slots: int, policy, params, decision, top_k: int):
    from moecache.runtime.manager import CacheManager

    if decision is not None:
        if params:
            raise MoecacheError("moecache.offload: params= goes with policy=, not with decision=")
        return CacheManager.from_decision(decision, store, runtime_device, slots, top_k=top_k)
    if policy is not None and not isinstance(policy, str):
        raise MoecacheError(f"moecache.offload: policy must be a policy name (conf/policy/), got {policy!r}")
    return CacheManager.from_policy(
        store, runtime_device, slots, policy or DEFAULT_POLICY, params, top_k=top_k
    )
