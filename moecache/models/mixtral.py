"""Mixtral (`mixtral`), e.g. Mixtral-8x7B: 8 experts, top-2, every layer sparse, no shared expert."""

from __future__ import annotations

from transformers import MixtralConfig

from moecache.models.adapter import MoEAdapter, config_with_overrides, register_adapter
from moecache.models.tokenizer import tiny_token_ids

TINY = {
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 32,  # Mixtral's expert width is `intermediate_size`
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    **tiny_token_ids(),
}


def tiny_config(**overrides) -> MixtralConfig:
    return config_with_overrides(MixtralConfig, TINY, overrides)


@register_adapter
class MixtralAdapter(MoEAdapter):
    model_type = "mixtral"
    tiny_config = staticmethod(tiny_config)
