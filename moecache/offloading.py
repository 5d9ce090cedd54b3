"""`moecache.offload`: a Hugging Face MoE model whose routed experts live in host memory, a bounded set of
them cached on the compute device, run by the runtime (docs/runtime.md, "Using it").

    model = moecache.offload("/ckpt/Qwen3.6-35B-A3B", capacity="25%", policy="lru")
    model.generate(input_ids, max_new_tokens=64)       # as usual
    model.moecache.stats()                              # hit rate, copies, bytes, fallbacks, residents
    model.moecache.reset()
    model.moecache.reconfigure(capacity="100%", policy="static_cold")   # a new cache, the same host store

What happens: every sparse MoE block's `.experts` is replaced by an `OffloadedExperts` module
(moecache/runtime/experts_module.py) with the same call signature; the router, the shared expert and
everything else stay the model's and go to the compute device (on CUDA the routers' `torch.topk` runs
as one Triton launch where that changes no output: moecache/runtime/router_topk.py). From a checkpoint path the model is
streamed (moecache/models/streaming.py): every tensor read once, the routed experts straight into the
pinned host store and the rest straight onto the compute device, after the memory each needs is checked
(moecache/models/memory_fit.py; `capacity="auto"` sizes the pool to the free device memory after the rest
of the model and `headroom`). From a model already in memory the experts are copied into the store, then
dropped.

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
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moecache.capacity import capacity_spec, parse_capacity
from moecache.errors import MoecacheError
from moecache.runtime.decode_stream import check_share
from moecache.runtime.streamed_misses import DEFAULT_CHUNK as STREAM_CHUNK
from moecache.runtime.streamed_misses import check_settings as check_stream_settings
from moecache.runtime.streamed_misses import resolve_min_tokens

DEFAULT_POLICY = "lfu"  # moecache simulate's default (moecache/stages/simulate.py)
SWIGLU_ACTS = ("silu", "swish")  # the activation the slot-pool operator and the CPU path compute


class OffloadSession:
    """`model.moecache`: the offloaded model's runtime state and its statistics. `reconfigure` replaces
    it (a new cache on the same host store); a replaced session refuses every call in one line."""

    def __init__(self, manager, runtime, capacity: int, architecture: dict, model: nn.Module | None = None):
        self.manager = manager
        self.runtime = runtime
        self.capacity = capacity
        self.architecture = architecture
        self._model = weakref.ref(model) if model is not None else None  # no cycle through model.moecache
        self._baseline = dataclasses.replace(manager.stats)
        self._counters_base = runtime.counters.copy()
        self._replaced = False
        # the routers' top-k through moecache's kernel (moecache/runtime/router_topk.py; CUDA only): a
        # RouterTopk, or None where not installed
        self.router_topk = None

    def stats(self) -> dict:
        """Counters since `offload` or the last `reset`. An access is one distinct expert of one layer
        visit (the simulator's unit); `hits` ran from the slot pool, `misses` on the CPU. `copies` and
        `copy_bytes` count the copies the policy asked for (a static policy's initial residents are
        loaded before the counters start); `fallback_entries` the (token, k) entries computed on the
        CPU, `streamed_entries` those run on the device from staging slots (`stream_min_tokens`), of
        `streamed_experts` copies; `residents_per_layer` the experts each layer's published mapping holds now."""
        self._check_live("stats")
        now, base = self.manager.stats, self._baseline
        delta = {f.name: getattr(now, f.name) - getattr(base, f.name) for f in dataclasses.fields(now)}
        accesses = delta["hits"] + delta["misses"]
        counters = self.runtime.counters.since(self._counters_base)
        return {
            "policy": self.manager.policy.label(),
            "on_miss": self.manager.on_miss,
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
            "waited_copies": delta["waited_copies"],
            "fallback_entries": counters.cpu_entries,
            "gpu_entries": counters.gpu_entries,
            "streamed_experts": counters.streamed_experts,
            "streamed_entries": counters.streamed_entries,
            "residents_per_layer": (self.manager.published_LE >= 0).sum(axis=1).astype(np.int64).tolist(),
        }

    def reset(self) -> None:
        """Counters and residency back to the start (the manager's `reset`), statistics from zero."""
        self._check_live("reset")
        self.manager.reset()
        self._baseline = dataclasses.replace(self.manager.stats)
        self._counters_base = self.runtime.counters.copy()

    def begin_request(self) -> None:
        """The next forward passes belong to a new request (policies with per-request state read it)."""
        self._check_live("begin_request")
        self.manager.begin_request()

    def reconfigure(
        self,
        *,
        capacity,
        policy: str | None = None,
        params: dict | None = None,
        decision: str | Path | None = None,
        on_miss: str = "cpu",
        cost_profile: str | Path | None = None,
    ) -> OffloadSession:
        """A new cache for the same offloaded model: a new CacheManager (policy + params, or a
        decision.json's `selected`; default lfu) with a new slot pool of `capacity` (the one syntax), on
        the SAME host store and CPU executor (nothing is copied from the model again), `on_miss` "cpu",
        "wait" or "split" (moecache/runtime/manager.py; "split" weighs copies against the CPU with
        `cost_profile`, a profile of moecache calibrate); the runtime's decode_stream_share carries over with
        on_miss "cpu" and is off with the others. Every argument is checked first (one line, the session
        untouched); then this session's manager and slot pool are released (gc, and the CUDA caching
        allocator's free blocks returned) before the new pool is allocated, every `OffloadedExperts` of
        the model is pointed at the new runtime, and `model.moecache` is the returned new session, its
        statistics from zero. This session is dead afterwards (every call refused in one line).

        The old pool's memory is returned only once nothing else holds the old manager: a FastDecoder
        built on the old session (its taps, its captured graphs) does; such a decoder refuses to decode
        after a reconfigure (one line): drop it and build a new FastDecoder."""
        from moecache.runtime.device import CudaDevice, StandinDevice
        from moecache.runtime.experts_module import ExpertsRuntime, OffloadedExperts
        from moecache.runtime.manager import ON_MISS, CacheManager

        who = "moecache reconfigure"
        self._check_live("reconfigure")
        model = self._model() if self._model is not None else None
        if model is None or getattr(model, "moecache", None) is not self:
            raise MoecacheError(f"{who}: this session is not the model.moecache of a live offloaded model")
        store, old = self.manager.store, self.manager
        capacity_spec(capacity, key="capacity")
        slots = parse_capacity(
            capacity, key="capacity", num_keys=store.num_layers * store.num_experts,
            expert_bytes=store.expert_bytes,
        )  # fmt: skip
        made = _policy_of(policy, params, decision, who)
        if on_miss not in ON_MISS:
            raise MoecacheError(f"{who}: on_miss={on_miss!r}: expected one of {list(ON_MISS)}")
        cost = runtime_cost(cost_profile, on_miss, made, store.expert_bytes, who)
        modules = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
        cpu, top_k, old_device = self.runtime.cpu, old.shape.top_k, old.device
        streaming, decode_share = self.runtime.stream_settings, self.runtime.decode_share
        is_cuda = old_device.is_cuda
        new_device = CudaDevice(old_device.torch_device.index) if is_cuda else StandinDevice(old_device.mode)
        # Release the old cache before the new pool exists (at 100% two pools may not fit).
        old.commit()
        old_device.synchronize()
        for module in modules:
            module._runtime = None
        self.manager = self.runtime = None
        self._replaced = True
        del old, old_device
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
        manager = CacheManager(store, new_device, slots, made, top_k=top_k, on_miss=on_miss, cost=cost)
        runtime = ExpertsRuntime(manager, cpu)
        runtime.stream_misses(*streaming)
        if on_miss == "cpu":  # the decode share needs the visit deferred (on_miss="cpu"); else off
            runtime.stream_decode(decode_share)
        for module in modules:
            module._runtime = runtime
        session = OffloadSession(manager, runtime, slots, self.architecture, model=model)
        session.router_topk = self.router_topk
        model.moecache = session
        return session

    def save_state(self, path: str | Path) -> Path:
        """Write the cache manager's state (policy state and residents) to `path` atomically, for a later
        run's `init=` (moecache/runtime/manager_state.py); returns the path."""
        from moecache.runtime.manager_state import save_state

        self._check_live("save_state")
        return save_state(self.manager, path)

    def _check_live(self, what: str) -> None:
        if self._replaced:
            raise MoecacheError(
                f"moecache session: {what}() on a session replaced by reconfigure(); use model.moecache"
            )


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
    on_miss: str = "cpu",
    cost_profile: str | Path | None = None,
    headroom: str = "3GiB",
    init: str | Path | None = None,
    router_kernel: bool = True,
    stream_min_tokens: int | str = "auto",
    stream_chunk: int = STREAM_CHUNK,
    decode_stream_share: float = 0.0,
) -> nn.Module:
    """The model, offloaded (module docstring); `model_or_path` is a loaded Hugging Face MoE model or a
    local checkpoint folder (streamed through moecache/models/loading.py, `dtype` as model.dtype there;
    `output_root` holds its revision cache, default $MOECACHE_OUTPUT_ROOT or outputs; `headroom` the
    device memory kept free for the KV cache and activations; `init` a saved manager state or a routing
    trace the cache starts from, moecache/runtime/manager_state.py). `on_miss`: "cpu"
    (a miss runs on the CPU while its copy flies), "wait" (the visit waits for its admissions' copies)
    or "split" (the misses whose copies land before the CPU would finish wait for them, the others run on
    the CPU, weighed with `cost_profile`, a profile of moecache calibrate; moecache/runtime/manager.py).
    `router_kernel`: on CUDA, the routers' top-k through moecache's one-launch kernel where a probe shows
    their outputs unchanged (moecache/runtime/router_topk.py; `model.moecache.router_topk` says where).
    `stream_min_tokens` (0: off; "auto": 32 with the slots on CUDA, else off): a visit's missed expert that at
    least that many of its entries use runs on the device, copied through staging pools of `stream_chunk`
    slots (two; taken from the headroom), instead of on the CPU (moecache/runtime/streamed_misses.py: a
    prompt's visits). `decode_stream_share` (0: off): the share of each fast-loop decode visit's missed
    entries (rounded down, one left at least) copied to the device and run there while the CPU runs the
    rest; with on_miss="cpu" (moecache/runtime/decode_stream.py)."""
    check_stream_settings(stream_min_tokens, stream_chunk)  # before anything is loaded
    check_share(decode_stream_share, on_miss)
    if isinstance(model_or_path, str | Path):
        from moecache.models.loading import OffloadRequest, load_model
        from moecache.models.memory_fit import AUTO, headroom_bytes

        if capacity != AUTO:
            capacity_spec(capacity, key="capacity")  # the syntax, before anything is loaded
        from moecache.artifacts import default_output_root
        from moecache.runtime.manager import ON_MISS

        made = _policy_of(policy, params, decision, "moecache.offload")
        if on_miss not in ON_MISS:
            raise MoecacheError(f"moecache.offload: on_miss={on_miss!r}: expected one of {list(ON_MISS)}")
        runtime_cost(cost_profile, on_miss, made, 1, "moecache.offload")
        target = _target_device(device)
        request = OffloadRequest(capacity, headroom_bytes(headroom), _pin_mode(target))
        root = output_root or default_output_root()
        loaded = load_model({"path": str(model_or_path), "dtype": dtype}, root, str(target), offload=request)
        return offload_model(
            loaded.model, capacity=loaded.fit.slots, policy=policy, params=params, decision=decision,
            device=str(target), store=loaded.store, standin_mode=standin_mode,
            cpu_backend=cpu_backend, cpu_threads=cpu_threads, on_miss=on_miss, cost_profile=cost_profile,
            init=init, router_kernel=router_kernel, stream_min_tokens=stream_min_tokens,
            stream_chunk=stream_chunk, decode_stream_share=decode_stream_share,
        )  # fmt: skip
    capacity_spec(capacity, key="capacity")
    if not isinstance(model_or_path, nn.Module):
        raise MoecacheError(
            f"moecache.offload: expected a Hugging Face model or a checkpoint folder, got "
            f"{type(model_or_path).__name__}"
        )
    return offload_model(
        model_or_path, capacity=capacity, policy=policy, params=params, decision=decision, device=device,
        standin_mode=standin_mode, cpu_backend=cpu_backend, cpu_threads=cpu_threads, on_miss=on_miss,
        cost_profile=cost_profile, init=init, router_kernel=router_kernel, stream_min_tokens=stream_min_tokens,
        stream_chunk=stream_chunk, decode_stream_share=decode_stream_share,
    )  # fmt: skip


def offload_model(
    model: nn.Module,
    *,
    capacity,
    policy: str | None = None,
    params: dict | None = None,
    decision: str | Path | None = None,
    device: str = "auto",
    store=None,
    standin_mode: str = "before_visit",
    cpu_backend: str = "auto",
    cpu_threads: int | None = None,
    on_miss: str = "cpu",
    cost_profile: str | Path | None = None,
    init: str | Path | None = None,
    router_kernel: bool = True,
    stream_min_tokens: int | str = "auto",
    stream_chunk: int = STREAM_CHUNK,
    decode_stream_share: float = 0.0,
) -> nn.Module:
    """`offload` of a model in memory; with `store` (an ExpertStore that `load_model(..., offload=...)`
    filled, the model's routed experts left on the meta device) that store is used and the model's
    expert modules are dropped."""
    from moecache.models.adapter import adapter_for
    from moecache.runtime.cpu_experts import CpuExperts
    from moecache.runtime.device import CudaDevice, StandinDevice
    from moecache.runtime.experts_module import ExpertsRuntime, OffloadedExperts
    from moecache.runtime.manager import ON_MISS, CacheManager

    capacity_spec(capacity, key="capacity")
    if getattr(model, "moecache", None) is not None:
        raise MoecacheError("moecache.offload: this model is already offloaded (it has model.moecache)")
    made = _policy_of(policy, params, decision, "moecache.offload")
    if on_miss not in ON_MISS:
        raise MoecacheError(f"moecache.offload: on_miss={on_miss!r}: expected one of {list(ON_MISS)}")
    check_stream_settings(stream_min_tokens, stream_chunk)
    check_share(decode_stream_share, on_miss)
    target = _target_device(device)
    runtime_device = CudaDevice(target.index) if target.type == "cuda" else StandinDevice(standin_mode)
    _check_activation(model)

    adapter = adapter_for(model)
    architecture = adapter.describe()
    blocks = [layer.block for layer in adapter.moe_layers()]
    routers = {layer_id: layer.router for layer_id, layer in enumerate(adapter.moe_layers())}
    top_k = adapter.top_k
    slots = parse_capacity(
        capacity, key="capacity", num_keys=adapter.num_layers * adapter.num_experts,
        expert_bytes=adapter.expert_bytes,
    )  # fmt: skip
    cost = runtime_cost(cost_profile, on_miss, made, adapter.expert_bytes, "moecache.offload")
    if store is not None:  # streamed for this call: the experts are in the store, the model's are meta
        _check_store(store, architecture)
        del adapter
        _drop_experts(blocks)
        manager = CacheManager(store, runtime_device, slots, made, top_k=top_k, on_miss=on_miss, cost=cost)
        cpu = CpuExperts(store.w13_GIH, store.w2_GHI, threads=cpu_threads, backend=cpu_backend)
    else:  # the caller's model: nothing of it changes until the store and the manager exist
        store = _store_from_model(adapter, target)
        manager = CacheManager(store, runtime_device, slots, made, top_k=top_k, on_miss=on_miss, cost=cost)
        cpu = CpuExperts(store.w13_GIH, store.w2_GHI, threads=cpu_threads, backend=cpu_backend)
        del adapter
        _drop_experts(blocks)
    model.to(target)  # no expert weights left in the model: only the rest goes to the device
    router_topk = None
    if target.type == "cuda":
        torch.cuda.empty_cache()
        if router_kernel:
            from moecache.runtime.router_topk import install_router_topk

            router_topk = install_router_topk(routers, dtype=model.dtype)
    if init is not None:
        from moecache.runtime.manager_state import init_manager

        init_manager(manager, init)
    runtime = ExpertsRuntime(manager, cpu)
    runtime.stream_misses(
        resolve_min_tokens(stream_min_tokens, isinstance(runtime_device, CudaDevice)), stream_chunk
    )
    runtime.stream_decode(decode_stream_share)
    for layer_id, block in enumerate(blocks):
        block.experts = OffloadedExperts(layer_id, runtime)
    model.moecache = OffloadSession(manager, runtime, slots, architecture, model=model)
    model.moecache.router_topk = router_topk
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
    from moecache.models.expert_store import ExpertStore

    E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
    store = ExpertStore.allocate(adapter.num_layers, E, H, inter, adapter.dtype)
    for layer_id in range(adapter.num_layers):
        gate_up_EIH, down_EHI = adapter.expert_weights(layer_id)
        rows = slice(layer_id * E, (layer_id + 1) * E)
        store.w13_GIH[rows].copy_(gate_up_EIH)
        store.w2_GHI[rows].copy_(down_EHI)
    store.pin(_pin_mode(target))
    return store


def _check_store(store, architecture: dict) -> None:
    shape = (store.num_layers, store.num_experts, store.hidden_size, store.intermediate_size)
    want = tuple(
        architecture[k] for k in ("num_layers", "num_experts", "hidden_size", "moe_intermediate_size")
    )
    if shape != want:
        raise MoecacheError(
            f"moecache.offload: the expert store is (layers, experts, hidden, inter) = {shape}, the model has {want}"
        )


def _drop_experts(blocks: list[nn.Module]) -> None:
    """Remove the dense experts modules (their parameters are freed once nothing else holds them)."""
    for block in blocks:
        del block.experts
    gc.collect()


def _policy_of(policy, params, decision, who: str):
    """The online placement policy (a sim Policy) of `policy` + `params`, or of a decision.json's
    `selected` (`PolicySpec.selected_in`, as the manager's `from_decision`); default lfu. Checked before
    anything is built or freed."""
    from moecache.sim.policy import make_policy
    from moecache.sim.policy_spec import PolicySpec

    if policy is not None and decision is not None:
        raise MoecacheError(f"{who}: give policy= or decision=, not both")
    if decision is not None:
        if params:
            raise MoecacheError(f"{who}: params= goes with policy=, not with decision=")
        spec = PolicySpec.selected_in(decision)
        name, params = spec.name, spec.params
    else:
        if policy is not None and not isinstance(policy, str):
            raise MoecacheError(f"{who}: policy must be a policy name (conf/policy/), got {policy!r}")
        name = policy or DEFAULT_POLICY
    if params is not None and not isinstance(params, dict):
        raise MoecacheError(f"{who}: params={params!r}: expected a mapping of the policy's parameters")
    made = make_policy(name, **dict(params or {}))
    if made.offline:
        raise MoecacheError(
            f"policy {name} is offline (it reads the whole future trace) and exists only in the simulator; "
            "the runtime takes an online policy (e.g. lfu, lru, static_cold)"
        )
    return made


COST_MAX_TOKENS = 4096  # the runtime's cost tables' length in tokens (longer calls: their last entry)


def cost_readers(on_miss: str, policy, on_miss_key: str = "on_miss") -> list[str]:
    """What reads a cost profile in the runtime, named for an error line (empty: nothing does):
    on_miss="split" weighs copies against the CPU, and a policy that weighs costs (`weighs_costs`, a
    Policy's or a PolicySpec's: impact) reads them whatever its on_miss. The one rule the callers that
    take a profile (offload, reconfigure, validate, generate) check against."""
    readers = [f"{on_miss_key}=split"] if on_miss == "split" else []
    return readers + ([f"policy {policy.name}"] if policy.weighs_costs else [])


def runtime_cost(cost_profile, on_miss: str, policy, expert_bytes: int, who: str):
    """The cost model the runtime weighs with (None where nothing reads one, `cost_readers`); the profile
    (a path, or calibrate's own in memory, a CostProfile) tabulated for this model's expert. A reader
    without a profile is refused, and a profile that nothing would read too: it would change nothing,
    which is not what its caller meant."""
    readers = cost_readers(on_miss, policy)
    if cost_profile is None:
        if on_miss == "split":
            raise MoecacheError(
                f'{who}: on_miss="split" weighs copies against the CPU: give cost_profile= (a cost_profile.json'
                " of moecache calibrate on this machine)"
            )
        if readers:
            raise MoecacheError(
                f"{who}: {readers[0]} weighs measured costs (CPU, GPU, copy time): give cost_profile= (a"
                " cost_profile.json of moecache calibrate on this machine)"
            )
        return None
    if not readers:
        raise MoecacheError(
            f"{who}: cost_profile={cost_profile} is read only with on_miss='split' or a policy that weighs"
            f" costs (impact), not on_miss={on_miss!r} with {policy.name}"
        )
    from moecache.cost_profile import CostProfile
    from moecache.sim.cost_model import CostModel

    profile = cost_profile if isinstance(cost_profile, CostProfile) else CostProfile.load(cost_profile)
    return CostModel.from_profile(profile, int(expert_bytes), COST_MAX_TOKENS)
