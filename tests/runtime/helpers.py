"""Small builders for the runtime tests: a random expert store, a manager on the CPU stand-in device, a
tiny random model of an adapter's architecture; half a bf16 spacing (the bound of one rounding).

Legend: L layers, E experts, H hidden, I intermediate, T tokens, K top-k.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import transformers

from moecache.models import ADAPTERS
from moecache.models.expert_store import ExpertStore
from moecache.runtime.device import StandinDevice
from moecache.runtime.manager import CacheManager


def random_store(
    L: int = 2, E: int = 8, H: int = 8, inter: int = 4, dtype=torch.float32, seed: int = 0
) -> ExpertStore:
    gen = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * inter, H, generator=gen, dtype=torch.float32).to(dtype) for _ in range(L)]
    down = [torch.randn(E, H, inter, generator=gen, dtype=torch.float32).to(dtype) for _ in range(L)]
    return ExpertStore.from_tensors(gate_up, down, pin="off")


def manager(
    policy: str = "lru",
    capacity=4,
    *,
    store=None,
    mode: str = "before_visit",
    top_k: int = 2,
    params=None,
    **kw,
):
    store = store or random_store()
    device = StandinDevice(mode)
    return CacheManager.from_policy(store, device, capacity, policy, params or {}, top_k=top_k, **kw)


def tiny(model_type: str, seed: int = 0, **overrides):
    """The adapter's tiny random model (`tiny_config(**overrides)`, seeded), in eval mode; qwen3_5_moe as
    the text-only CausalLM, as AutoModelForCausalLM loads it."""
    config = ADAPTERS[model_type].tiny_config(**overrides)
    torch.manual_seed(seed)
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForCausalLM(config.text_config).eval()
    return getattr(transformers, config.architectures[0])(config).eval()


def spy_visits(manager) -> dict[int, list[np.ndarray]]:
    """Record the routing every `manager.visit` receives, per MoE layer (the visit itself still runs)."""
    seen, visit = defaultdict(list), manager.visit

    def spy(layer, ids_TK, *args, **kwargs):
        seen[layer].append(np.array(ids_TK, dtype=np.int64, copy=True))
        return visit(layer, ids_TK, *args, **kwargs)

    manager.visit = spy
    return seen


def split_profile(store, copy_us: float, cpu_us: float, overlap: str = "parallel", wait_host_us=None) -> dict:
    """A schema-2 cost profile of `store`'s expert for on_miss="split" (hand-made, not measurements): a
    copy takes `copy_us`, a missed expert `cpu_us` on the CPU (+ 1 us per call), the operator 1 us per
    entry; `wait_host_us`: a waiting visit's host time (runtime.split_host; None: no such row)."""
    timing = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    profile = {
        "schema_version": 2,
        "shape": {"hidden_size": store.hidden_size, "moe_intermediate_size": 1, "expert_bytes": store.expert_bytes},
        "dtype": "float32",
        "machine": {"threads": 1},
        "cpu": [{"dtype": "float32", "tokens_per_call": 1, "median_us": cpu_us, "p10_us": cpu_us, "p90_us": cpu_us, "pool_experts": 2}],
        "cuda": None,
        "h2d": None,
        "measured_at": "2026-01-01T00:00:00Z",
        "runtime": {
            "model": {"num_experts": store.num_experts, "top_k": 2, "expert_bytes": store.expert_bytes},
            "execution": {"path": "fast", "overlap": overlap},
            "slot_moe": [{"tokens": 1, "entries": n, "median_us": float(n), **timing} for n in (1, 2)],
            "cpu_path": [
                {"tokens_per_expert": 1, "experts": u, "median_us": 1.0 + u * cpu_us, **timing} for u in (1, 2)
            ],
            "visit": [{"tokens": 1, "median_us": 1.0, **timing}],
            "copy_engine": {"expert_bytes": store.expert_bytes, "per_copy_us": copy_us, "single": {}, "batch": {}},
            "non_expert": None,
        },
    }  # fmt: skip
    if wait_host_us is not None:
        profile["runtime"]["split_host"] = {
            "decide_us": 0.0,
            "wait_us": wait_host_us,
            "decisions": 1,
            "waits": 1,
        }
    return profile


def split_cost(store, copy_us: float, cpu_us: float, overlap: str = "parallel", wait_host_us=None):
    """split_profile's CostModel, tabulated for `store`'s expert."""
    from moecache.cost_profile import CostProfile
    from moecache.sim.cost_model import CostModel

    profile = CostProfile.from_dict(
        split_profile(store, copy_us, cpu_us, overlap, wait_host_us), source="split_profile"
    )
    return CostModel.from_profile(profile, store.expert_bytes, 64)


def half_ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """Half the bf16 spacing at each value of v (float32): the most one round-to-nearest can move it."""
    exponent = torch.frexp(v).exponent  # v = m * 2^e, 0.5 <= |m| < 1; bf16 keeps 8 significant bits
    return torch.ldexp(torch.ones_like(v), exponent - 9)
