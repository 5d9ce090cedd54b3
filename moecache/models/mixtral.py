"""Mixtral (`mixtral`), e.g. Mixtral-8x7B: 8 experts, top-2, every layer sparse, no shared expert."""

from __future__ import annotations

from transformers import MixtralConfig

from moecache.models.adapter import MoEAdapter, register_adapter
from moecache.models.tiny import tiny_config_maker

tiny_config = tiny_config_maker(
    MixtralConfig,
    "MixtralForCausalLM",
    intermediate_size=32,  # Mixtral's expert width is `intermediate_size`
    num_hidden_layers=2,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
)


@register_adapter
class MixtralAdapter(MoEAdapter):
    model_type = "mixtral"
    tiny_config = staticmethod(tiny_config)
