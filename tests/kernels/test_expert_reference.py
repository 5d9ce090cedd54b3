"""The torch reference of SwiGLU experts against transformers' own Qwen3.5-MoE experts module."""

from __future__ import annotations

import pytest
import torch
from moecache_kernels import expert_forward, moe_reference
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

H, INTER, E, K, T = 32, 16, 8, 2, 11


def _experts(impl: str | None) -> Qwen3_5MoeExperts:
    config = Qwen3_5MoeTextConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    experts = Qwen3_5MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.2)
        experts.down_proj.normal_(std=0.2)
    return experts


def _routing(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(T, H, generator=gen)
    scores_TE = torch.randn(T, E, generator=gen)
    weights_TK, expert_ids_TK = torch.softmax(scores_TE, dim=-1).topk(K, dim=-1)
    return x_TH, expert_ids_TK, weights_TK


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_moe_reference_matches_transformers(impl: str) -> None:
    experts = _experts(impl)
    x_TH, expert_ids_TK, weights_TK = _routing()
    with torch.no_grad():
        want_TH = experts(x_TH, expert_ids_TK, weights_TK)
    got_TH = moe_reference(
        x_TH, expert_ids_TK, weights_TK, experts.gate_up_proj.detach(), experts.down_proj.detach()
    )
    torch.testing.assert_close(got_TH, want_TH, rtol=1e-5, atol=1e-5)


def test_expert_forward_is_one_expert_with_weight_one() -> None:
    experts = _experts("eager")
    x_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    expert_ids_TK = torch.full((T, 1), 3)
    weights_TK = torch.ones(T, 1)
    with torch.no_grad():
        want_TH = experts(x_TH, expert_ids_TK, weights_TK)
        got_TH = expert_forward(x_TH, experts.gate_up_proj[3], experts.down_proj[3])
    torch.testing.assert_close(got_TH, want_TH, rtol=1e-5, atol=1e-5)


def test_gate_is_the_first_half_of_gate_up() -> None:
    gen = torch.Generator().manual_seed(3)
    x_TH, gate_IH, up_IH, down_HI = (
        torch.randn(*s, generator=gen) for s in ((T, H), (INTER, H), (INTER, H), (H, INTER))
    )
    want_TH = (torch.nn.functional.silu(x_TH @ gate_IH.T) * (x_TH @ up_IH.T)) @ down_HI.T
    got_TH = expert_forward(x_TH, torch.cat([gate_IH, up_IH]), down_HI)
    torch.testing.assert_close(got_TH, want_TH, rtol=1e-5, atol=1e-5)


def test_bf16_with_fp32_compute_is_close_to_fp32() -> None:
    experts = _experts("eager")
    x_TH, expert_ids_TK, weights_TK = _routing(seed=4)
    gate_up_E2IH, down_EHI = experts.gate_up_proj.detach(), experts.down_proj.detach()
    want_TH = moe_reference(x_TH, expert_ids_TK, weights_TK, gate_up_E2IH, down_EHI)
    bf16 = [t.to(torch.bfloat16) for t in (x_TH, weights_TK, gate_up_E2IH, down_EHI)]
    got_TH = moe_reference(bf16[0], expert_ids_TK, bf16[1], bf16[2], bf16[3], compute_dtype=torch.float32)
    assert got_TH.dtype == torch.bfloat16
    torch.testing.assert_close(got_TH.float(), want_TH, rtol=0.05, atol=0.05)


def test_bad_expert_id_is_rejected() -> None:
    experts = _experts("eager")
    x_TH, expert_ids_TK, weights_TK = _routing()
    expert_ids_TK[0, 0] = E
    with pytest.raises(ValueError, match="expert ids"):
        moe_reference(
            x_TH, expert_ids_TK, weights_TK, experts.gate_up_proj.detach(), experts.down_proj.detach()
        )
