"""Sort (token, k) pairs by expert and pad each expert's run to BLOCK_M, on the device (vLLM's
`moe_align_block_size`, in torch ops): the prefill path's grouping. No host sync: the number of blocks
is an upper bound fixed by P, E and BLOCK_M, and blocks past the padded total get slot -1 (they exit).

Legend: P = T*K pairs, E experts, B blocks of BLOCK_M sorted pairs.
"""

from __future__ import annotations

import torch


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks: each expert that is routed to pads at most BLOCK_M - 1 rows."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m)


def align_by_expert(
    topk_ids_TK: torch.Tensor, slot_of_E: torch.Tensor, num_slots: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_of_row_R, slot_of_block_B): R = B * BLOCK_M rows of pair indices sorted by expert, each
    expert's run padded to a multiple of BLOCK_M with the sentinel P; and each block's slot, -1 for
    blocks past the total. Pairs of non-resident experts (slot -1, or ids/slots out of range) are left out.
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
    row_P = torch.where(key_sorted_P < num_experts, first_row_E[expert_P] + rank_P, num_rows)
    pair_of_row = torch.full((num_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    pair_of_row.scatter_(0, row_P, order_P.to(torch.int32))  # left-out pairs land on the spare last row
    block_start_B = torch.arange(num_blocks, device=device) * block_m
    expert_B = torch.searchsorted(end_E, block_start_B, right=True)
    slot_of_block = torch.where(
        expert_B < num_experts, slot_of_E.long()[expert_B.clamp(max=num_experts - 1)], -1
    ).to(torch.int32)
    return pair_of_row[:num_rows], slot_of_block
