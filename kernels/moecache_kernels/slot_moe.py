"""Fused slot-pool MoE in Triton: gate/up -> SiLU(gate) * up -> down -> router-weighted sum.

`slot_moe(x_TH, topk_ids_TK, topk_weights_TK, slot_of_E, w13_SIH, w2_SHI, *, out=None) -> y_TH` computes,
for each token, the router-weighted sum over its RESIDENT experts (`slot_of_E[e] >= 0`) straight from the
slot pool; non-resident entries add nothing (the runtime computes them on the CPU). `slot_moe_reference`
is its oracle. `out` may be float32 whatever x's dtype: the float32 sums are stored unrounded, so the
runtime adds the CPU half to them in float32 and rounds once (docs/runtime.md, "One rounding"). The
numerics are the reference's (expert_reference.py): float32 sums, rounded to x's dtype where transformers
rounds (gate, up, SiLU(gate), the activation, each expert's down projection, and with `round_product` its
router-weighted product; `_rounded`), the K products summed in float32. Two paths, both graph-capturable
(no host sync, grids fixed by T, K, H, I):

- decode (T <= DECODE_MAX_T), two launches ("two_stage", the default variant; no buffer depends on E,
  nothing is sorted or padded, a non-resident entry's programs exit at once and add nothing): launch 1, one program per
  (token, k, block of I), a GEMV of x[t] with the slot's gate and up rows, writes SiLU(gate) * up in
  float32 (its values x's dtype's) to a [T*K, I] scratch (and each pair's slot, -1 where it does not run here, to a [T*K]
  scratch). Launch 2, one program per (token, block of H), sums the down projections of the token's
  resident experts times their router weights, reading each pair's slot from that scratch (one read,
  where the id and then the mapping would be two in a row). The entry's "variant" "pairs" runs launch 2
  per (pair, block of H) instead, each pair's weighted output into a float32 [T*K, H] buffer, and a third
  launch sums a token's K rows in k order (`_sum_pairs`, prefill's): the same sums in the same order, K
  times the down programs, no reduction shared by a token's experts. Other decode variants were tried on
  the H200 and removed (CHANGELOG.md).
- prefill (T > DECODE_MAX_T): as vLLM's fused_moe, (token, k) pairs are sorted by expert on the device
  (`align_by_expert_triton`) and each expert's run is padded to BLOCK_M; tensor-core tiles then run
  gate/up + activation (to a [T*K, I] buffer in x's dtype), then down times the router weight (to a
  [T*K, H] float32 buffer), and a last launch sums each token's K rows. Blocks past the padded total, or
  of non-resident experts, exit. The entry's "layout" puts the buffers' rows in pair order ("pairs") or
  in rank order ("sorted": a block's rows contiguous), its "tma" reads weights (and, "sorted", the down
  launch's act) through tensor descriptors.
CPU tensors run only under Triton's interpreter: TRITON_INTERPRET=1 set before triton is first imported
(triton decides at import whether its own library functions are interpreted), as the CPU tests do in a
subprocess. Expert ids outside [0, E)
and slots outside [0, S) count as not resident (checking them would need a host sync); the reference
raises on them.

Shape legend: T tokens, H hidden, I intermediate, E experts, K top-k, S slots, P = T*K (token, k) pairs,
B blocks of BLOCK_M sorted pairs (prefill).
"""

# ruff: noqa: E741  (kernel arguments use the shape legend: H, I, E, S, K)
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from .expert_reference import rounds_product
from .slot_moe_align import align_by_expert_triton
from .slot_moe_config import (
    DECODE_MAX_T,
    DECODE_VARIANT,
    device_name,
    get_config,
    prefill_layout,
    prefill_tma,
)


@triton.jit
def _slot_of(ids_ptr, slot_ptr, pair, E, S):
    """(expert, slot, resident) of the (token, k) entry `pair`: its id, the mapping's slot for it (read only
    for an id inside 0..E-1) and whether it runs here (id inside, slot inside 0..S-1)."""
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    inside = (expert >= 0) & (expert < E)
    slot = tl.load(slot_ptr + tl.where(inside, expert, 0)).to(tl.int32)
    return expert, slot, inside & (slot >= 0) & (slot < S)


@triton.jit
def _rounded(v, RD: tl.constexpr):
    """float32 v rounded to dtype RD (nearest even), kept in float32; RD float32: v. bf16 by integer
    arithmetic, not `.to`: Triton's interpreter truncates a bf16 cast."""
    if RD == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        v = u.to(tl.float32, bitcast=True)
    elif RD == tl.float16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _gate_up_rows(
    x_ptr, w13_ptr, stride_wn, offs_i, mask_i,
    H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """(x . gate[i], x . up[i]) in float32 for the rows offs_i of one slot's w13 (gate rows, then up rows);
    x_ptr points at the token's row, w13_ptr at the slot's matrix."""
    gate_ptrs = w13_ptr + offs_i[:, None] * stride_wn
    up_ptrs = gate_ptrs + I * stride_wn
    acc_gate = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):  # unrolled: all of the row block's loads in flight at once
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        x = tl.load(x_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        mask = mask_i[:, None] & mask_h[None, :]
        gate = tl.load(gate_ptrs + offs_h[None, :], mask=mask, other=0.0)
        up = tl.load(up_ptrs + offs_h[None, :], mask=mask, other=0.0)
        acc_gate += gate.to(tl.float32) * x[None, :]
        acc_up += up.to(tl.float32) * x[None, :]
    return tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _gate_up_decode(
    x_ptr, ids_ptr, slot_ptr, w13_ptr, act_ptr, slot_out_ptr,
    H: tl.constexpr, I: tl.constexpr, E, S, K: tl.constexpr,
    stride_xt, stride_ws, stride_wn,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, RD: tl.constexpr,
):  # fmt: skip
    """Program (pair p = t*K + k, block of I): act[p, i] = silu(x[t] . gate[i]) * (x[t] . up[i]), each
    of gate, up, silu and act rounded to RD (x's dtype). The
    pair's first program also writes its slot (-1 when it does not run here) to slot_out[p], so the down
    launch reads one value instead of the id and then the mapping."""
    pair = tl.program_id(0)
    expert, slot, resident = _slot_of(ids_ptr, slot_ptr, pair, E, S)
    block = tl.program_id(1)
    if block == 0:
        tl.store(slot_out_ptr + pair, tl.where(resident, slot, -1))
    if (slot < 0) | (slot >= S) | (expert < 0) | (expert >= E):  # not resident, as timed on the H200
        return
    token = pair // K
    offs_i = block * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    gate_i, up_i = _gate_up_rows(
        x_ptr + token * stride_xt, w13_ptr + slot.to(tl.int64) * stride_ws, stride_wn, offs_i, mask_i,
        H, I, BLOCK_I, BLOCK_H,
    )  # fmt: skip
    gate_i, up_i = _rounded(gate_i, RD), _rounded(up_i, RD)
    act = _rounded(_rounded(gate_i / (1.0 + tl.exp(-gate_i)), RD) * up_i, RD)
    tl.store(act_ptr + pair * I + offs_i, act, mask=mask_i)


@triton.jit
def _weighted_down(
    act_ptr, pair, w_rows, weight, mask_h, i_end,
    I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, RD: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    """One pair's weight * R(down[h] . act[pair]) for the down rows `w_rows` (BLOCK_H pointers), float32: R
    rounds to RD, the product too with ROUND_PRODUCT. Columns at or past `i_end` (0: a pair not run here)
    load nothing and add 0."""
    acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
    for i0 in tl.static_range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < i_end
        act = tl.load(act_ptr + pair * I + offs_i, mask=mask_i, other=0.0)
        w = tl.load(w_rows[:, None] + offs_i[None, :], mask=mask_h[:, None] & mask_i[None, :], other=0.0)
        acc += w.to(tl.float32) * act[None, :]
    prod = _rounded(tl.sum(acc, axis=1), RD) * weight
    if ROUND_PRODUCT:
        prod = _rounded(prod, RD)
    return prod


@triton.jit
def _down_decode(
    act_ptr, slot_P_ptr, wts_ptr, w2_ptr, y_ptr,
    H, I: tl.constexpr, K: tl.constexpr,
    stride_ws, stride_wh, stride_yt,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, RD: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    """Program (token t, block of H): y[t, h] = sum over resident k of w[t, k] * R(down[h] . act[t*K + k]),
    R rounding to RD (x's dtype), the product rounded too with ROUND_PRODUCT, summed in float32; slot_P:
    each pair's slot as the gate/up launch wrote it (-1: not run here)."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # unrolled, so the K experts' loads need not wait on each other
        pair = token * K + k
        slot = tl.load(slot_P_ptr + pair)
        resident = slot >= 0
        weight = tl.load(wts_ptr + pair).to(tl.float32)
        w_rows = w2_ptr + tl.where(resident, slot, 0).to(tl.int64) * stride_ws + offs_h * stride_wh
        i_end = tl.where(resident, I, 0)  # a non-resident entry loads nothing: it adds 0
        y += _weighted_down(
            act_ptr, pair, w_rows, weight, mask_h, i_end, I, BLOCK_H, BLOCK_I, RD, ROUND_PRODUCT
        )
    tl.store(y_ptr + token * stride_yt + offs_h, y.to(y_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def _down_decode_pairs(
    act_ptr, slot_P_ptr, wts_ptr, w2_ptr, out_ptr,
    H, I: tl.constexpr,
    stride_ws, stride_wh, stride_op,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, RD: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    """Program (pair p, block of H), variant "pairs": out[p, h] = w[p] * R(down[h] . act[p]), float32 (R:
    rounded to RD, x's dtype; the product too with ROUND_PRODUCT), for a pair run here (slot_P[p] >= 0);
    the others' rows are left as they are (`_sum_pairs` skips them)."""
    pair = tl.program_id(0)
    slot = tl.load(slot_P_ptr + pair)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    weight = tl.load(wts_ptr + pair).to(tl.float32)
    w_rows = w2_ptr + slot.to(tl.int64) * stride_ws + offs_h * stride_wh
    prod = _weighted_down(act_ptr, pair, w_rows, weight, mask_h, I, I, BLOCK_H, BLOCK_I, RD, ROUND_PRODUCT)
    tl.store(out_ptr + pair.to(tl.int64) * stride_op + offs_h, prod, mask=mask_h)


@triton.jit
def _grouped_tile(pid, num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    """(block of rows, block of columns) of program `pid`, in groups of GROUP_M row blocks so that
    consecutive programs share their expert's weight tiles in L2 (the Triton matmul tutorial's order)."""
    group = GROUP_M * num_blocks_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_m, (pid % group) // group_m


@triton.jit
def _gate_up_grouped(
    x_ptr, pair_ptr, block_slot_ptr, block_rank_ptr, w13, act_ptr,
    num_pairs, num_blocks_m, H, I, K,
    stride_xt, stride_ws, stride_wn, stride_at,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SORTED: tl.constexpr, W_DESC: tl.constexpr,
    RD: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_M pairs sorted by expert, block of I): act = silu(x @ gate.T) * (x @ up.T),
    gate, up, silu and act each rounded to RD (x's dtype, act's),
    into act's row of each pair (layout "pairs") or of its rank (layout "sorted": the block's rows are
    contiguous, from block_rank[block]). W_DESC: w13 is a tensor descriptor of the pool as [S * 2I, H]
    (TMA on Hopper), else a pointer. x's rows are gathered through pointers either way."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int32)
    if slot < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + offs_m)
    mask_m = pair < num_pairs
    token = tl.where(mask_m, pair, 0) // K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    if W_DESC:  # the gate rows of this block of I; a box past row I reads up rows, only into masked columns
        gate_row = slot * (2 * I) + pid_n * BLOCK_N
    else:
        gate_ptrs = w13 + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
        up_ptrs = gate_ptrs + I * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k < H - k0 * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if W_DESC:  # zero past H: the descriptor's bounds
            gate = w13.load([gate_row, k0 * BLOCK_K]).T
            up = w13.load([gate_row + I, k0 * BLOCK_K]).T
        else:
            gate = tl.load(gate_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            up = tl.load(up_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        if UPCAST:  # the interpreter: its bf16 tl.dot is wrong (triton 3.9), float32 is exact
            x, gate, up = x.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
    acc_gate, acc_up = _rounded(acc_gate, RD), _rounded(acc_up, RD)
    act = _rounded(_rounded(acc_gate / (1.0 + tl.exp(-acc_gate)), RD) * acc_up, RD)
    if SORTED:
        rows = tl.load(block_rank_ptr + pid_m) + tl.arange(0, BLOCK_M)
    else:
        rows = pair
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_grouped(
    act, pair_ptr, block_slot_ptr, block_rank_ptr, wts_ptr, w2, out_ptr,
    num_pairs, num_blocks_m, H, I,
    stride_at, stride_ws, stride_wh, stride_op,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SORTED: tl.constexpr, ACT_DESC: tl.constexpr,
    W_DESC: tl.constexpr, RD: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    """Program (block of sorted pairs, block of H): out[row, h] = w[p] * R(act[row] . down[h]), float32 (R:
    rounded to RD, x's dtype; the product too with ROUND_PRODUCT), row =
    the pair p (layout "pairs") or its rank (layout "sorted": the block's act and out rows are contiguous).
    ACT_DESC ("sorted" only): act is a tensor descriptor of [P, I], its box at the block's first rank (rows
    past the block's pairs are another expert's or unwritten: their results are masked off); W_DESC: w2 is
    a tensor descriptor of the pool as [S * H, I]. Either is a pointer otherwise."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int32)
    if slot < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + offs_m)
    mask_m = pair < num_pairs
    pair_c = tl.where(mask_m, pair, 0).to(tl.int64)
    if SORTED:
        first_rank = tl.load(block_rank_ptr + pid_m)
        rows = (first_rank + tl.arange(0, BLOCK_M)).to(tl.int64)
    else:
        rows = pair_c
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    if not ACT_DESC:
        act_ptrs = act + rows[:, None] * stride_at + offs_k[None, :]
    if W_DESC:  # a box past row H reads the next slot's rows, only into masked columns
        w_row = slot * H + pid_n * BLOCK_N
    else:
        w_ptrs = w2 + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wh + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(I, BLOCK_K)):
        mask_k = offs_k < I - k0 * BLOCK_K
        if ACT_DESC:  # zero past I and past P: the descriptor's bounds
            a = act.load([first_rank, k0 * BLOCK_K])
        else:
            a = tl.load(act_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            act_ptrs += BLOCK_K
        if W_DESC:
            w = w2.load([w_row, k0 * BLOCK_K]).T
        else:
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            w_ptrs += BLOCK_K
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weight = tl.load(wts_ptr + pair_c, mask=mask_m, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_op + offs_n[None, :]
    prod = _rounded(acc, RD) * weight[:, None]
    if ROUND_PRODUCT:
        prod = _rounded(prod, RD)
    tl.store(out_ptrs, prod, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_pairs(
    out_ptr, ids_ptr, slot_ptr, y_ptr,
    H, E, S, K,
    stride_op, stride_yt,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (token t, block of H): y[t] = sum over resident k of out[t*K + k], in float32 (prefill's
    layout "pairs", the decode's variant "pairs")."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, K):
        pair = token * K + k
        expert, slot, resident = _slot_of(ids_ptr, slot_ptr, pair, E, S)
        acc += tl.load(
            out_ptr + pair.to(tl.int64) * stride_op + offs_h,
            mask=offs_h < tl.where(resident, H, 0),
            other=0.0,
        )
    tl.store(y_ptr + token * stride_yt + offs_h, acc.to(y_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def _sum_ranks(
    out_ptr, rank_ptr, y_ptr,
    H, K,
    stride_op, stride_yt,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (token t, block of H): y[t] = the sum over its K pairs of out[rank of pair t*K + k], in float32
    (layout "sorted": out's rows are in rank order); a pair left out (rank -1) adds nothing. The K rows
    load as one [BLOCK_K, BLOCK_H] tile, all in flight at once, and sum in one fixed order (a tree)."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_k = tl.arange(0, BLOCK_K)
    rank = tl.load(rank_ptr + token * K + offs_k, mask=offs_k < K, other=-1)
    rows = tl.load(
        out_ptr + tl.maximum(rank, 0).to(tl.int64)[:, None] * stride_op + offs_h[None, :],
        mask=(rank >= 0)[:, None] & mask_h[None, :],
        other=0.0,
    )
    tl.store(y_ptr + token * stride_yt + offs_h, tl.sum(rows, 0).to(y_ptr.dtype.element_ty), mask=mask_h)


def _check(x_TH, topk_ids_TK, topk_weights_TK, slot_of_E, w13_SIH, w2_SHI, out) -> None:
    """Shapes, dtypes, devices and layouts (host metadata only: no sync); ValueError naming the bad one."""
    num_tokens, hidden = x_TH.shape
    num_slots, two_inter, _ = w13_SIH.shape
    if (
        topk_ids_TK.shape != topk_weights_TK.shape
        or topk_ids_TK.dim() != 2
        or topk_ids_TK.shape[0] != num_tokens
    ):
        raise ValueError(
            f"slot_moe: routing shapes disagree: x {tuple(x_TH.shape)}, topk_ids {tuple(topk_ids_TK.shape)},"
            f" topk_weights {tuple(topk_weights_TK.shape)}"
        )
    if two_inter % 2 or w13_SIH.shape[2] != hidden or w2_SHI.shape != (num_slots, hidden, two_inter // 2):
        raise ValueError(
            f"slot_moe: slot pool shapes disagree with hidden {hidden}: w13 {tuple(w13_SIH.shape)} (want [S, 2I, H]),"
            f" w2 {tuple(w2_SHI.shape)} (want [S, H, I])"
        )
    if slot_of_E.dim() != 1 or slot_of_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_moe: slot_of_E must be a 1-D int tensor, got {slot_of_E.dtype} {tuple(slot_of_E.shape)}"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_moe: topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    tensors = {"x": x_TH, "topk_ids": topk_ids_TK, "topk_weights": topk_weights_TK, "slot_of_E": slot_of_E,
               "w13": w13_SIH, "w2": w2_SHI}  # fmt: skip
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"slot_moe: tensors on different devices: {devices}")
    if w13_SIH.dtype != w2_SHI.dtype or x_TH.dtype != w13_SIH.dtype:
        raise ValueError(
            f"slot_moe: x {x_TH.dtype}, w13 {w13_SIH.dtype}, w2 {w2_SHI.dtype} must share a dtype"
        )
    for name in ("w13", "w2"):
        if tensors[name].stride(-1) != 1 or tensors[name].stride(-2) != tensors[name].shape[-1]:
            raise ValueError(
                f"slot_moe: {name} must be contiguous in its last two dims, strides {tensors[name].stride()}"
            )
    if x_TH.stride(-1) != 1:
        raise ValueError(f"slot_moe: x must be contiguous in its last dim, strides {x_TH.stride()}")
    out_dtypes = (x_TH.dtype, torch.float32)
    if out is not None and (out.shape != x_TH.shape or out.dtype not in out_dtypes or out.device != x_TH.device
                            or out.stride(-1) != 1):  # fmt: skip
        raise ValueError(
            f"slot_moe: out must be {tuple(x_TH.shape)} {x_TH.dtype} or torch.float32 on {x_TH.device}, last"
            " dim contiguous"
        )


def slot_moe(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    slot_of_E: torch.Tensor,
    w13_SIH: torch.Tensor,
    w2_SHI: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    round_product: bool | None = None,
) -> torch.Tensor:
    """Each token's router-weighted sum of SiLU-gated experts over its resident experts, shape [T, H].

    `w13_SIH` [S, 2I, H] holds gate rows then up rows; `w2_SHI` [S, H, I]; `slot_of_E` [E] maps expert ->
    slot, -1 = not resident (adds nothing). Accumulates in float32, returns x's dtype; writes into `out`
    (and returns it) when given, e.g. a static buffer for CUDA-graph capture: of x's dtype, or float32
    (the float32 sums, not rounded: every launch's last store converts to `out`'s dtype).
    `round_product`: each expert's weighted output rounded to x's dtype (default: `rounds_product` of x's
    and the weights' dtypes; a caller holding widened router weights passes the router's).
    """
    _check(x_TH, topk_ids_TK, topk_weights_TK, slot_of_E, w13_SIH, w2_SHI, out)
    if x_TH.device.type != "cuda" and not knobs.runtime.interpret:
        raise ValueError(
            f"slot_moe: tensors on {x_TH.device} run only under Triton's interpreter: set TRITON_INTERPRET=1"
            " before triton is imported"
        )
    y_TH = torch.empty_like(x_TH) if out is None else out
    if x_TH.shape[0] == 0:
        return y_TH
    name = "cpu" if x_TH.device.type == "cpu" else device_name(x_TH.device)
    config = get_config(x_TH.shape[0], slot_of_E.shape[0], w2_SHI.shape[2], x_TH.dtype, name)
    launch(x_TH, topk_ids_TK, topk_weights_TK, slot_of_E, w13_SIH, w2_SHI, y_TH, config, round_product)
    return y_TH


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def launch(
    x_TH, topk_ids_TK, topk_weights_TK, slot_of_E, w13_SIH, w2_SHI, y_TH, config: dict, round_product=None
) -> None:
    """slot_moe's launches with an explicit config (the tuning script's entry; inputs already checked)."""
    num_tokens = x_TH.shape[0]
    ids_P = topk_ids_TK.contiguous()
    weights_P = topk_weights_TK.contiguous()
    slots = slot_of_E.contiguous()
    if round_product is None:
        round_product = rounds_product(x_TH.dtype, topk_weights_TK.dtype)
    rounding = {"RD": _TL_DTYPE[x_TH.dtype], "ROUND_PRODUCT": bool(round_product)}
    if num_tokens <= DECODE_MAX_T:
        _decode(x_TH, ids_P, weights_P, slots, w13_SIH, w2_SHI, y_TH, config, rounding)
    else:
        _prefill(x_TH, ids_P, weights_P, slots, w13_SIH, w2_SHI, y_TH, config, rounding)


def _decode(x_TH, ids_TK, weights_TK, slot_of_E, w13_SIH, w2_SHI, y_TH, config, rounding) -> None:
    """Gate/up + SiLU per (pair, block of I) into a float32 [P, I] scratch (and each pair's slot, -1 where
    it does not run here, into an int32 [P]), then down per (token, block of H); variant "pairs": down per
    (pair, block of H) into a float32 [P, H] buffer, then the sum over each token's pairs."""
    num_tokens, hidden = x_TH.shape
    top_k = ids_TK.shape[1]
    num_pairs = num_tokens * top_k
    inter = w2_SHI.shape[2]
    act_PI = torch.empty((num_pairs, inter), dtype=torch.float32, device=x_TH.device)
    slot_P = torch.empty((num_pairs,), dtype=torch.int32, device=x_TH.device)
    gate_up, down = config["gate_up"], config["down"]
    _gate_up_decode[(num_pairs, triton.cdiv(inter, gate_up["BLOCK_I"]))](
        x_TH, ids_TK, slot_of_E, w13_SIH, act_PI, slot_P,
        hidden, inter, slot_of_E.shape[0], w13_SIH.shape[0], top_k,
        x_TH.stride(0), w13_SIH.stride(0), w13_SIH.stride(1),
        BLOCK_I=gate_up["BLOCK_I"], BLOCK_H=gate_up["BLOCK_H"], RD=rounding["RD"],
        num_warps=gate_up["num_warps"],
    )  # fmt: skip
    if config.get("variant", DECODE_VARIANT) == "pairs":
        out_PH = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x_TH.device)
        _down_decode_pairs[(num_pairs, triton.cdiv(hidden, down["BLOCK_H"]))](
            act_PI, slot_P, weights_TK, w2_SHI, out_PH,
            hidden, inter,
            w2_SHI.stride(0), w2_SHI.stride(1), out_PH.stride(0),
            BLOCK_H=down["BLOCK_H"], BLOCK_I=down["BLOCK_I"], **rounding, num_warps=down["num_warps"],
        )  # fmt: skip
        block_h = 1024 if x_TH.device.type != "cpu" else 64
        _sum_pairs[(num_tokens, triton.cdiv(hidden, block_h))](
            out_PH, ids_TK, slot_of_E, y_TH,
            hidden, slot_of_E.shape[0], w13_SIH.shape[0], top_k,
            out_PH.stride(0), y_TH.stride(0),
            BLOCK_H=block_h,
        )  # fmt: skip
        return
    _down_decode[(num_tokens, triton.cdiv(hidden, down["BLOCK_H"]))](
        act_PI, slot_P, weights_TK, w2_SHI, y_TH,
        hidden, inter, top_k,
        w2_SHI.stride(0), w2_SHI.stride(1), y_TH.stride(0),
        BLOCK_H=down["BLOCK_H"], BLOCK_I=down["BLOCK_I"], **rounding, num_warps=down["num_warps"],
    )  # fmt: skip


def _prefill(x_TH, ids_TK, weights_TK, slot_of_E, w13_SIH, w2_SHI, y_TH, config, rounding) -> None:
    """Sort pairs by expert (`align_by_expert_triton`), then tensor-core tiles: gate/up + SiLU, down x
    router weight, sum over k. The entry's "layout" places act and out rows by pair ("pairs") or by rank
    ("sorted"); its "tma" reads the weights (and, "sorted", act) through tensor descriptors where they can
    be made (`_descriptor`), else through pointers."""
    num_tokens, hidden = x_TH.shape
    top_k = ids_TK.shape[1]
    num_pairs = num_tokens * top_k
    num_slots, inter, num_experts = w13_SIH.shape[0], w2_SHI.shape[2], slot_of_E.shape[0]
    block_m = config["BLOCK_M"]
    sorted_rows = prefill_layout(config) == "sorted"
    tma = prefill_tma(config)
    aligned = align_by_expert_triton(ids_TK, slot_of_E, num_slots, block_m)
    num_blocks_m = aligned.slot_of_block.shape[0]
    interpret = bool(knobs.runtime.interpret)
    # float32 inputs get exact ("ieee") dots, not tf32; bf16/fp16 dots ignore the setting
    precision = "ieee" if x_TH.dtype == torch.float32 or interpret else "tf32"
    act_PI = torch.empty((num_pairs, inter), dtype=x_TH.dtype, device=x_TH.device)
    out_PH = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x_TH.device)
    gate_up, down = config["gate_up"], config["down"]
    w13 = _descriptor(w13_SIH, [gate_up["BLOCK_N"], gate_up["BLOCK_K"]]) if tma else None
    grid = (num_blocks_m * triton.cdiv(inter, gate_up["BLOCK_N"]),)
    _gate_up_grouped[grid](
        x_TH, aligned.pair_of_row, aligned.slot_of_block, aligned.rank_of_block,
        w13_SIH if w13 is None else w13, act_PI,
        num_pairs, num_blocks_m, hidden, inter, top_k,
        x_TH.stride(0), w13_SIH.stride(0), w13_SIH.stride(1), act_PI.stride(0),
        BLOCK_M=block_m, BLOCK_N=gate_up["BLOCK_N"], BLOCK_K=gate_up["BLOCK_K"], GROUP_M=gate_up["GROUP_M"],
        PRECISION=precision, UPCAST=interpret, SORTED=sorted_rows, W_DESC=w13 is not None,
        RD=rounding["RD"], num_warps=gate_up["num_warps"], num_stages=gate_up["num_stages"],
    )  # fmt: skip
    act = _descriptor(act_PI, [block_m, down["BLOCK_K"]]) if tma and sorted_rows else None
    w2 = _descriptor(w2_SHI, [down["BLOCK_N"], down["BLOCK_K"]]) if tma else None
    grid = (num_blocks_m * triton.cdiv(hidden, down["BLOCK_N"]),)
    _down_grouped[grid](
        act_PI if act is None else act, aligned.pair_of_row, aligned.slot_of_block, aligned.rank_of_block,
        weights_TK, w2_SHI if w2 is None else w2, out_PH,
        num_pairs, num_blocks_m, hidden, inter,
        act_PI.stride(0), w2_SHI.stride(0), w2_SHI.stride(1), out_PH.stride(0),
        BLOCK_M=block_m, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], GROUP_M=down["GROUP_M"],
        PRECISION=precision, UPCAST=interpret, SORTED=sorted_rows, ACT_DESC=act is not None,
        W_DESC=w2 is not None, **rounding, num_warps=down["num_warps"], num_stages=down["num_stages"],
    )  # fmt: skip
    block_h = 1024 if x_TH.device.type != "cpu" else 64
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    if sorted_rows:
        _sum_ranks[grid](
            out_PH, aligned.rank_of_pair, y_TH,
            hidden, top_k,
            out_PH.stride(0), y_TH.stride(0),
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_H=block_h,
        )  # fmt: skip
    else:
        _sum_pairs[grid](
            out_PH, ids_TK, slot_of_E, y_TH,
            hidden, num_experts, num_slots, top_k,
            out_PH.stride(0), y_TH.stride(0),
            BLOCK_H=block_h,
        )  # fmt: skip


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor | None:
    """A tensor descriptor of `t`'s rows (all leading dims as one: a slot pool [S, N, C] as [S * N, C])
    with boxes of `block`, or None where TMA cannot address it: leading dims not contiguous with each
    other, a row stride or base not 16-byte aligned, or a box row narrower than 16 bytes (host metadata
    only). Boxes past the end read zeros."""
    rows, cols = t.numel() // t.shape[-1], t.shape[-1]
    nbytes = t.element_size()
    stacked = all(t.stride(d) == t.stride(d + 1) * t.shape[d + 1] for d in range(t.dim() - 2))
    if (
        not stacked
        or t.stride(-1) != 1
        or (t.stride(-2) * nbytes) % 16
        or t.data_ptr() % 16
        or (block[-1] * nbytes) % 16
        or rows >= 2**31
    ):
        return None
    return TensorDescriptor(t, [rows, cols], [t.stride(-2), 1], block)
