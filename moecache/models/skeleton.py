"""A model built without memory for the weights that are about to be streamed in.

`build_skeleton(cls_or_config, dtype, device, meta)` constructs a Hugging Face model with the parameters
that `meta(module, name, param)` selects placed on the meta device (no memory, no initialisation cost)
and everything else — the other parameters and every buffer (rotary tables and other values computed at
construction) — on `device`, initialised as transformers initialises them. The loader passes
`meta=everything` for a checkpoint (every parameter is then read from the files) and `meta=routed
experts` for a random model (the rest is initialised on the device, the experts are generated into the
expert store).

`materialize(model, name, tensor)` puts a tensor in place of a meta parameter or buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def everything(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    return True


def routed_experts(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """The 3-D expert weights of a sparse MoE block's experts module ([E, 2I, H] and [E, H, I])."""
    return name in EXPERT_PARAMS and param.dim() == 3


@contextlib.contextmanager
def _params_on_meta(meta: Callable[[nn.Module, str, nn.Parameter], bool]):
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta" and meta(module, name, param):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_skeleton(build: Callable[[], nn.Module], dtype: torch.dtype, device, meta) -> nn.Module:
    """`build()` (a model constructor call) with the parameters `meta` selects on the meta device, the
    rest on `device` in `dtype` (the default dtype is restored afterwards); eval mode, no gradients."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _params_on_meta(meta):
            model = build()
    finally:
        torch.set_default_dtype(default)
    model.eval().requires_grad_(False)
    return model


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(module, attribute) holding the parameter or buffer `name` of `model`."""
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def materialize(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`tensor` in place of the parameter (or buffer) `name` of `model`."""
    module, attr = owner(model, name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor


def meta_names(model: nn.Module) -> list[str]:
    """The parameters and buffers of `model` still on the meta device."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    return [name for name, t in named if t.device.type == "meta"]
