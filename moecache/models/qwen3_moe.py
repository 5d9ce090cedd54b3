"""Qwen3 MoE (`qwen3_moe`), e.g. Qwen3-30B-A3B: 128 experts, top-8, no shared expert.

Decoder layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, are dense.
"""

from __future__ import annotations

from transformers import Qwen3MoeConfig

from moecache.models.adapter import MoEAdapter, config_with_overrides, register_adapter
from moecache.models.tokenizer import tiny_token_ids

TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "max_position_embeddings": 4096,
    **tiny_token_ids(),
}


def tiny_config(**overrides) -> Qwen3MoeConfig:
    """Three decoder layers, the middle one dense (`mlp_only_layers=[1]`)."""
    return config_with_overrides(Qwen3MoeConfig, TINY, overrides)


@register_adapter
class Qwen3MoeAdapter(MoEAdapter):
    model_type = "qwen3_moe"
    tiny_config = staticmethod(tiny_config)
