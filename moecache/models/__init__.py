"""Model adapters (one per Hugging Face MoE `model_type`), the tiny byte tokenizer, and model loading.

Importing this package registers every adapter in `ADAPTERS`.
"""

from moecache.models import deepseek_v2, mixtral, olmoe, qwen3_5_moe, qwen3_moe  # noqa: F401  (register)
from moecache.models.adapter import (
    ADAPTERS,
    MoEAdapter,
    MoELayer,
    adapter_class,
    adapter_for,
    find_decoder_layers,
    register_adapter,
    supported_model_types,
)
from moecache.models.loading import LoadedModel, build_tiny, load_model, weights_revision
from moecache.models.tokenizer import build_byte_tokenizer

__all__ = [
    "ADAPTERS",
    "LoadedModel",
    "MoEAdapter",
    "MoELayer",
    "adapter_class",
    "adapter_for",
    "build_byte_tokenizer",
    "build_tiny",
    "find_decoder_layers",
    "load_model",
    "register_adapter",
    "supported_model_types",
    "weights_revision",
]
