"""The manager's state machine with real CUDA streams and events (run under the GPU marker on the H200).

Legend: T tokens, K top-k, E experts, L layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moecache.runtime.device import CudaDevice
from moecache.runtime.manager import CacheManager
from tests.runtime.helpers import random_store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_manager(policy="lru", capacity=4, L=2, E=8, H=64, inter=32, top_k=2, **kw):
    store = random_store(L=L, E=E, H=H, inter=inter)
    store.pin("strict")
    return CacheManager.from_policy(store, CudaDevice(), capacity, policy, {}, top_k=top_k, **kw), store


def test_copy_enqueued_at_admission_then_published_and_bit_identical():
    m, store = cuda_manager()
    m.time_gpu = True  # copies timed, as while the routing logger records
    r = m.visit(0, np.array([[1, 2]]))
    assert [c.key for c in r.copies] == [1, 2] and not r.hit_TK.any()
    for c in r.copies:
        c.ready_event.synchronize()
    r = m.visit(0, np.array([[1, 2]]))
    assert r.hit_TK.all()
    torch.cuda.synchronize()
    assert m.slot_of_LE[0].cpu().tolist() == r.snapshot_E.tolist()
    for key in (1, 2):
        slot = int(m.slot_of_G[key])
        assert torch.equal(m.pool.w13_SIH[slot].cpu(), store.w13_GIH[key])
        assert torch.equal(m.pool.w2_SHI[slot].cpu(), store.w2_GHI[key])
    copies = m.visit(1, np.array([[3, 4]])).copies
    torch.cuda.synchronize()
    assert all(c.observe() and c.duration_ns > 0 for c in copies)


def test_device_routing_is_read_back_and_fallback_does_not_wait():
    m, _ = cuda_manager(H=2048, inter=512, E=16, capacity=8, top_k=8)
    torch.cuda.synchronize()
    r = m.visit(0, torch.arange(8, device="cuda").view(1, 8))
    assert r.admitted.tolist() == list(range(8))
    r2 = m.visit(0, torch.arange(8, device="cuda").view(1, 8))  # copies (8 x 6 MiB) still in flight
    assert r2.hit_TK.sum() < 8  # at least one not ready yet: CPU path, no wait
    torch.cuda.synchronize()
    assert m.visit(0, torch.arange(8, device="cuda").view(1, 8)).hit_TK.all()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_stress_slots_never_overwritten_under_queued_kernels(policy):
    L, E, K = 2, 6, 2
    m, store = cuda_manager(policy, capacity=4, L=L, E=E, H=256, inter=128, top_k=K)
    ref_w13 = store.w13_GIH.cuda()
    bad = torch.zeros((), device="cuda")
    slow = torch.randn(1024, 1024, device="cuda")
    rng = np.random.default_rng(0)
    for _ in range(400):
        for layer in range(L):
            ids_TK = rng.choice(E, size=(1, K), replace=False)
            r = m.visit(layer, ids_TK)
            for _ in range(int(rng.integers(0, 4))):  # delay the compute stream: copies would race ahead
                slow = slow @ slow
                slow = slow / slow.norm()
            hit = torch.as_tensor(ids_TK[r.hit_TK], device="cuda")
            if len(hit):
                slots = r.slot_of_E[hit].long()  # read on the device, in stream order
                keys = hit + layer * E
                bad += (m.pool.w13_SIH[slots] != ref_w13[keys]).sum()
            m.commit()
    torch.cuda.synchronize()
    assert m.stats.hits > 100 and m.stats.copies > 10
    assert int(bad) == 0
