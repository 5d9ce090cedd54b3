"""Small builders for the runtime tests: a random expert store, a manager on the CPU stand-in device, a
tiny random model of an adapter's architecture.

Legend: L layers, E experts, H hidden, I intermediate, T tokens, K top-k.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import transformers

from moecache.models import ADAPTERS
from moecache.runtime.device import StandinDevice
from moecache.runtime.expert_store import ExpertStore
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
