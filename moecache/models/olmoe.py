"""OLMoE (`olmoe`), e.g. OLMoE-1B-7B: 64 experts, top-8, every layer sparse, no shared expert."""

from __future__ import annotations

from transformers import OlmoeConfig

from moecache.models.adapter import MoEAdapter, config_with_overrides, register_adapter
from moecache.models.tokenizer import tiny_token_ids

TINY = {
    "architectures": ["OlmoeForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 32,  # OLMoE's expert width is `intermediate_size`
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 4096,
    **tiny_token_ids(),
}


def tiny_config(**overrides) -> OlmoeConfig:
    return config_with_overrides(OlmoeConfig, TINY, overrides)


@register_adapter
class OlmoeAdapter(MoEAdapter):
    model_type = "olmoe"
    tiny_config = staticmethod(tiny_config)
