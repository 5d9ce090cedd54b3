"""What the adapters' tiny random configs (`MoEAdapter.tiny_config`: tests, `model=tiny`) share."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from moecache.models.adapter import config_with_overrides
from moecache.models.tokenizer import tiny_token_ids


def tiny_text_fields(**fields) -> dict:
    """The config fields of a tiny language model: the byte tokenizer's token ids in a vocabulary of 320,
    a residual stream 64 wide with 4 attention heads, 4096 positions; then the architecture's `fields`."""
    return {
        "vocab_size": 320,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        **tiny_token_ids(),
        **fields,
    }


def tiny_config_maker(
    config_class: type[PretrainedConfig], architecture: str, **fields
) -> Callable[..., PretrainedConfig]:
    """The `tiny_config(**overrides)` of an architecture whose config is `config_class`: a config of
    the tiny text fields with the architecture's `fields` (tiny_text_fields), then `overrides` (a key
    the config class does not know is refused: config_with_overrides)."""
    defaults = {"architectures": [architecture], **tiny_text_fields(**fields)}

    def tiny_config(**overrides) -> PretrainedConfig:
        return config_with_overrides(config_class, defaults, overrides)

    return tiny_config
