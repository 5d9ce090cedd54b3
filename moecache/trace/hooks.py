"""Attach the routing logger to a model: one forward hook per MoE router, one step tracker.

The step tracker is a forward pre-hook on the whole model: every forward call is one step of the
current request (step 0 is the prefill of the prompt, later steps decode one token each). The router
hooks read the routing through the model's adapter, so the logger only ever sees
(layer_id, expert_ids, weights). Batch size is one: no padding token ever reaches the logger.

With a `LogitLens` that is active (rate > 0), each MoE layer's decoder layer also gets a forward
pre-hook: it projects the step's sampled rows of its input (moecache/trace/lens.py) and the router
hook of the same layer hands the result to the logger with the routing.
"""

from __future__ import annotations

import torch
from torch import nn

from moecache.errors import MoecacheError
from moecache.trace.lens import LogitLens
from moecache.trace.logger import RoutingLogger, StepContext


class RoutingRecorder:
    def __init__(self, model: nn.Module, adapter, logger: RoutingLogger, lens: LogitLens | None = None):
        self.model = model
        self.adapter = adapter
        self.logger = logger
        self.lens = lens if lens is not None and lens.active else None
        self._lens_pending: dict[int, tuple] = {}  # layer_id -> the lens of its decoder layer's input
        self._handles: list = []
        self._request_id: str | None = None
        self._step = 0
        self._tokens_seen = 0
        self.tokens_logged = 0

    def start_request(self, request_id: str) -> None:
        self._request_id = request_id
        self._step = 0
        self._tokens_seen = 0
        if self.lens is not None:
            self.lens.start_request(request_id)

    def attach(self) -> RoutingRecorder:
        self._handles.append(self.model.register_forward_pre_hook(self._on_step, with_kwargs=True))
        for layer in self.adapter.moe_layers():
            if self.lens is not None:
                self._handles.append(
                    layer.decoder_layer.register_forward_pre_hook(
                        self._lens_hook(layer.layer_id), with_kwargs=True
                    )
                )
            self._handles.append(layer.router.register_forward_hook(self._router_hook(layer.layer_id)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _on_step(self, module, args, kwargs):
        if self._request_id is None:
            raise MoecacheError("routing recorder: start_request() was not called before the forward pass")
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise MoecacheError("routing recorder: cannot tell how many tokens this forward step routes")
        if tokens.shape[0] != 1:
            raise MoecacheError(
                f"routing recorder: batch size {tokens.shape[0]}; collect runs batch size one"
            )
        num_tokens = int(tokens.shape[1])
        phase = "prefill" if self._step == 0 else "decode"
        self.logger.set_step(StepContext(self._request_id, self._step, phase, self._tokens_seen))
        if self.lens is not None:
            self._lens_pending.clear()
            self.lens.start_step(self._tokens_seen, num_tokens, tokens.device)
        self._step += 1
        self._tokens_seen += num_tokens
        self.tokens_logged += num_tokens
        return None

    def _lens_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                raise MoecacheError(f"logit lens: MoE layer {layer_id}'s decoder layer got no hidden_states")
            projected = self.lens.project(hidden)
            if projected is not None:
                self._lens_pending[layer_id] = projected
            return None

        return hook

    def _router_hook(self, layer_id: int):
        def hook(module, inputs, output):
            weights_TK, expert_ids_TK = self.adapter.routing(output)
            lens_rows_N, lens_tokens_N = self._lens_pending.pop(layer_id, (None, None))
            self.logger.log(layer_id, expert_ids_TK, weights_TK, lens_rows_N, lens_tokens_N)

        return hook
