"""One interface over the sparse MoE blocks of Hugging Face models.

In transformers 5 every supported MoE model has the same shape: a decoder layer's `.mlp` is a sparse
MoE block with `.gate` (the router; its forward returns `(router_logits, routing_weights_TK,
selected_experts_TK)`) and `.experts` (parameters `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`).
Dense decoder layers (a plain MLP) are skipped. A per-model adapter only names its model type, its
shared-expert module and a tiny config for tests; everything else lives here.

The logit lens (moecache/trace/lens.py) reads the residual stream entering each MoE layer's decoder
layer (`MoELayer.decoder_layer`) and projects it through the text decoder's final norm (`.norm`) and
the LM head (`get_output_embeddings()`): `lens_tokens`. Every supported model computes its logits as
`lm_head(norm(hidden))`, with no scaling or soft-capping, so the lens is exact at the last layer.

Shapes: T tokens, E experts, H hidden, I (MoE) intermediate, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import PretrainedConfig

from moecache.errors import MoecacheError


@dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of the model."""

    layer_id: int  # ordinal among the MoE layers, 0..num_layers-1
    model_layer_index: int  # index of its decoder layer in the model
    block: nn.Module  # the sparse MoE block (`decoder_layer.mlp`)
    router: nn.Module  # the hook point: its forward output carries the routing
    experts: nn.Module  # holds gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    shared_experts: nn.Module | None  # always-active expert MLP, if the model has one
    decoder_layer: nn.Module  # the decoder layer holding the block; its input is the residual stream


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers of a CausalLM, a bare text model or a ConditionalGeneration wrapper."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise MoecacheError(
            f"{type(model).__name__}: found no text decoder layers (no `.layers` on its decoder)"
        )
    return layers


def is_moe_block(block: nn.Module | None) -> bool:
    """A sparse MoE block: a router at `.gate` and 3-D expert weights at `.experts`."""
    experts = getattr(block, "experts", None)
    return (
        block is not None
        and isinstance(getattr(block, "gate", None), nn.Module)
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


class MoEAdapter:
    """The MoE structure of one loaded model. Subclasses register one per HF `model_type`."""

    model_type: ClassVar[str]
    # Further HF model_type values that share this structure (e.g. a text-only variant).
    aliases: ClassVar[tuple[str, ...]] = ()
    # Attribute of the MoE block holding the shared-expert MLP, if the model has one.
    shared_experts_attr: ClassVar[str | None] = None
    # `tiny_config(**overrides)`: a tiny random config of this architecture, for tests and `model=tiny`.
    tiny_config: ClassVar[Callable[..., PretrainedConfig]]

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers: list[MoELayer] = []
        for index, decoder_layer in enumerate(find_decoder_layers(model)):
            block = getattr(decoder_layer, "mlp", None)
            if not is_moe_block(block):
                continue
            shared = getattr(block, self.shared_experts_attr) if self.shared_experts_attr else None
            self._layers.append(
                MoELayer(
                    layer_id=len(self._layers),
                    model_layer_index=index,
                    block=block,
                    router=block.gate,
                    experts=block.experts,
                    shared_experts=shared,
                    decoder_layer=decoder_layer,
                )
            )
        if not self._layers:
            raise MoecacheError(
                f"{type(model).__name__} ({self.model_type}): no decoder layer has a sparse MoE block"
            )

        gate_up_EIH, down_EHI = self.expert_weights(0)
        self.num_experts, two_i, self.hidden_size = gate_up_EIH.shape
        self.moe_intermediate_size = two_i // 2
        self.top_k = int(self._layers[0].router.top_k)
        self.expert_params = (gate_up_EIH.numel() + down_EHI.numel()) // self.num_experts
        for layer in self._layers[1:]:
            self._check_same_shape(layer)

    def _check_same_shape(self, layer: MoELayer) -> None:
        E, H, inter = self.num_experts, self.hidden_size, self.moe_intermediate_size
        gate_up_EIH, down_EHI = self.expert_weights(layer.layer_id)
        shapes, expected = (
            (tuple(gate_up_EIH.shape), tuple(down_EHI.shape)),
            ((E, 2 * inter, H), (E, H, inter)),
        )
        if shapes != expected:
            raise MoecacheError(
                f"{self.model_type}: MoE layer {layer.layer_id} (decoder layer {layer.model_layer_index}) has "
                f"expert shapes {shapes}, layer 0 has {expected}; mixed expert shapes are not supported"
            )
        if int(layer.router.top_k) != self.top_k:
            raise MoecacheError(
                f"{self.model_type}: MoE layer {layer.layer_id} has top_k {layer.router.top_k}, layer 0 has {self.top_k}"
            )

    @property
    def num_layers(self) -> int:
        """Number of MoE layers (dense decoder layers are not counted)."""
        return len(self._layers)

    @property
    def dtype(self) -> torch.dtype:
        return self._layers[0].experts.gate_up_proj.dtype

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights (gate_up + down) in the model's current dtype."""
        return self.expert_params * self.dtype.itemsize

    @property
    def shared_expert_intermediate_size(self) -> int | None:
        shared = self._layers[0].shared_experts
        return None if shared is None else int(shared.down_proj.in_features)

    def moe_layers(self) -> list[MoELayer]:
        return list(self._layers)

    def expert_weights(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_EIH [E, 2I, H], down_EHI [E, H, I]): views of the model's own parameters."""
        experts = self._layers[layer_id].experts
        return experts.gate_up_proj.detach(), experts.down_proj.detach()

    def routing(self, router_output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK, expert_ids_TK) from a router's forward output, as the router made them: no
        copy, no dtype conversion, no device sync (this runs on the inference path)."""
        _router_logits_TE, weights_TK, expert_ids_TK = router_output
        return weights_TK, expert_ids_TK

    def final_norm(self) -> nn.Module:
        """The text decoder's final norm (applied to the last hidden state before the LM head)."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        norm = getattr(decoder, "norm", None)
        if not isinstance(norm, nn.Module):
            raise MoecacheError(
                f"{type(self.model).__name__}: found no final norm (no `.norm` on its decoder)"
            )
        return norm

    def lm_head(self) -> nn.Module:
        """The LM head (hidden -> vocabulary logits); a bare text model has none."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if not isinstance(head, nn.Module):
            raise MoecacheError(
                f"{type(self.model).__name__}: no LM head (load a CausalLM or ConditionalGeneration model)"
            )
        return head

    def lens_tokens(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """int64 [N]: the top-1 token of `lm_head(final_norm(hidden_NH))`, on the hidden state's device
        (no sync). Rows are independent: a caller passes only the rows it wants."""
        with torch.no_grad():
            return self.lm_head()(self.final_norm()(hidden_NH)).argmax(dim=-1)

    def describe(self) -> dict:
        """The architecture numbers, JSON-able."""
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "expert_bytes": self.expert_bytes,
            "has_shared_experts": self._layers[0].shared_experts is not None,
            "model_layer_indices": [layer.model_layer_index for layer in self._layers],
        }


ADAPTERS: dict[str, type[MoEAdapter]] = {}


def register_adapter(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    """Class decorator: make `cls` the adapter for its `model_type` and `aliases`."""
    for name in (cls.model_type, *cls.aliases):
        if ADAPTERS.get(name, cls) is not cls:
            raise ValueError(f"model_type {name!r} already has adapter {ADAPTERS[name].__name__}")
        ADAPTERS[name] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_class(model_type: str | None) -> type[MoEAdapter]:
    """The adapter registered for `model_type`; a MoecacheError listing the supported types otherwise."""
    if model_type not in ADAPTERS:
        raise MoecacheError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})"
        )
    return ADAPTERS[model_type]


def adapter_for(model: nn.Module) -> MoEAdapter:
    """The adapter for a loaded Hugging Face model, chosen by `model.config.model_type`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return adapter_class(model_type)(model)


def config_with_overrides(
    config_class: type[PretrainedConfig], defaults: dict, overrides: dict, key: str = "model.build.overrides"
) -> PretrainedConfig:
    """`config_class(**defaults | overrides)`, refusing override keys the config class does not know."""
    known = {f.name for f in fields(config_class)} | set(getattr(config_class, "attribute_map", {}))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise MoecacheError(f"{key}.{unknown[0]} is not a field of {config_class.__name__}")
    try:
        return config_class(**{**defaults, **overrides})
    except (TypeError, ValueError, StrictDataclassError) as exc:
        message = " ".join(str(exc).split())
        raise MoecacheError(f"{key}: invalid {config_class.__name__}: {message}") from exc
