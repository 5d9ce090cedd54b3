"""Adapters over tiny random models of every supported architecture: the architecture numbers, the
expert weights as views of the model's parameters, and the routing seen at each router against an
independent recomputation (softmax(x @ W.T), top-k).

Shapes: T tokens, E experts, H hidden, I intermediate, K top-k.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from moecache.errors import MoecacheError
from moecache.models import ADAPTERS, MoEAdapter, adapter_for, register_adapter, supported_model_types
from moecache.models.adapter import find_decoder_layers

# (model_type, form): qwen3_5_moe both as its checkpoint's ConditionalGeneration wrapper and as the
# text-only CausalLM that AutoModelForCausalLM gives.
FORMS = [
    ("qwen3_5_moe", "conditional_generation"),
    ("qwen3_5_moe", "causal_lm"),
    ("qwen3_moe", "causal_lm"),
    ("mixtral", "causal_lm"),
    ("olmoe", "causal_lm"),
    ("deepseek_v2", "causal_lm"),
]

# What each tiny config must give: only the sparse decoder layers count as MoE layers.
EXPECTED = {
    "qwen3_5_moe": dict(num_layers=4, num_experts=32, top_k=4, shared=32, model_layer_indices=[0, 1, 2, 3]),
    "qwen3_moe": dict(num_layers=2, num_experts=16, top_k=4, shared=None, model_layer_indices=[0, 2]),
    "mixtral": dict(num_layers=2, num_experts=8, top_k=2, shared=None, model_layer_indices=[0, 1]),
    "olmoe": dict(num_layers=2, num_experts=16, top_k=4, shared=None, model_layer_indices=[0, 1]),
    "deepseek_v2": dict(num_layers=2, num_experts=16, top_k=4, shared=64, model_layer_indices=[1, 2]),
}
HIDDEN, INTER = 64, 32


def tiny_model(model_type: str, form: str) -> nn.Module:
    config = ADAPTERS[model_type].tiny_config()
    torch.manual_seed(0)
    if form == "causal_lm" and model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForCausalLM(config.text_config).eval()
    return getattr(transformers, config.architectures[0])(config).eval()


@pytest.fixture(scope="module", params=FORMS, ids=[f"{t}-{f}" for t, f in FORMS])
def model_and_adapter(request) -> tuple[str, nn.Module, MoEAdapter]:
    model_type, form = request.param
    model = tiny_model(model_type, form)
    return model_type, model, adapter_for(model)


def test_registry_lists_all_supported_types():
    assert supported_model_types() == [
        "deepseek_v2",
        "mixtral",
        "olmoe",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_moe",
    ]
    assert ADAPTERS["qwen3_5_moe_text"] is ADAPTERS["qwen3_5_moe"]


def test_architecture_numbers(model_and_adapter):
    model_type, _, adapter = model_and_adapter
    expected = EXPECTED[model_type]
    assert type(adapter).model_type == model_type
    assert adapter.num_layers == expected["num_layers"]
    assert adapter.num_experts == expected["num_experts"]
    assert adapter.top_k == expected["top_k"]
    assert adapter.hidden_size == HIDDEN
    assert adapter.moe_intermediate_size == INTER
    assert adapter.expert_bytes == 3 * HIDDEN * INTER * 4  # float32
    described = adapter.describe()
    assert json.loads(json.dumps(described)) == described
    assert described["model_layer_indices"] == expected["model_layer_indices"]
    assert described["has_shared_experts"] is (expected["shared"] is not None)
    assert described["shared_expert_intermediate_size"] == expected["shared"]


def test_moe_layers_are_ordered_and_stable(model_and_adapter):
    _, _, adapter = model_and_adapter
    layers = adapter.moe_layers()
    assert [layer.layer_id for layer in layers] == list(range(adapter.num_layers))
    assert adapter.moe_layers() == layers
    for layer in layers:
        assert layer.router is layer.block.gate and layer.experts is layer.block.experts
        assert (layer.shared_experts is not None) == adapter.describe()["has_shared_experts"]


def test_expert_weights_are_views_in_canonical_layout(model_and_adapter):
    _, _, adapter = model_and_adapter
    E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
    for layer in adapter.moe_layers():
        gate_up_EIH, down_EHI = adapter.expert_weights(layer.layer_id)
        assert gate_up_EIH.shape == (E, 2 * inter, H)
        assert down_EHI.shape == (E, H, inter)
        assert gate_up_EIH.data_ptr() == layer.experts.gate_up_proj.data_ptr()
        assert down_EHI.data_ptr() == layer.experts.down_proj.data_ptr()
        with torch.no_grad():  # a write through the view lands in the model
            layer.experts.down_proj[0, 0, 0] += 1.0
        assert down_EHI[0, 0, 0] == layer.experts.down_proj[0, 0, 0]


def test_router_hook_routing_matches_recomputation(model_and_adapter):
    model_type, model, adapter = model_and_adapter
    seen_inputs: dict[int, torch.Tensor] = {}
    seen_routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for layer in adapter.moe_layers():

        def pre_hook(module, args, layer_id=layer.layer_id):
            seen_inputs[layer_id] = args[0].detach().clone()

        def hook(module, args, output, layer_id=layer.layer_id):
            seen_routing[layer_id] = adapter.routing(output)

        handles += [
            layer.router.register_forward_pre_hook(pre_hook),
            layer.router.register_forward_hook(hook),
        ]
    input_ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()

    assert sorted(seen_routing) == list(range(adapter.num_layers))
    for layer in adapter.moe_layers():
        weights_TK, expert_ids_TK = seen_routing[layer.layer_id]
        assert weights_TK.is_floating_point() and not expert_ids_TK.is_floating_point()
        weights_TK, expert_ids_TK = weights_TK.float(), expert_ids_TK.long()
        assert weights_TK.shape == expert_ids_TK.shape == (input_ids.numel(), adapter.top_k)

        x_TH = seen_inputs[layer.layer_id].reshape(-1, adapter.hidden_size).float()
        probs_TE = F.linear(x_TH, layer.router.weight.float()).softmax(dim=-1)
        expected_ids_TK = probs_TE.topk(adapter.top_k, dim=-1).indices
        if model_type == "deepseek_v2":  # its router's topk is unsorted: compare as sets per token
            assert torch.equal(expert_ids_TK.sort(dim=-1).values, expected_ids_TK.sort(dim=-1).values)
        else:
            assert torch.equal(expert_ids_TK, expected_ids_TK)
        # The weights are the chosen experts' probabilities up to one per-token factor (normalisation or scaling).
        ratio_TK = weights_TK / probs_TE.gather(-1, expert_ids_TK)
        torch.testing.assert_close(ratio_TK, ratio_TK[:, :1].expand_as(ratio_TK))


def test_unknown_model_type_lists_supported():
    model = nn.Module()
    model.config = SimpleNamespace(model_type="llama")
    with pytest.raises(MoecacheError, match=r"'llama' is not supported \(supported: deepseek_v2, mixtral"):
        adapter_for(model)


def test_registering_a_taken_model_type_is_refused():
    class Other(MoEAdapter):
        model_type = "mixtral"

    with pytest.raises(ValueError, match="mixtral"):
        register_adapter(Other)
    assert ADAPTERS["mixtral"] is not Other


def test_tiny_config_refuses_unknown_override_keys():
    with pytest.raises(MoecacheError, match=r"model\.build\.overrides\.num_expertz is not a field"):
        ADAPTERS["qwen3_moe"].tiny_config(num_expertz=4)
    with pytest.raises(MoecacheError, match=r"model\.build\.overrides\.vision_config\.depthh"):
        ADAPTERS["qwen3_5_moe"].tiny_config(vision_config={"depthh": 2})


def test_qwen3_5_moe_tiny_config_is_a_full_conditional_generation_config():
    config = ADAPTERS["qwen3_5_moe"].tiny_config(num_experts=8)
    assert config.model_type == "qwen3_5_moe"
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert config.text_config.num_experts == 8
    assert set(config.text_config.layer_types) == {"linear_attention", "full_attention"}
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size


def test_logit_lens_modules(model_and_adapter):
    """The decoder layer of each MoE layer, the final norm and the LM head: the lens of the final
    norm's input is exactly the model's own top-1 next token."""
    _, model, adapter = model_and_adapter
    decoder_layers = find_decoder_layers(model)
    for layer in adapter.moe_layers():
        assert layer.decoder_layer is decoder_layers[layer.model_layer_index]
        assert layer.block is layer.decoder_layer.mlp
    seen = {}
    handle = adapter.final_norm().register_forward_pre_hook(
        lambda module, args: seen.__setitem__("x", args[0].detach().clone())
    )
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        handle.remove()
    lens_T = adapter.lens_tokens(seen["x"].reshape(-1, adapter.hidden_size))
    assert lens_T.dtype == torch.int64
    assert torch.equal(lens_T, logits.reshape(-1, logits.shape[-1]).argmax(dim=-1))


def test_a_bare_text_model_has_no_lm_head():
    config = ADAPTERS["mixtral"].tiny_config()
    adapter = adapter_for(transformers.MixtralModel(config).eval())
    with pytest.raises(MoecacheError, match="no LM head"):
        adapter.lm_head()
