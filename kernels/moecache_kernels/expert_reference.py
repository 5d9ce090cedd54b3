"""Plain torch reference of SwiGLU experts: one expert, and top-k routed experts over a weight pool.

This is the oracle the Triton kernels and the CPU executor are tested against. The weight layout is
transformers' fused one (`Qwen3_5MoeExperts` and friends): `gate_up` stacks the gate projection's rows and
then the up projection's rows, so `gate = x @ gate_up[:I].T`, `up = x @ gate_up[I:].T`,
`y = (silu(gate) * up) @ down.T`.

Numerics: those of transformers' experts, its default `grouped_mm` path, which users run. Every dot
product is a float32 sum, and every value transformers holds in x's dtype is rounded to it: the gate and
up projections, silu(gate), the activation, the down projection; the router-weighted product too when
its dtype, promote(x, weights), is x's (`rounds_product`: Qwen3.5/3.6's router hands bf16 weights,
DeepSeek-V2's float32); the K products of a token are summed in float32 and rounded once (transformers'
eager loop sums them in bf16 instead). On the CPU this reference equals grouped_mm bit for bit; a kernel
or executor following it differs only where its float32 sums, taken in another order, round differently
(docs/validation.md, "Output agreement", measures what that does to a model's logits). A float32 model
rounds nothing.

Shape legend (suffixes of tensor names):
    T tokens, H hidden size, I expert intermediate size, E experts in the pool, K experts per token (top-k).
    `2I` is the fused gate+up dimension; N the (token, slot) pairs routed to one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rounds_product(x_dtype: torch.dtype, weights_dtype: torch.dtype) -> bool:
    """Whether transformers rounds an expert's router-weighted output: its dtype, promote(x, weights), is
    narrower than float32 (bf16 x and bf16 router weights: yes; float32 router weights: no)."""
    return torch.finfo(torch.promote_types(x_dtype, weights_dtype)).bits < 32


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `t` rounded to `dtype` (nearest even), kept in float32 (exact)."""
    return t if dtype == torch.float32 else t.to(dtype).float()


def expert_forward(x_TH: torch.Tensor, gate_up_2IH: torch.Tensor, down_HI: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on T tokens, `(silu(x @ gate.T) * (x @ up.T)) @ down.T`: shape (T, H), float32,
    computed in float32 with the roundings to x's dtype of the module docstring (its values are x's
    dtype's; float32 x: nothing rounded)."""
    inter, dtype = down_HI.shape[1], x_TH.dtype
    if gate_up_2IH.shape != (2 * inter, x_TH.shape[1]) or down_HI.shape[0] != x_TH.shape[1]:
        raise ValueError(
            f"expert shapes disagree: x {tuple(x_TH.shape)}, gate_up {tuple(gate_up_2IH.shape)}"
            f" (want (2I, H)), down {tuple(down_HI.shape)} (want (H, I))"
        )
    gate_up_T2I = rounded(F.linear(x_TH.float(), gate_up_2IH.float()), dtype)
    act_TI = rounded(rounded(F.silu(gate_up_T2I[:, :inter]), dtype) * gate_up_T2I[:, inter:], dtype)
    return rounded(F.linear(act_TI, down_HI.float()), dtype)


def weighted_expert(
    x_NH: torch.Tensor,
    gate_up_2IH: torch.Tensor,
    down_HI: torch.Tensor,
    weight_N: torch.Tensor,
    round_product: bool,
) -> torch.Tensor:
    """`expert_forward` on N rows times their router weights (float32 [N]), rounded to x's dtype when
    `round_product`: each row's float32 contribution to its token's sum, [N, H]."""
    prod_NH = expert_forward(x_NH, gate_up_2IH, down_HI) * weight_N[:, None].float()
    return rounded(prod_NH, x_NH.dtype) if round_product else prod_NH


def moe_reference(
    x_TH: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    round_product: bool | None = None,
) -> torch.Tensor:
    """Top-k routed experts: `y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`, shape (T, H), x's
    dtype.

    Each expert the batch routes to runs once on the tokens that chose it (`expert_forward`); each
    weighted product is rounded to x's dtype when `round_product` (default `rounds_product` of x's and
    the weights' dtypes); the products are summed in float32 and cast to x's dtype at the end.
    """
    num_experts = gate_up_E2IH.shape[0]
    if expert_ids_TK.shape != weights_TK.shape or expert_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"routing shapes disagree: x {tuple(x_TH.shape)}, expert_ids {tuple(expert_ids_TK.shape)},"
            f" weights {tuple(weights_TK.shape)}"
        )
    if expert_ids_TK.numel() and (expert_ids_TK.min() < 0 or expert_ids_TK.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}); got {expert_ids_TK.unique().tolist()}")
    if round_product is None:
        round_product = rounds_product(x_TH.dtype, weights_TK.dtype)
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    for expert in expert_ids_TK.unique().tolist():
        token_N, slot_N = torch.where(expert_ids_TK == expert)
        weight_N = weights_TK[token_N, slot_N]
        y_TH.index_add_(
            0, token_N,
            weighted_expert(x_TH[token_N], gate_up_E2IH[expert], down_EHI[expert], weight_N, round_product),
        )  # fmt: skip
    return y_TH.to(x_TH.dtype)
