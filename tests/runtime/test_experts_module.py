"""The experts module (moecache/runtime/experts_module.py): the gather of a visit's CPU entries, and the
one rounding of a visit whose entries run in both halves."""

from __future__ import annotations

import numpy as np
import torch
from moecache_kernels import slot_moe_reference

import moecache
from moecache.runtime.experts_module import OffloadedExperts, miss_entries, route_misses
from tests.runtime.helpers import half_ulp_bf16, tiny


def test_miss_entries_are_the_missed_entries_in_token_then_k_order():
    rng = np.random.default_rng(3)
    for T, K, E in ((1, 6, 64), (5, 8, 256), (16, 2, 8)):
        ids_TK = rng.integers(0, E, (T, K)).astype(np.int32)  # any integer dtype
        hit_TK = rng.random((T, K)) < 0.4
        w_TK = torch.rand(T, K).to(torch.bfloat16)
        keys_M, token_M, weight_M = miss_entries(3, E, ids_TK, w_TK, hit_TK)
        t_M, k_M = np.nonzero(~hit_TK)  # the definition: row-major order of the missed entries
        assert keys_M.dtype == token_M.dtype == torch.int64 and weight_M.dtype == torch.float32
        assert keys_M.tolist() == (3 * E + ids_TK[t_M, k_M].astype(np.int64)).tolist()
        assert token_M.tolist() == t_M.tolist()
        assert torch.equal(weight_M, w_TK.float()[torch.from_numpy(t_M), torch.from_numpy(k_M)])
    none = miss_entries(0, 8, np.zeros((2, 2), np.int64), torch.ones(2, 2), np.ones((2, 2), np.bool_))
    assert [len(x) for x in none] == [0, 0, 0]


def test_route_misses_is_the_rows_hit_mask_miss_entries_and_a_copy_of_the_routing_in_one_call():
    rng = np.random.default_rng(5)
    for T, K, E in ((1, 6, 64), (5, 8, 256), (16, 2, 8)):
        row_E = np.where(rng.random(E) < 0.5, rng.integers(0, 99, E), -1).astype(np.int32)
        ids_TK = rng.integers(0, E, (T, K)).astype(np.int64)
        w_TK = rng.random((T, K)).astype(np.float32)
        hit_TK = np.zeros((T, K), np.bool_)
        keys_M, token_M, weight_M = (
            np.zeros(T * K, np.int64),
            np.zeros(T * K, np.int64),
            np.zeros(T * K, np.float32),
        )
        copy_TK = np.full((T, K), -7, np.int64)
        m = route_misses(2 * E, row_E, ids_TK, w_TK, hit_TK, keys_M, token_M, weight_M, copy_TK)
        assert hit_TK.tolist() == (row_E[ids_TK] >= 0).tolist() and copy_TK.tolist() == ids_TK.tolist()
        want = miss_entries(2, E, ids_TK, torch.from_numpy(w_TK), row_E[ids_TK] >= 0)
        assert m == len(want[0]) and 0 < m < T * K
        assert [keys_M[:m].tolist(), token_M[:m].tolist(), weight_M[:m].tolist()] == [
            x.tolist() for x in want
        ]
    for bad in (E, -1):  # an id outside 0..E-1: -1, as `CacheManager.prepared_hits` gives None
        ids_TK[-1, -1] = bad
        assert route_misses(0, row_E, ids_TK, w_TK, hit_TK, keys_M, token_M, weight_M, copy_TK) == -1


def test_a_mixed_visit_rounds_the_float32_sum_of_both_halves_once():
    """bf16, a layer visit whose entries run partly from the slot pool, partly on the CPU: the output is
    the float32 sum over all K entries rounded ONCE (within half a bf16 spacing of the float32 reference,
    up to float32 summation order). Rounding each half to bf16 and adding in bf16 misses that bound on
    this very case."""
    model = tiny("qwen3_moe").to(torch.bfloat16)
    moecache.offload(model, capacity="50%", policy="lru")
    session = model.moecache
    experts = next(m for m in model.modules() if isinstance(m, OffloadedExperts))
    E, L0 = experts.num_experts, experts.layer_id
    seen = []
    visit = session.manager.visit

    def spy(layer, ids_TK, *args, **kwargs):
        seen.append(visit(layer, ids_TK, *args, **kwargs))
        return seen[-1]

    session.manager.visit = spy
    gen = torch.Generator().manual_seed(0)
    T, H = 16, model.config.hidden_size
    K = model.config.num_experts_per_tok
    warm_TK = torch.arange(K).repeat(T, 1)  # experts 0..K-1: admitted now, resident at the next visit
    with torch.inference_mode():
        experts(torch.randn(T, H, generator=gen).to(torch.bfloat16), warm_TK, torch.ones(T, K))
        x_TH = (4 * torch.randn(T, H, generator=gen)).to(torch.bfloat16)
        ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        w_TK = torch.rand(T, K, generator=gen).to(torch.bfloat16)
        y_TH = experts(x_TH, ids_TK, w_TK)
    hit_TK = torch.from_numpy(seen[-1].hit_TK)
    assert hit_TK.any() and not hit_TK.all(), "the case must run both halves"
    store = session.manager.store
    w13, w2 = store.w13_GIH[L0 * E : (L0 + 1) * E], store.w2_GHI[L0 * E : (L0 + 1) * E]

    def part(mask_TK):  # the float32 sum over the entries of mask_TK (0 weight elsewhere), bf16 products
        out_TH = torch.empty(T, H)
        w_masked_TK = w_TK.float() * mask_TK
        return slot_moe_reference(
            x_TH, ids_TK, w_masked_TK, torch.arange(E), w13, w2, out=out_TH, round_product=True
        )

    want_TH = part(torch.ones(T, K))
    bound_TH = half_ulp_bf16(want_TH) + 1e-5 * want_TH.abs()
    assert y_TH.dtype == torch.bfloat16
    assert ((y_TH.float() - want_TH).abs() <= bound_TH).all()
    halves_TH = part(hit_TK.float()).to(torch.bfloat16) + part((~hit_TK).float()).to(torch.bfloat16)
    assert ((halves_TH.float() - want_TH).abs() > bound_TH).any()
