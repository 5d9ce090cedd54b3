"""Plain torch reference of the slot-pool MoE operator: the oracle `slot_moe` is tested against.

The runtime keeps only some experts on the GPU, in a pool of S slots; `slot_of_E[e]` is expert e's slot,
or -1 when it is not resident (the runtime computes those on the CPU and adds them in itself). This
reference computes what the GPU part must return: each token's router-weighted sum over its resident
experts only, each expert run through `expert_forward` (float32 sums, rounded where transformers rounds:
expert_reference.py), the products summed in float32, cast to x's dtype.

Shape legend: T tokens, H hidden, I intermediate, E experts, K top-k, S slots (`2I` = gate rows + up rows).
"""

from __future__ import annotations

import torch

from .expert_reference import rounds_product, weighted_expert


def slot_moe_reference(
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
    """`y[t] = sum over k with slot_of_E[ids[t, k]] >= 0 of weights[t, k] * expert(x[t])`, shape (T, H).

    `w13_SIH` is [S, 2I, H] (gate rows, then up rows), `w2_SHI` is [S, H, I]. As `slot_moe`: returns x's
    dtype, or writes into `out` (x's shape, x's dtype or float32: the float32 sums unrounded) and returns
    it. `round_product`: each weighted product rounded to x's dtype (default: `rounds_product` of x's and
    the weights' dtypes; a caller holding widened weights passes the router's). Raises ValueError on shapes that disagree, expert ids outside [0, E), slots outside [-1, S) or a
    bad `out`.
    """
    num_tokens, hidden = x_TH.shape
    num_experts, num_slots = slot_of_E.shape[0], w13_SIH.shape[0]
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.shape[0] != num_tokens:
        raise ValueError(
            f"routing shapes disagree: x {tuple(x_TH.shape)}, topk_ids {tuple(topk_ids_TK.shape)},"
            f" topk_weights {tuple(topk_weights_TK.shape)}"
        )
    if w2_SHI.shape[0] != num_slots or w13_SIH.shape[2] != hidden or w2_SHI.shape[1] != hidden:
        raise ValueError(f"slot pool shapes disagree: w13 {tuple(w13_SIH.shape)}, w2 {tuple(w2_SHI.shape)}")
    if topk_ids_TK.numel() and (topk_ids_TK.min() < 0 or topk_ids_TK.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}); got {topk_ids_TK.unique().tolist()}")
    if slot_of_E.numel() and (slot_of_E.min() < -1 or slot_of_E.max() >= num_slots):
        raise ValueError(f"slot_of_E must lie in [-1, {num_slots}); got {slot_of_E.unique().tolist()}")
    if out is not None and (out.shape != x_TH.shape or out.dtype not in (x_TH.dtype, torch.float32)):
        raise ValueError(
            f"out must be {tuple(x_TH.shape)} {x_TH.dtype} or float32, got {out.dtype} {tuple(out.shape)}"
        )
    if round_product is None:
        round_product = rounds_product(x_TH.dtype, topk_weights_TK.dtype)
    y_TH = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x_TH.device)
    slot_TK = slot_of_E[topk_ids_TK.long()]
    for slot in slot_TK[slot_TK >= 0].unique().tolist():
        token_N, k_N = torch.where(slot_TK == slot)
        weight_N = topk_weights_TK[token_N, k_N]
        y_TH.index_add_(
            0, token_N, weighted_expert(x_TH[token_N], w13_SIH[slot], w2_SHI[slot], weight_N, round_product)
        )
    if out is None:
        return y_TH.to(x_TH.dtype)
    return out.copy_(y_TH)
