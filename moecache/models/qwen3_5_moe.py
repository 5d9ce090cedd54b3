"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`), e.g. Qwen3.6-35B-A3B.

A hybrid decoder (three Gated-DeltaNet linear-attention layers, then one full-attention layer), every
layer sparse: 256 routed experts, top-8, plus one sigmoid-gated shared expert (`shared_expert`, gated
by `shared_expert_gate`). Checkpoints are vision-language `Qwen3_5MoeForConditionalGeneration`
models whose text decoder sits at `model.language_model`; `AutoModelForCausalLM` loads only that text
part as `Qwen3_5MoeForCausalLM` (model_type `qwen3_5_moe_text`).
"""

from __future__ import annotations

from dataclasses import fields

from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5MoeVisionConfig

from moecache.models.adapter import MoEAdapter, config_with_overrides, register_adapter
from moecache.models.tokenizer import tiny_token_ids

FULL_ATTENTION_INTERVAL = 4  # as in the real checkpoint: every fourth layer is full attention
PARTIAL_ROTARY_FACTOR = 0.25

TINY_TEXT = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    **tiny_token_ids(),
}
TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_position_embeddings": 64,
}


def _layer_types(num_layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def _rope_parameters(head_dim: int) -> dict:
    """Interleaved multimodal RoPE over a quarter of each head, split in three as [11, 11, 10] is for 256."""
    half = int(head_dim * PARTIAL_ROTARY_FACTOR) // 2
    section = [half // 3 + (i < half % 3) for i in range(3)]
    return {
        "mrope_interleaved": True,
        "mrope_section": section,
        "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        "rope_theta": 10_000_000,
        "rope_type": "default",
    }


def tiny_config(**overrides) -> Qwen3_5MoeConfig:
    """A tiny ConditionalGeneration config, like the real checkpoint's.

    Override keys go to `text_config`, except the wrapper's own fields (e.g. `image_token_id`) and
    `vision_config` (a dict merged into the tiny vision config).
    """
    outer_fields = {f.name for f in fields(Qwen3_5MoeConfig)} - {"text_config", "vision_config"}
    outer = {k: v for k, v in overrides.items() if k in outer_fields}
    vision_overrides = dict(overrides.get("vision_config") or {})
    text_overrides = {k: v for k, v in overrides.items() if k not in outer_fields and k != "vision_config"}

    text_defaults = dict(TINY_TEXT)
    num_layers = text_overrides.get("num_hidden_layers", text_defaults["num_hidden_layers"])
    text_defaults["layer_types"] = _layer_types(num_layers)
    text_defaults["rope_parameters"] = _rope_parameters(
        text_overrides.get("head_dim", text_defaults["head_dim"])
    )
    text = config_with_overrides(Qwen3_5MoeTextConfig, text_defaults, text_overrides)

    vision_defaults = {**TINY_VISION, "out_hidden_size": text.hidden_size}
    vision = config_with_overrides(
        Qwen3_5MoeVisionConfig, vision_defaults, vision_overrides, key="model.build.overrides.vision_config"
    )
    vocab = text.vocab_size
    outer_defaults = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "vision_start_token_id": vocab - 4,
        "vision_end_token_id": vocab - 3,
        "image_token_id": vocab - 2,
        "video_token_id": vocab - 1,
        "text_config": text,
        "vision_config": vision,
    }
    return config_with_overrides(Qwen3_5MoeConfig, outer_defaults, outer)


@register_adapter
class Qwen3_5MoeAdapter(MoEAdapter):
    model_type = "qwen3_5_moe"
    aliases = ("qwen3_5_moe_text",)
    shared_experts_attr = "shared_expert"
    tiny_config = staticmethod(tiny_config)
