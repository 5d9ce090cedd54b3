"""Trace-forced routing: a model's routers choose the experts a recorded canonical trace chose.

For realistic cache locality at real sizes with random weights (docs/runtime.md, "Trace-forced routing"):
per (request, token, MoE layer) the router's top-k ids are replaced by the trace's; everything else (the
model's own attention and norms, the experts module, or the runtime's manager, copies, slot-pool kernel
and CPU path of a `moecache.offload`ed model) runs for real on those ids.

    forced = ForcedRouting.from_trace("trace.parquet", num_layers=L, num_experts=E, top_k=K)
    with forced.attach(model, adapter):
        for rid in forced.request_ids:
            forced.start_request(rid)
            model.generate(forced.input_ids(rid, vocab), max_new_tokens=forced.decode_steps(rid) + 1,
                           eos_token_id=None, ...)

`attach` puts a forward hook on every MoE layer's router (`block.gate`, output `(router_logits,
weights_TK, ids_TK)`) that returns the output with ids (and weights) replaced by the next T rows of its
layer in the current request, T = the router's own rows (the step's flattened tokens). One cursor per
layer advances by T per call, so any loop that calls the router modules works: HF `generate` (T =
prompt_len, then 1) or another decode loop. The hook is prepended, so a hook registered on the router
before or after (the RoutingRecorder) sees the forced routing.

A decode loop that substitutes the routing itself (moecache/runtime/decode_loop.py's FastDecoder with
`forced=`: inside CUDA graphs a router hook would replay its capture-time ids) takes the rows with
`take(layer, T)` (the same cursors) inside `with forced.supplied_by_caller():`, during which the hooks
pass the router's output through unchanged and advance nothing. Outside it, a hook refuses to run while
the current CUDA stream is capturing: its host-to-device copy would be baked into the graph.

Weights: the trace's `router_weights` where it has the column; otherwise the model router's own
probabilities (softmax of its logits) gathered at the forced ids, renormalised over the K ids when the
model's router renormalises (Mixtral, Qwen3.5-MoE always; Qwen3-MoE and OLMoE per `norm_topk_prob`;
DeepSeek-V2 never) and times `routed_scaling_factor` where the router has one: the model's own rule.

Legend: L layers (MoE), E experts, K top-k, T tokens of one router call, N tokens of one request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from moecache.errors import MoecacheError
from moecache.trace.schema import METADATA_KEY, TraceMeta, read_trace, validate_table

# Routers without a `norm_topk_prob` attribute: whether their weights are renormalised over the top-k.
RENORMALISES = {"mixtral": True, "qwen3_5_moe": True, "qwen3_5_moe_text": True, "deepseek_v2": False}


@dataclass(frozen=True)
class _Request:
    ids_LNK: np.ndarray  # int64 [L, N, K], row n of layer l = token n
    weights_LNK: np.ndarray | None  # float32 [L, N, K]; None: the trace has no router_weights
    prompt_len: int  # tokens of step 0


@dataclass(frozen=True)
class _WeightRule:
    renormalise: bool
    scale: float


class ForcedRouting:
    """The routing of a canonical trace, ready to force onto a model of the same routing shape."""

    def __init__(self, requests: dict[str, _Request], *, num_layers: int, num_experts: int, top_k: int):
        self._requests = requests
        self.request_ids: list[str] = list(requests)
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.has_weights = all(r.weights_LNK is not None for r in requests.values())
        self._handles: list = []
        self._rules: list[_WeightRule | None] = []
        self._current: str | None = None
        self._cursor_L = [0] * num_layers
        self._supplied = 0  # depth of supplied_by_caller(): the hooks pass the router output through
        self._attached: nn.Module | None = None
        self._host: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # request -> (ids, weights)

    # ---- building ---------------------------------------------------------------------------------

    @classmethod
    def from_trace(
        cls,
        table_or_path: pa.Table | str | Path,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        max_tokens: int | None = None,
    ) -> ForcedRouting:
        """From a trace file (read and validated by `read_trace`) or a canonical table (validated here;
        its `moecache.trace` metadata, where present, must match the model too). `max_tokens`: keep only
        the first max_tokens tokens of every request (None: all). Refuses, in one line naming the trace,
        a routing shape other than the model's, a row with fewer than top_k experts and a request with a
        token lacking a layer: neither can be forced."""
        bad_limit = isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer)
        if max_tokens is not None and (bad_limit or max_tokens < 1):
            raise MoecacheError(
                f"forced routing: max_tokens={max_tokens!r}: expected a positive integer or None"
            )
        shape = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
        if isinstance(table_or_path, pa.Table):
            where, table = "trace table", table_or_path
            raw = (table.schema.metadata or {}).get(METADATA_KEY)
            meta = TraceMeta.from_json(raw, where) if raw else TraceMeta(**shape, expert_bytes=0)
            _check_shape(where, meta, shape)
            validate_table(table, meta, where)
        else:
            where = str(table_or_path)
            table, meta = read_trace(table_or_path)
            _check_shape(where, meta, shape)
        weights = "router_weights" in table.column_names
        requests = _requests(table, where, num_layers, top_k, weights, max_tokens)
        return cls(requests, num_layers=num_layers, num_experts=num_experts, top_k=top_k)

    @classmethod
    def from_arrays(
        cls, requests: dict[str, tuple[np.ndarray, np.ndarray, int]], *, num_experts: int
    ) -> ForcedRouting:
        """From routing a caller drew itself (calibrate's random routing): per request id, (ids int64
        [L, N, K], weights float32 [L, N, K], prompt_len), every request of one [L, ., K]; ids in
        0..num_experts-1, 1 <= prompt_len <= N. Refuses anything else in one line."""
        made: dict[str, _Request] = {}
        shapes = set()
        for rid, (ids, weights, prompt_len) in requests.items():
            ids, weights = np.asarray(ids, np.int64), np.asarray(weights, np.float32)
            if ids.ndim != 3 or weights.shape != ids.shape or not 1 <= prompt_len <= ids.shape[1]:
                raise MoecacheError(
                    f"forced routing: request {rid!r}: ids {ids.shape}, weights {weights.shape}, prompt_len "
                    f"{prompt_len}: expected [L, N, K] twice and 1 <= prompt_len <= N"
                )
            if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < num_experts:
                raise MoecacheError(f"forced routing: request {rid!r}: ids outside 0..{num_experts - 1}")
            shapes.add((ids.shape[0], ids.shape[2]))
            made[rid] = _Request(np.ascontiguousarray(ids), np.ascontiguousarray(weights), int(prompt_len))
        if len(shapes) != 1:
            raise MoecacheError(f"forced routing: requests of (layers, top_k) {sorted(shapes)}: expected one")
        ((num_layers, top_k),) = shapes
        return cls(made, num_layers=num_layers, num_experts=num_experts, top_k=top_k)

    # ---- what a driver needs ----------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        if request_id not in self._requests:
            shown = ", ".join(self.request_ids[:3]) + (", ..." if len(self.request_ids) > 3 else "")
            raise MoecacheError(
                f"forced routing: request_id {request_id!r} is not in the trace ({len(self.request_ids)} "
                f"requests: {shown})"
            )
        return self._requests[request_id]

    def prompt_len(self, request_id: str) -> int:
        """Tokens of the request's prefill step (step 0)."""
        return self._request(request_id).prompt_len

    def num_tokens(self, request_id: str) -> int:
        """Tokens of the request in the trace (after `max_tokens`)."""
        return int(self._request(request_id).ids_LNK.shape[1])

    def decode_steps(self, request_id: str) -> int:
        """The further forward steps, one token each: every token after the prefill step (a trace whose
        later steps hold several tokens, e.g. a chunked import, is replayed one token per step)."""
        return self.num_tokens(request_id) - self.prompt_len(request_id)

    def expert_ids(self, request_id: str) -> np.ndarray:
        """int64 [L, N, K], read-only: the experts the request's token n gets at MoE layer l."""
        view = self._request(request_id).ids_LNK.view()
        view.flags.writeable = False
        return view

    def input_ids(self, request_id: str, vocab_size: int) -> torch.Tensor:
        """int64 [1, prompt_len]: token ids drawn from a generator seeded by the request id's sha256,
        so the same request always gets the same prompt (the routing does not depend on it)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise MoecacheError(f"forced routing: vocab_size={vocab_size!r}: expected a positive integer")
        seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (1, self.prompt_len(request_id)), generator=gen)

    def start_request(self, request_id: str) -> None:
        """The next router calls belong to `request_id`: every layer's cursor back to its token 0."""
        request = self._request(request_id)
        if request_id not in self._host:
            ids = torch.from_numpy(request.ids_LNK)
            w = None if request.weights_LNK is None else torch.from_numpy(request.weights_LNK)
            self._host[request_id] = (ids, w)
        self._current = request_id
        self._cursor_L = [0] * self.num_layers

    @property
    def positions(self) -> list[int]:
        """Per MoE layer, how many rows of the current request its router has been given."""
        return list(self._cursor_L)

    def rows_left(self) -> int:
        """Rows of the current request every MoE layer still has: min over layers of (tokens - cursor)."""
        ids_LNK, _ = self._current_rows()
        return int(ids_LNK.shape[1]) - max(self._cursor_L)

    def take(self, layer_id: int, T: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The next T rows of MoE layer `layer_id` in the current request, advancing its cursor: (ids
        int64 [T, K], weights float32 [T, K] or None without trace weights), read-only host views of the
        trace (on CUDA of its pinned copy). What the router hook forces; a decode loop that substitutes
        the routing itself calls it under `supplied_by_caller()`."""
        ids, w = self._rows(layer_id, T)
        out = ids.numpy(), None if w is None else w.numpy()
        for a in out:
            if a is not None:
                a.flags.writeable = False
        return out

    def supplied_by_caller(self) -> _Supplied:
        """`with forced.supplied_by_caller():` the caller substitutes the rows (with `take`); meanwhile
        every hook passes its router's output through unchanged and advances no cursor."""
        return _Supplied(self)

    @property
    def attached_to(self) -> nn.Module | None:
        """The model whose routers are hooked now (None: detached)."""
        return self._attached

    def _current_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._current is None:
            raise MoecacheError(
                "forced routing: a router ran before start_request(): the request to force is unknown"
            )
        return self._host[self._current]

    def _rows(self, layer_id: int, T: int, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host slices [T, K] of the next T rows of `layer_id` (its cursor advanced); `pin`: from the
        request's pinned copy (made once)."""
        ids_LNK, w_LNK = self._current_rows()
        if not 0 <= layer_id < self.num_layers:
            raise MoecacheError(
                f"forced routing: MoE layer {layer_id} is out of range (the trace has {self.num_layers})"
            )
        start, n = self._cursor_L[layer_id], ids_LNK.shape[1]
        if start + T > n:
            raise MoecacheError(
                f"forced routing: request {self._current!r} has {n} tokens in the trace; MoE layer "
                f"{layer_id} was asked for tokens {start}..{start + T - 1}"
            )
        if pin and not ids_LNK.is_pinned():
            ids_LNK, w_LNK = ids_LNK.pin_memory(), None if w_LNK is None else w_LNK.pin_memory()
            self._host[self._current] = (ids_LNK, w_LNK)
        self._cursor_L[layer_id] = start + T
        rows = slice(start, start + T)
        return ids_LNK[layer_id, rows], None if w_LNK is None else w_LNK[layer_id, rows]

    # ---- attaching ---------------------------------------------------------------------------------

    def attach(self, model: nn.Module, adapter=None) -> ForcedRouting:
        """Hook every MoE router of `model` (`adapter.moe_layers()`; without an adapter, the model's
        own adapter, or for an offloaded model its `OffloadedExperts` blocks' routers)."""
        if self._handles:
            raise MoecacheError("forced routing: already attached; detach() first")
        routers = _routers(model, adapter)
        if len(routers) != self.num_layers:
            raise MoecacheError(
                f"forced routing: the model has {len(routers)} MoE layers, the trace {self.num_layers}"
            )
        for layer_id, router in enumerate(routers):
            got_k = getattr(router, "top_k", self.top_k)
            got_e = getattr(router, "num_experts", self.num_experts)
            if (int(got_k), int(got_e)) != (self.top_k, self.num_experts):
                raise MoecacheError(
                    f"forced routing: MoE layer {layer_id}'s router has top_k {got_k} and {got_e} experts, "
                    f"the trace top_k {self.top_k} and {self.num_experts} experts"
                )
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        self._rules = [None if self.has_weights else _weight_rule(r, model_type) for r in routers]
        for layer_id, router in enumerate(routers):
            self._handles.append(router.register_forward_hook(self._hook(layer_id), prepend=True))
        self._attached = model
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._attached = None

    def __enter__(self) -> ForcedRouting:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            if not isinstance(output, tuple) or len(output) != 3:
                raise MoecacheError(
                    f"forced routing: MoE layer {layer_id}'s router returned {type(output).__name__}, "
                    "expected (router_logits, weights_TK, ids_TK)"
                )
            if self._supplied:
                return None  # the caller substitutes the rows itself (take): the output unchanged
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise MoecacheError(
                    f"forced routing: MoE layer {layer_id}'s router hook ran inside a CUDA graph capture "
                    "(its rows would be baked into the graph); decode with FastDecoder(..., forced=) or "
                    "graphs=off"
                )
            logits_TE, own_w_TK, own_ids_TK = output
            return logits_TE, *self._forced(layer_id, logits_TE, own_w_TK, own_ids_TK)

        return hook

    def _forced(self, layer_id, logits_TE, own_w_TK, own_ids_TK) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK, ids_TK) of the next T rows of `layer_id`, in the router's dtypes and device."""
        self._current_rows()  # before start_request: one line
        T, K = own_ids_TK.shape
        if K != self.top_k:
            raise MoecacheError(
                f"forced routing: MoE layer {layer_id}'s router chose {K} experts, top_k {self.top_k}"
            )
        device = own_ids_TK.device
        host_ids_TK, host_w_TK = self._rows(layer_id, T, pin=device.type == "cuda")
        ids_TK = _to(host_ids_TK, device).to(own_ids_TK.dtype)
        if host_w_TK is not None:
            w_TK = _to(host_w_TK, device)
        else:
            rule = self._rules[layer_id]
            probs_TE = torch.softmax(logits_TE.detach().reshape(T, -1).float(), dim=-1)
            w_TK = probs_TE.gather(1, ids_TK.long())
            if rule.renormalise:
                w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
            if rule.scale != 1.0:
                w_TK = w_TK * rule.scale
        return w_TK.to(own_w_TK.dtype), ids_TK


class _Supplied:
    """The context of `ForcedRouting.supplied_by_caller` (nestable)."""

    def __init__(self, forced: ForcedRouting):
        self._forced = forced

    def __enter__(self) -> ForcedRouting:
        self._forced._supplied += 1
        return self._forced

    def __exit__(self, *exc) -> None:
        self._forced._supplied -= 1


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh tensor on `device` (a CPU one is a copy too: nothing downstream may alias the trace)."""
    return host.clone() if device.type == "cpu" else host.to(device, non_blocking=True)


def _check_shape(where: str, meta: TraceMeta, shape: dict) -> None:
    for key, want in shape.items():
        got = getattr(meta, key)
        if got != want:
            raise MoecacheError(
                f"{where}: trace metadata '{key}' is {got}, the model has {want}; a trace forces only a "
                "model of its own routing shape"
            )


def _requests(
    table: pa.Table, where: str, L: int, K: int, weights: bool, max_tokens: int | None
) -> dict[str, _Request]:
    """Per request, its rows as [L, N, K] arrays (rows are contiguous per request: validated)."""
    if table.num_rows == 0:
        raise MoecacheError(f"{where}: the trace has no rows; nothing to force")
    lengths = pc.list_value_length(table["expert_ids"]).to_numpy(zero_copy_only=False)
    short = np.flatnonzero(lengths != K)
    if short.size:
        row = int(short[0])
        raise MoecacheError(
            f"{where}: column 'expert_ids' holds {table['expert_ids'][row].as_py()} at row {row}: "
            f"{lengths[row]} experts; forcing needs top_k={K} in every row ({short.size} such row(s))"
        )
    column = table["request_id"]
    codes = (column if pa.types.is_dictionary(column.type) else pc.dictionary_encode(column)).combine_chunks()
    names = codes.dictionary.to_pylist()
    request_N = codes.indices.to_numpy(zero_copy_only=False)
    step_N = table["step_index"].to_numpy().astype(np.int64)
    layer_N = table["layer_id"].to_numpy().astype(np.int64)
    token_N = table["token_index"].to_numpy().astype(np.int64)
    ids_NK = pc.list_flatten(table["expert_ids"]).to_numpy().astype(np.int64).reshape(-1, K)
    w_NK = (
        pc.list_flatten(table["router_weights"]).to_numpy().astype(np.float32).reshape(-1, K)
        if weights
        else None
    )
    bounds = np.flatnonzero(np.diff(request_N)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [table.num_rows]])
    requests: dict[str, _Request] = {}
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        name = names[request_N[start]]
        rows = slice(start, end)
        requests[name] = _request(
            where, name, step_N[rows], layer_N[rows], token_N[rows], ids_NK[rows],
            None if w_NK is None else w_NK[rows], L, max_tokens,
        )  # fmt: skip
    return requests


def _request(where, name, step_R, layer_R, token_R, ids_RK, w_RK, L, max_tokens) -> _Request:
    """One request's rows R: every token 0..N-1 must have a row for every layer."""
    n = int(token_R.max()) + 1
    present_LN = np.zeros((L, n), bool)
    present_LN[layer_R, token_R] = True
    if not present_LN.all():
        layer, token = (int(i) for i in np.argwhere(~present_LN)[0])
        missing = int((~present_LN).sum())
        raise MoecacheError(
            f"{where}: request {name!r}: token {token} has no row for MoE layer {layer} ({missing} "
            "(token, layer) pair(s) missing); forcing needs every layer of every token 0..N-1"
        )
    prompt_T = np.unique(token_R[step_R == 0])
    if prompt_T.size == 0 or prompt_T[-1] != prompt_T.size - 1:
        raise MoecacheError(
            f"{where}: request {name!r}: its step 0 holds tokens {prompt_T[:4].tolist()}...; a prefill "
            "step must hold the request's first tokens 0..P-1"
        )
    order = np.lexsort((token_R, layer_R))  # rows are distinct (validated): exactly L * n of them
    keep = n if max_tokens is None else min(n, int(max_tokens))
    ids_LNK = np.ascontiguousarray(ids_RK[order].reshape(L, n, -1)[:, :keep])
    w_LNK = None if w_RK is None else np.ascontiguousarray(w_RK[order].reshape(L, n, -1)[:, :keep])
    return _Request(ids_LNK, w_LNK, min(int(prompt_T.size), keep))


def _weight_rule(router: nn.Module, model_type: str | None) -> _WeightRule:
    """How the model's router turns its top-k probabilities into weights (module docstring)."""
    if hasattr(router, "norm_topk_prob"):
        renormalise = bool(router.norm_topk_prob)
    elif model_type in RENORMALISES:
        renormalise = RENORMALISES[model_type]
    else:
        raise MoecacheError(
            f"forced routing: the trace has no router_weights and model_type {model_type!r} has no known "
            f"weight rule (known: {', '.join(sorted(RENORMALISES))} or a router with norm_topk_prob)"
        )
    return _WeightRule(renormalise, float(getattr(router, "routed_scaling_factor", 1.0)))


def moe_routers(model: nn.Module, adapter=None) -> list[nn.Module]:
    """The MoE routers of `model` (unmodified or offloaded), by MoE layer id: what `attach` hooks."""
    return _routers(model, adapter)


def _routers(model: nn.Module, adapter) -> list[nn.Module]:
    """The MoE routers, by MoE layer id."""
    if adapter is not None:
        return [layer.router for layer in adapter.moe_layers()]
    from moecache.models.adapter import adapter_for, find_decoder_layers
    from moecache.runtime.experts_module import OffloadedExperts

    if getattr(model, "moecache", None) is None:
        return [layer.router for layer in adapter_for(model).moe_layers()]
    blocks = [getattr(layer, "mlp", None) for layer in find_decoder_layers(model)]
    offloaded = [b for b in blocks if isinstance(getattr(b, "experts", None), OffloadedExperts)]
    return [b.gate for b in sorted(offloaded, key=lambda b: b.experts.layer_id)]
