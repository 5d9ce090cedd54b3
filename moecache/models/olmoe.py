"""OLMoE (`olmoe`), e.g. OLMoE-1B-7B: 64 experts, top-8, every layer sparse, no shared expert."""

from __future__ import annotations

from transformers import OlmoeConfig

from moecache.models.adapter import MoEAdapter, register_adapter
from moecache.models.tiny import tiny_config_maker

tiny_config = tiny_config_maker(
    OlmoeConfig,
    "OlmoeForCausalLM",
    intermediate_size=32,  # OLMoE's expert width is `intermediate_size`
    num_hidden_layers=2,
    num_key_value_heads=4,
    num_experts=16,
    num_experts_per_tok=4,
)


@register_adapter
class OlmoeAdapter(MoEAdapter):
    model_type = "olmoe"
    tiny_config = staticmethod(tiny_config)
