"""Sort (token, k) pairs by expert and pad each expert's run to BLOCK_M, on the device (vLLM's
`moe_align_block_size`): the prefill path's grouping. No host sync: the number of blocks is an upper
bound fixed by P, E and BLOCK_M, and blocks past the padded total get slot -1 (they exit).

Two implementations of one result (`Alignment`), equal element for element: `align_by_expert` in torch
ops (the definition, and the tests' oracle; some 40 small launches) and `align_by_expert_triton`, four
Triton launches (count per chunk of pairs, prefix sums per expert column, blocks, scatter), which the
kernel runs.
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

# On CUDA, the count and scatter launches' programs: pairs per program about P / CHUNKS_CUDA (at T = 4096,
# top-8: 64 pairs, 512 programs). 32 programs of 1024 pairs took 82-84 us each on the H200 at Qwen3.6 /
# Qwen3-30B T = 4096, with one program's 37 us of prefix sums between (benchmarks/profile_slot_moe.py).
CHUNKS_CUDA = 512


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
def _align_columns(
    counts_ptr, totals_ptr,
    E, C,
    E_PAD: tl.constexpr, TILE_C: tl.constexpr, TILE_E: tl.constexpr,
):  # fmt: skip
    """Program j, experts j*TILE_E .. + TILE_E - 1: turns their columns counts[c, e] in place into how many
    of expert e's pairs lie in chunks before c (an exclusive prefix sum down the column), and writes
    totals[e], the expert's kept pairs."""
    offs_e = tl.program_id(0) * TILE_E + tl.arange(0, TILE_E)
    real_e = offs_e < E
    before = tl.zeros([TILE_E], dtype=tl.int32)
    for c0 in range(0, C, TILE_C):
        offs_c = c0 + tl.arange(0, TILE_C)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        mask = (offs_c < C)[:, None] & real_e[None, :]
        tile = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, before[None, :] + tl.cumsum(tile, 0) - tile, mask=mask)
        before += tl.sum(tile, 0)
    tl.store(totals_ptr + offs_e, before, mask=real_e)


@triton.jit
def _align_blocks(
    totals_ptr, slot_ptr, first_rank_ptr, padding_ptr, slot_of_block_ptr, rank_of_block_ptr,
    P, E, B,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, TILE_B: tl.constexpr,
):  # fmt: skip
    """Program j, blocks j*TILE_B .. + TILE_B - 1: from the experts' totals (each program recomputes their
    prefix sums, E_PAD values), each block's slot (-1 past the total) and first rank (P past the total);
    program 0 also writes first_rank[e], the rank of expert e's first pair, and padding[e], the padding
    rows before its run (a pair's padded row = its rank + padding[e])."""
    offs_e = tl.arange(0, E_PAD)
    real_e = offs_e < E
    total = tl.load(totals_ptr + offs_e, mask=real_e, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end_row = tl.cumsum(padded, 0)
    first_rank = tl.cumsum(total, 0) - total
    padding = end_row - padded - first_rank
    if tl.program_id(0) == 0:
        tl.store(first_rank_ptr + offs_e, first_rank)
        tl.store(padding_ptr + offs_e, padding)
    end_row = tl.where(real_e, end_row, 2**30)  # columns past E own no rows
    offs_b = tl.program_id(0) * TILE_B + tl.arange(0, TILE_B)
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
    ids_ptr, slot_ptr, base_ptr, first_rank_ptr, padding_ptr, pair_of_row_ptr, rank_of_pair_ptr,
    P, E, S,
    CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Program c: each of its pairs' rank (its expert's first rank, plus the expert's pairs in earlier
    chunks, base[c, e], plus how many of the chunk's earlier pairs share the expert), into rank_of_pair
    (-1 when left out), and the pair into pair_of_row at its padded row."""
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
        rank = (
            tl.load(first_rank_ptr + key_c, mask=kept, other=0)
            + tl.load(base_ptr + chunk * E_PAD + key_c, mask=kept, other=0)
            + within
        )
        row = rank + tl.load(padding_ptr + key_c, mask=kept, other=0)
        tl.store(rank_of_pair_ptr + pairs, tl.where(kept, rank, -1), mask=valid)
        tl.store(pair_of_row_ptr + row, pairs, mask=kept)


def align_by_expert_triton(
    topk_ids_TK: torch.Tensor, slot_of_E: torch.Tensor, num_slots: int, block_m: int, chunk: int = 0
) -> Alignment:
    """`align_by_expert` in four Triton launches, no host sync, every buffer sized by P, E and BLOCK_M:
    count each chunk's pairs per expert (a program per chunk), prefix sums down each expert's column (a
    program per TILE_E experts), each block's slot and first rank (a program per TILE_B blocks), scatter
    (a program per chunk). `topk_ids_TK` and `slot_of_E` contiguous. `chunk`: pairs per program (a power
    of two; 0 picks: on CUDA about P / CHUNKS_CUDA, within 32..1024, so the grids fill the device; 8 in the
    interpreter, to cut the tests' tiny cases into several chunks)."""
    device = topk_ids_TK.device
    num_experts = slot_of_E.shape[0]
    num_pairs = topk_ids_TK.numel()
    cuda = device.type == "cuda"
    if not chunk:
        chunk = min(1024, max(32, triton.next_power_of_2(triton.cdiv(num_pairs, CHUNKS_CUDA)))) if cuda else 8
    sub = min(chunk, 32 if cuda else 4)  # pairs per one-hot tile [SUB, E_PAD]
    e_pad = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, chunk)
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    num_rows = num_blocks * block_m
    counts_CE = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    totals_E = torch.empty((e_pad,), dtype=torch.int32, device=device)
    first_rank_E = torch.empty((e_pad,), dtype=torch.int32, device=device)
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
    tile_e = min(e_pad, 16)
    _align_columns[(e_pad // tile_e,)](
        counts_CE, totals_E,
        num_experts, num_chunks,
        E_PAD=e_pad, TILE_E=tile_e, TILE_C=min(128, triton.next_power_of_2(num_chunks)), num_warps=4,
    )  # fmt: skip
    tile_b = max(1, min(64, 8192 // e_pad))
    _align_blocks[(triton.cdiv(num_blocks, tile_b),)](
        totals_E, slot_of_E, first_rank_E, padding_E, slot_of_block, rank_of_block,
        num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, TILE_B=tile_b, num_warps=4,
    )  # fmt: skip
    _align_scatter[(num_chunks,)](
        topk_ids_TK, slot_of_E, counts_CE, first_rank_E, padding_E, pair_of_row, rank_of_pair,
        num_pairs, num_experts, num_slots,
        CHUNK=chunk, SUB=sub, E_PAD=e_pad, num_warps=warps,
    )  # fmt: skip
    return Alignment(pair_of_row, slot_of_block, rank_of_block, rank_of_pair)
