"""Inputs for the slot_moe tests: fresh random routing and slot pools with chosen residency patterns.

A case is a dict of slot_moe's six arguments. Patterns: "none" resident, "some" (about half), "all",
"one_expert" (every token routes to one resident expert), "edge_ids" (every token routes to experts 0
and E-1, both resident). Each token's K experts are distinct, as a top-k router gives.
"""

from __future__ import annotations

import torch

PATTERNS = ("none", "some", "all", "one_expert", "edge_ids")


def routing(
    num_tokens: int, num_experts: int, top_k: int, pattern: str, gen: torch.Generator
) -> torch.Tensor:
    """[T, K] distinct expert ids per token; the first columns fixed by the pattern."""
    ids_TK = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    fixed = {"one_expert": [3 % num_experts], "edge_ids": [0, num_experts - 1]}.get(pattern, [])
    for col, expert in enumerate(fixed):
        for t in range(num_tokens):
            row = ids_TK[t]
            if expert in row.tolist():  # swap it into place, keeping the row distinct
                row[row == expert] = row[col].clone()
            row[col] = expert
    return ids_TK


def slot_map(num_experts: int, num_slots: int, pattern: str, ids_TK: torch.Tensor, gen) -> torch.Tensor:
    """[E] int32 slot of each expert, -1 = not resident; the pattern's fixed experts are resident."""
    slot_of_E = torch.full((num_experts,), -1, dtype=torch.int32)
    if pattern == "none":
        return slot_of_E
    count = num_slots if pattern == "all" else max(1, min(num_slots, num_experts // 2))
    if pattern == "all" and num_slots < num_experts:
        raise ValueError("pattern 'all' needs a slot for every expert")
    experts = torch.randperm(num_experts, generator=gen)[:count]
    must = {"one_expert": [3 % num_experts], "edge_ids": [0, num_experts - 1]}.get(pattern, [])
    experts = torch.tensor(must + [e for e in experts.tolist() if e not in must][: count - len(must)])
    slot_of_E[experts] = torch.randperm(num_slots, generator=gen)[: len(experts)].to(torch.int32)
    return slot_of_E


def make_case(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, num_slots: int,
    pattern: str, dtype: torch.dtype, seed: int, device: str = "cpu",
) -> dict:  # fmt: skip
    """slot_moe's arguments for one test, drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    ids_TK = routing(num_tokens, num_experts, top_k, pattern, gen)
    slot_of_E = slot_map(num_experts, num_slots if pattern != "all" else num_experts, pattern, ids_TK, gen)
    slots = max(num_slots, int(slot_of_E.max()) + 1)
    scale_13, scale_2 = hidden**-0.5, inter**-0.5
    big = torch.Generator(device).manual_seed(seed)  # the slot pool is drawn where it lives (fast on CUDA)
    case = {
        "x_TH": torch.randn(num_tokens, hidden, generator=big, device=device),
        "topk_ids_TK": ids_TK,
        "topk_weights_TK": torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1),
        "slot_of_E": slot_of_E,
        "w13_SIH": torch.randn(slots, 2 * inter, hidden, generator=big, device=device) * scale_13 * 2,
        "w2_SHI": torch.randn(slots, hidden, inter, generator=big, device=device) * scale_2,
    }
    floats = ("x_TH", "topk_weights_TK", "w13_SIH", "w2_SHI")
    return {k: (v.to(dtype) if k in floats else v).to(device) for k, v in case.items()}


def out_of_range_case(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, num_slots: int,
    dtype: torch.dtype, seed: int, device: str = "cpu",
) -> tuple[dict, dict]:  # fmt: skip
    """(case, its meaning): a "some" case whose routing also holds ids -1 and E and an expert whose slot
    is S (all three must count as not resident), and the same case with those entries' router weights
    zeroed and their ids/slot made valid (what slot_moe_reference, which refuses such values, can run)."""
    if num_tokens < 2 or top_k < 2:
        raise ValueError("out_of_range_case needs two tokens and top-k of at least two")
    case = make_case(num_tokens, hidden, inter, num_experts, top_k, num_slots, "some", dtype, seed, device)
    ids_TK, slot_of_E = case["topk_ids_TK"].clone(), case["slot_of_E"].clone()
    bad_TK = torch.zeros(ids_TK.shape, dtype=torch.bool, device=ids_TK.device)
    ids_TK[0, 0], ids_TK[1, 0] = -1, num_experts  # ids outside [0, E)
    bad_TK[0, 0] = bad_TK[1, 0] = True
    expert = int(ids_TK[0, 1])
    slot_of_E[expert] = case["w13_SIH"].shape[0]  # a slot outside [0, S)
    bad_TK |= ids_TK == expert
    meant = dict(case)
    meant["topk_ids_TK"] = torch.where(bad_TK, 0, ids_TK)
    meant["topk_weights_TK"] = torch.where(bad_TK, 0, case["topk_weights_TK"])
    meant["slot_of_E"] = torch.where(
        torch.arange(num_experts, device=slot_of_E.device) == expert, -1, slot_of_E
    )
    case["topk_ids_TK"], case["slot_of_E"] = ids_TK, slot_of_E
    return case, meant
