"""The experts module's gather of a visit's CPU entries (moecache/runtime/experts_module.py)."""

from __future__ import annotations

import numpy as np
import torch

from moecache.runtime.experts_module import miss_entries


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
