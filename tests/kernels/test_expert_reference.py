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


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_bf16_reference_rounds_as_transformers_default_path(impl: str, weights_dtype) -> None:
    """In bf16 the reference is transformers' batched/grouped path (the default) up to fp32 summation
    order: its mean distance to it is under 5% of the distance between that path and transformers'
    own eager loop. Computed without the intermediate roundings (fp32 throughout, rounded once) it is
    not. Router weights in bf16 (Qwen3.5/3.6) round the weighted products; in float32 (DeepSeek-V2)
    they do not."""
    h, inter, e, k, t = 256, 128, 8, 4, 64
    config = Qwen3_5MoeTextConfig(
        hidden_size=h, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=k
    )
    torch.manual_seed(0)
    experts = Qwen3_5MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=h**-0.5)
        experts.down_proj.normal_(std=inter**-0.5)
    experts = experts.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x_TH = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    weights_TK, ids_TK = torch.softmax(torch.randn(t, e, generator=gen), -1).topk(k, dim=-1)
    weights_TK = weights_TK.to(weights_dtype)
    outputs = {}
    for name in (impl, "eager"):
        config._experts_implementation = name
        with torch.no_grad():
            outputs[name] = experts(x_TH, ids_TK, weights_TK).float()
    gate_up_E2IH, down_EHI = experts.gate_up_proj.detach(), experts.down_proj.detach()
    got_TH = moe_reference(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI).float()
    unrounded_TH = (
        moe_reference(x_TH.float(), ids_TK, weights_TK.float(), gate_up_E2IH.float(), down_EHI.float())
        .to(torch.bfloat16)
        .float()
    )
    want_TH = outputs[impl]
    between = float((outputs["eager"] - want_TH).abs().mean())
    assert between > 0
    assert float((got_TH - want_TH).abs().mean()) < 0.05 * between
    assert float((unrounded_TH - want_TH).abs().mean()) > 0.3 * between


def test_bad_expert_id_is_rejected() -> None:
    experts = _experts("eager")
    x_TH, expert_ids_TK, weights_TK = _routing()
    expert_ids_TK[0, 0] = E
    with pytest.raises(ValueError, match="expert ids"):
        moe_reference(
            x_TH, expert_ids_TK, weights_TK, experts.gate_up_proj.detach(), experts.down_proj.detach()
        )
