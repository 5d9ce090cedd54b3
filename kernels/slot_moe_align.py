"""Sort (token, k) pairs by expert and pad each expert's run to BLOCK_M, on the device (vLLM's
`moe_align_block_size`): the prefill path's grouping. No host sync: the number of blocks is an upper
bound fixed by P, E and BLOCK_M, and blocks past the padded total get slot -1 (they exit).

Two implementations of one result (`Alignment`), equal element for element: `align_by_expert` in torch
ops (the definition, and the tests' oracle; some 40 small launches) and `align_by_expert_triton`, three
Triton launches (count per chunk of pairs, prefix sums in one program, scatter), which the kernel runs.
Both are stable (an expert's pairs keep their pair order) and deterministic (no atomics).

Legend: P = T*K pairs, E experts, B blocks of BLOCK_M sorted pairs, R = B * BLOCK_M padded rows, C
chunks of pairs (the Triton launches' programs). A pair's RANK is its place among the resident pairs
sorted by expert (0 .. resident count - 1): the "sorted" prefill layout stores a pair's rows there, so
an expert's pairs are contiguous rows with no padding between experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Alignment(NamedTuple):
    """The grouping of P pairs by expert. pair_of_row [R]: each padded row's pair, the sentinel P for
    padding; slot_of_block [B]: each block's slot, -1 past the total; rank_of_block [B]: the rank of each
    block's first row (its row i holds the pair of rank rank_of_block + i, where that row is not padding;
    P past the total); rank_of_pair [P]: each pair's rank, -1 for pairs left out (not resident). All int32.
    """

    pair_of_row: torch.Tensor
    slot_of_block: torch.Tensor
    rank_of_block: torch.Tensor
    rank_of_pair: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks: each expert that is routed to pads at most BLOCK_M - 1 rows."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m)


def align_by_expert(
    topk_ids_TK: torch.Tensor, slot_of_E: torch.Tensor, num_slots: int, block_m: int
) -> Alignment:
    """The `Alignment` of the routing: R = B * BLOCK_M rows of pair indices sorted by expert, each
    expert's run padded to a multiple of BLOCK_M with the sentinel P; each block's slot (-1 past the
    total) and first rank; each pair's rank. Pairs of non-resident experts (slot -1, or ids/slots out of
    range) are left out. In torch ops: the definition `align_by_expert_triton` is tested against.
    """
    device = topk_ids_TK.device
    num_experts = slot_of_E.shape[0]
    ids_P = topk_ids_TK.reshape(-1).long()
    num_pairs = ids_P.shape[0]
    inside_P = (ids_P >= 0) & (ids_P < num_experts)
    slot_P = torch.where(inside_P, slot_of_E.long()[ids_P.clamp(0, num_experts - 1)], -1)
    resident_P = (slot_P >= 0) & (slot_P < num_slots)
    key_P = torch.where(resident_P, ids_P, num_experts)  # non-resident pairs sort last, under key E
    counts_E = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts_E.scatter_add_(0, key_P, torch.ones_like(key_P))
    counts_E = counts_E[:num_experts]
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    end_E = padded_E.cumsum(0)
    first_row_E = end_E - padded_E
    first_sorted_E = counts_E.cumsum(0) - counts_E
    key_sorted_P, order_P = torch.sort(key_P, stable=True)
    expert_P = key_sorted_P.clamp(max=num_experts - 1)
    rank_P = torch.arange(num_pairs, device=device) - first_sorted_E[expert_P]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    num_rows = num_blocks * block_m
    kept_P = key_sorted_P < num_experts
    row_P = torch.where(kept_P, first_row_E[expert_P] + rank_P, num_rows)
    pair_of_row = torch.full((num_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    pair_of_row.scatter_(0, row_P, order_P.to(torch.int32))  # left-out pairs land on the spare last row
    rank_of_pair = torch.full((num_pairs,), -1, dtype=torch.int32, device=device)
    sorted_rank_P = torch.arange(num_pairs, device=device)  # resident pairs come first in the sort
    rank_of_pair.scatter_(0, order_P, torch.where(kept_P, sorted_rank_P, -1).to(torch.int32))
    block_start_B = torch.arange(num_blocks, device=device) * block_m
    expert_B = torch.searchsorted(end_E, block_start_B, right=True)
    inside_B = expert_B < num_experts
    expert_B = expert_B.clamp(max=num_experts - 1)
    slot_of_block = torch.where(inside_B, slot_of_E.long()[expert_B], -1).to(torch.int32)
    padding_before_B = first_row_E[expert_B] - first_sorted_E[expert_B]
    rank_of_block = torch.where(inside_B, block_start_B - padding_before_B, num_pairs).to(torch.int32)
    return Alignment(pair_of_row[:num_rows], slot_of_block, rank_of_block, rank_of_pair)


@triton.jit
def _keys(ids_ptr, slot_ptr, pairs, valid, E, S):
    """The sort key of each of `pairs` (those `valid`): its expert when resident (id in 0..E-1 and slot in
    0..S-1), else E."""
    expert = tl.load(ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)
    inside = valid & (expert >= 0) & (expert < E)
    slot = tl.load(slot_ptr + tl.where(inside, expert, 0), mask=inside, other=-1).to(tl.int32)
    return tl.where(inside & (slot >= 0) & (slot < S), expert, E)


@triton.jit
def _align_count(
    ids_ptr, slot_ptr, counts_ptr, pair_of_row_ptr,
    P, E, S, R, rows_per_chunk,
    CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Program c: counts[c, e] = how many of pairs c*CHUNK .. c*CHUNK + CHUNK - 1 have key e (E_PAD
    columns, those >= E unused); and its share of pair_of_row set to the sentinel P (scatter fills the
    rest)."""
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        pairs = chunk * CHUNK + s0 + tl.arange(0, SUB)
        key = _keys(ids_ptr, slot_ptr, pairs, pairs < P, E, S)
        counts += tl.sum((key[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + chunk * E_PAD + offs_e, counts)
    first = chunk * rows_per_chunk
    for r0 in range(0, rows_per_chunk, SUB * 4):
        offs_r = first + r0 + tl.arange(0, SUB * 4)
        keep = (offs_r < first + rows_per_chunk) & (offs_r < R)
        tl.store(pair_of_row_ptr + offs_r, tl.zeros([SUB * 4], dtype=tl.int32) + P, mask=keep)


@triton.jit
def _align_offsets(
    counts_ptr, slot_ptr, padding_ptr, slot_of_block_ptr, rank_of_block_ptr,
    P, E, C, B,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, TILE_C: tl.constexpr, TILE_B: tl.constexpr,
):  # fmt: skip
    """One program. Turns counts[c, e] in place into the rank of chunk c's first pair of expert e; writes
    padding[e], the padding rows before expert e's run (a pair's padded row = its rank + padding[e]); and
    each block's slot (-1 past the total) and first rank (P past the total)."""
    offs_e = tl.arange(0, E_PAD)
    real_e = offs_e < E
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, C, TILE_C):
        offs_c = c0 + tl.arange(0, TILE_C)
        mask = (offs_c < C)[:, None] & real_e[None, :]
        total += tl.sum(
            tl.load(counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :], mask=mask, other=0), 0
        )
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end_row = tl.cumsum(padded, 0)
    first_rank = tl.cumsum(total, 0) - total
    padding = end_row - padded - first_rank
    tl.store(padding_ptr + offs_e, padding)
    before = first_rank  # ranks of chunks c0 .. onwards start here, per expert
    for c0 in range(0, C, TILE_C):
        offs_c = c0 + tl.arange(0, TILE_C)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        mask = (offs_c < C)[:, None] & real_e[None, :]
        tile = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, before[None, :] + tl.cumsum(tile, 0) - tile, mask=mask)
        before += tl.sum(tile, 0)
    end_row = tl.where(real_e, end_row, 2**30)  # columns past E own no rows
    for b0 in range(0, B, TILE_B):
        offs_b = b0 + tl.arange(0, TILE_B)
        start = offs_b * BLOCK_M
        owner = end_row[None, :] <= start[:, None]  # experts whose run ends at or before the block
        expert = tl.sum(owner.to(tl.int32), 1)  # the first expert whose run ends after it (searchsorted)
        inside = expert < E
        mine = offs_e[None, :] == expert[:, None]
        rank = start - tl.sum(tl.where(mine, padding[None, :], 0), 1)
        slot = tl.load(slot_ptr + tl.where(inside, expert, 0), mask=inside, other=-1).to(tl.int32)
        tl.store(slot_of_block_ptr + offs_b, slot, mask=offs_b < B)
        tl.store(rank_of_block_ptr + offs_b, tl.where(inside, rank, P), mask=offs_b < B)


@triton.jit
def _align_scatter(
    ids_ptr, slot_ptr, base_ptr, padding_ptr, pair_of_row_ptr, rank_of_pair_ptr,
    P, E, S,
    CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Program c: each of its pairs' rank (the chunk's first rank of its expert, base[c, e], plus how many
    of the chunk's earlier pairs share the expert), into rank_of_pair (-1 when left out), and the pair
    into pair_of_row at its padded row."""
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # the chunk's pairs so far, per expert
    for s0 in range(0, CHUNK, SUB):
        pairs = chunk * CHUNK + s0 + tl.arange(0, SUB)
        valid = pairs < P
        key = _keys(ids_ptr, slot_ptr, pairs, valid, E, S)
        kept = valid & (key < E)
        hot = key[:, None] == offs_e[None, :]
        earlier = tl.cumsum(hot.to(tl.int32), 0) - 1 + seen[None, :]  # per expert, inclusive - 1
        within = tl.sum(tl.where(hot, earlier, 0), 1)
        seen += tl.sum(hot.to(tl.int32), 0)
        key_c = tl.where(kept, key, 0)
        rank = tl.load(base_ptr + chunk * E_PAD + key_c, mask=kept, other=0) + within
        row = rank + tl.load(padding_ptr + key_c, mask=kept, other=0)
        tl.store(rank_of_pair_ptr + pairs, tl.where(kept, rank, -1), mask=valid)
        tl.store(pair_of_row_ptr + row, pairs, mask=kept)


def align_by_expert_triton(
    topk_ids_TK: torch.Tensor, slot_of_E: torch.Tensor, num_slots: int, block_m: int, chunk: int = 0
) -> Alignment:
    """`align_by_expert` in three Triton launches, no host sync, every buffer sized by P, E and BLOCK_M.
    `topk_ids_TK` and `slot_of_E` contiguous. `chunk`: pairs per program (a power of two; 0 picks: 1024
    on CUDA, so that the middle launch's single program reads few rows, 8 in the interpreter, to cut the
    tests' tiny cases into several chunks)."""
    device = topk_ids_TK.device
    num_experts = slot_of_E.shape[0]
    num_pairs = topk_ids_TK.numel()
    cuda = device.type == "cuda"
    chunk = chunk or (1024 if cuda else 8)
    sub = min(chunk, 32 if cuda else 4)  # pairs per one-hot tile [SUB, E_PAD]
    e_pad = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, chunk)
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    num_rows = num_blocks * block_m
    counts_CE = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    padding_E = torch.empty((e_pad,), dtype=torch.int32, device=device)
    pair_of_row = torch.empty((num_rows,), dtype=torch.int32, device=device)
    slot_of_block = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    rank_of_block = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    rank_of_pair = torch.empty((num_pairs,), dtype=torch.int32, device=device)
    warps = 4 if e_pad <= 256 else 8
    _align_count[(num_chunks,)](
        topk_ids_TK, slot_of_E, counts_CE, pair_of_row,
        num_pairs, num_experts, num_slots, num_rows, triton.cdiv(num_rows, num_chunks),
        CHUNK=chunk, SUB=sub, E_PAD=e_pad, num_warps=warps,
    )  # fmt: skip
    _align_offsets[(1,)](
        counts_CE, slot_of_E, padding_E, slot_of_block, rank_of_block,
        num_pairs, num_experts, num_chunks, num_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, TILE_C=max(1, min(32, 8192 // e_pad)), TILE_B=max(1, min(64, 8192 // e_pad)),
        num_warps=8 if cuda else 4,
    )  # fmt: skip
    _align_scatter[(num_chunks,)](
        topk_ids_TK, slot_of_E, counts_CE, padding_E, pair_of_row, rank_of_pair,
        num_pairs, num_experts, num_slots,
        CHUNK=chunk, SUB=sub, E_PAD=e_pad, num_warps=warps,
    )  # fmt: skip
    return Alignment(pair_of_row, slot_of_block, rank_of_block, rank_of_pair)
