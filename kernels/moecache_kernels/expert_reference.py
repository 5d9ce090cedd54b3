"""Plain torch reference of SwiGLU experts: one expert, and top-k routed experts over a weight pool.

This is the oracle the Triton kernels are tested against. The weight layout is transformers' fused one
(`Qwen3_5MoeExperts` and friends): `gate_up` stacks the gate projection's rows and then the up
projection's rows, so `gate = x @ gate_up[:I].T`, `up = x @ gate_up[I:].T`, `y = (silu(gate) * up) @ down.T`.

Shape legend (suffixes of tensor names):
    T tokens, H hidden size, I expert intermediate size, E experts in the pool, K experts per token (top-k).
    `2I` is the fused gate+up dimension; N the (token, slot) pairs routed to one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_forward(
    x_TH: torch.Tensor,
    gate_up_2IH: torch.Tensor,
    down_HI: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One SwiGLU expert on T tokens: `(silu(x @ gate.T) * (x @ up.T)) @ down.T`, shape (T, H).

    With `compute_dtype` (e.g. torch.float32) the inputs are up-cast for the arithmetic and the result is
    cast back to `x_TH.dtype`; otherwise everything runs in the tensors' own dtype.
    """
    out_dtype = x_TH.dtype
    if compute_dtype is not None:
        x_TH, gate_up_2IH, down_HI = (t.to(compute_dtype) for t in (x_TH, gate_up_2IH, down_HI))
    inter = down_HI.shape[1]
    if gate_up_2IH.shape != (2 * inter, x_TH.shape[1]) or down_HI.shape[0] != x_TH.shape[1]:
        raise ValueError(
            f"expert shapes disagree: x {tuple(x_TH.shape)}, gate_up {tuple(gate_up_2IH.shape)}"
            f" (want (2I, H)), down {tuple(down_HI.shape)} (want (H, I))"
        )
    gate_up_T2I = F.linear(x_TH, gate_up_2IH)
    act_TI = F.silu(gate_up_T2I[:, :inter]) * gate_up_T2I[:, inter:]
    return F.linear(act_TI, down_HI).to(out_dtype)


def moe_reference(
    x_TH: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Top-k routed experts: `y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`, shape (T, H).

    Each expert the batch routes to runs once on the tokens that chose it. Contributions are summed in
    float32 (or `compute_dtype`) and cast to `x_TH.dtype` at the end.
    """
    num_experts = gate_up_E2IH.shape[0]
    if expert_ids_TK.shape != weights_TK.shape or expert_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"routing shapes disagree: x {tuple(x_TH.shape)}, expert_ids {tuple(expert_ids_TK.shape)},"
            f" weights {tuple(weights_TK.shape)}"
        )
    if expert_ids_TK.numel() and (expert_ids_TK.min() < 0 or expert_ids_TK.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}); got {expert_ids_TK.unique().tolist()}")
    acc_dtype = compute_dtype or torch.float32
    y_TH = torch.zeros(x_TH.shape, dtype=acc_dtype, device=x_TH.device)
    for expert in expert_ids_TK.unique().tolist():
        token_N, slot_N = torch.where(expert_ids_TK == expert)
        out_NH = expert_forward(x_TH[token_N], gate_up_E2IH[expert], down_EHI[expert], compute_dtype)
        y_TH.index_add_(0, token_N, out_NH.to(acc_dtype) * weights_TK[token_N, slot_N, None].to(acc_dtype))
    return y_TH.to(x_TH.dtype)
