"""DeepSeek-V2 (`deepseek_v2`), e.g. DeepSeek-V2-Lite: 64 routed experts, top-6, two shared experts.

The first `first_k_dense_replace` decoder layers are dense. The router's top-k is unsorted
(`torch.topk(..., sorted=False)`), so expert ids within a token come in no particular order.
"""

from __future__ import annotations

from transformers import DeepseekV2Config

from moecache.models.adapter import MoEAdapter, config_with_overrides, register_adapter
from moecache.models.tokenizer import tiny_token_ids

TINY = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,  # the dense layers' MLP
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 16,
    "n_shared_experts": 2,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "topk_method": "greedy",
    "max_position_embeddings": 4096,
    **tiny_token_ids(),
}


def tiny_config(**overrides) -> DeepseekV2Config:
    """Three decoder layers, the first dense (`first_k_dense_replace=1`), as in DeepSeek-V2-Lite."""
    return config_with_overrides(DeepseekV2Config, TINY, overrides)


@register_adapter
class DeepseekV2Adapter(MoEAdapter):
    model_type = "deepseek_v2"
    shared_experts_attr = "shared_experts"
    tiny_config = staticmethod(tiny_config)
