"""A router's top-k in one Triton launch: `topk_rows(scores_TE, k, by_value) -> (values_TK, ids_TK)`.

`torch.topk` of a decode step's one row of E router scores is two CUDA kernels (a radix select and a
bitonic sort of the k results; 9.6 us a MoE layer on an H100, docs/benchmarks.md). Here one program per
row loads the row (E <= 1,024) and takes the largest remaining score k times (one max over the row each time, of
the score's bits and the id packed into one integer, so that equal scores give the lowest id). For
`by_value` (topk's `sorted`) that is torch's order where the chosen scores are distinct; where two are
equal, the k go in the order CUDA's topk gathers them through the 32-lane bitonic network torch sorts
them with (`tl.gather` across the lanes), which decides the order of equal scores. Otherwise they are
stored in the gather order. One launch, no scratch memory, and the ids in the order `torch.topk`
returns them, equal scores included (`topk_rows_reference`, the oracle, spells the order out). K <= 32;
rows must hold no NaN.

moecache/runtime/router_topk.py puts it in place of the routers' `torch.topk` (as a custom operator, so
that `torch.compile` traces the call).

Shape legend: T tokens (rows), E experts (scores per row), K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_rows_reference import check_topk_args


@triton.jit
def _exchange(keys, ids, valid, lanes, stride: tl.constexpr, size: tl.constexpr):
    """One pass of torch's bitonic network over the lanes (topk_rows_reference._small_bitonic_sort):
    lanes lo and lo + stride exchange where `(key_lo > key_hi and lo valid) or hi invalid` equals the
    phase's direction, bit `size` of lo (size 0: the final merge, direction false)."""
    partner = lanes ^ stride
    p_keys = tl.gather(keys, partner, 0)
    p_ids = tl.gather(ids, partner, 0)
    p_valid = tl.gather(valid, partner, 0)
    is_lo = (lanes & stride) == 0
    k_lo = tl.where(is_lo, keys, p_keys)
    k_hi = tl.where(is_lo, p_keys, keys)
    v_lo = tl.where(is_lo, valid, p_valid)
    v_hi = tl.where(is_lo, p_valid, valid)
    swap = ((k_lo > k_hi) & (v_lo != 0)) | (v_hi == 0)
    if size == 0:
        direction = lanes < 0  # all false
    else:
        direction = (lanes & size) != 0
    exchange = swap == direction
    return (
        tl.where(exchange, p_keys, keys),
        tl.where(exchange, p_ids, ids),
        tl.where(exchange, p_valid, valid),
    )


@triton.jit
def _gather_place(row, chosen, kth):
    """2. Each chosen score's place in CUDA's gather order: the chosen above the K-th score by id, then
    those equal to it by id."""
    above = chosen & (row > kth)
    at_kth = chosen & (row == kth)
    return tl.where(
        above,
        tl.cumsum(above.to(tl.int32), axis=0) - 1,
        tl.sum(above.to(tl.int32), axis=0) + tl.cumsum(at_kth.to(tl.int32), axis=0) - 1,
    )


@triton.jit
def _topk_rows_kernel(
    scores_ptr,
    values_ptr,
    ids_ptr,
    E,
    stride_t,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BY_VALUE: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    row = tl.load(scores_ptr + t * stride_t + offs, mask=valid, other=0.0).to(tl.float32)
    # 1. the chosen: K times the largest score not chosen yet, the lowest id of equal ones, in one max
    # over (score's bits in signed integer order) << 32 | (BLOCK_E - 1 - id); -0.0 as 0.0, which it equals
    bits = tl.where(row == 0.0, 0.0, row).to(tl.int32, bitcast=True)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    packed = (order << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    lowest = -9223372036854775807 - 1
    free = valid
    lanes = tl.arange(0, 32)  # SORT_LANES: lanes 0..K-1 take the chosen in the order picked
    pick_ids = tl.zeros([32], tl.int32)
    ties = 0  # picks are in descending score order: equal scores among the chosen are adjacent
    kth = float("-inf")
    for i in tl.static_range(K):
        best = tl.max(tl.where(free, packed, lowest), axis=0)
        pick = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        best_order = (best >> 32).to(tl.int32)
        value = (best_order ^ ((best_order >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        if i > 0:
            ties += (value == kth).to(tl.int32)
        kth = value
        pick_ids = tl.where(lanes == i, pick, pick_ids)
        free = free & (offs != pick)
    chosen = valid & ~free
    if not BY_VALUE:
        place = _gather_place(row, chosen, kth)
        tl.store(values_ptr + t * K + place, row, mask=chosen)
        tl.store(ids_ptr + t * K + place, offs.to(tl.int64), mask=chosen)
    else:
        ids = pick_ids
        keys = tl.gather(row, ids, 0)
        if ties > 0:
            # 3. equal scores come out in the order torch's network gives them: that order in lanes
            # 0..K-1 of the network, then the network (without ties it sorts them as picked)
            place = _gather_place(row, chosen, kth)
            hit = chosen[None, :] & (place[None, :] == lanes[:, None])  # [32, BLOCK_E]
            keys = tl.sum(tl.where(hit, row[None, :], 0.0), axis=1)
            ids = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
            in_use = (lanes < K).to(tl.int32)
            for size_log in tl.static_range(1, 5):  # size 2, 4, 8, 16
                for back in tl.static_range(size_log):  # stride size/2 .. 1
                    keys, ids, in_use = _exchange(
                        keys, ids, in_use, lanes, 1 << (size_log - 1 - back), 1 << size_log
                    )
            for back in tl.static_range(5):  # stride 16 .. 1
                keys, ids, in_use = _exchange(keys, ids, in_use, lanes, 1 << (4 - back), 0)
        tl.store(values_ptr + t * K + lanes, keys, mask=lanes < K)
        tl.store(ids_ptr + t * K + lanes, ids.to(tl.int64), mask=lanes < K)


NUM_WARPS = 1  # one row's program: fastest (or within 0.1 us) on every row kind of bench_topk_rows.py, H100


def topk_rows(scores_TE: torch.Tensor, k: int, by_value: bool = True, num_warps: int = NUM_WARPS):
    """(values_TK in scores' dtype, ids_TK int64): module docstring. Raises ValueError as
    `check_topk_args` (topk_rows_reference.py)."""
    check_topk_args(scores_TE, k)
    num_tokens, num_experts = scores_TE.shape
    scores_TE = scores_TE if scores_TE.stride(1) == 1 else scores_TE.contiguous()
    values_TK = torch.empty((num_tokens, k), dtype=torch.float32, device=scores_TE.device)
    ids_TK = torch.empty((num_tokens, k), dtype=torch.int64, device=scores_TE.device)
    if num_tokens:
        _topk_rows_kernel[(num_tokens,)](
            scores_TE, values_TK, ids_TK, num_experts, scores_TE.stride(0), K=k,
            BLOCK_E=triton.next_power_of_2(num_experts), BY_VALUE=by_value, num_warps=num_warps,
        )  # fmt: skip
    return values_TK.to(scores_TE.dtype), ids_TK
