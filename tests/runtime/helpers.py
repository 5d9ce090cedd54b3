"""Small builders for the runtime tests: a random expert store, a manager on the CPU stand-in device.

Legend: L layers, E experts, H hidden, I intermediate, T tokens, K top-k.
"""

from __future__ import annotations

import torch

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
