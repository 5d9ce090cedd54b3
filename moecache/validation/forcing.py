"""Trace-forced workloads of `moecache validate` (`validate.forced_trace`): every run of the stage, the
reference and every strategy, has its routers forced by one recorded trace (moecache/runtime/
forced_routing.py), so a random-weight model of the trace's routing shape sees the real routing.

- The workload is named after the trace (its import/collect name, or the file's); its requests are the
  trace's first `validate.forced_requests`, in trace order. A request's prompt is
  `forced.input_ids(rid, vocab)` (prompt_len tokens, seeded by the request id); it generates
  `forced.decode_steps(rid) + 1` tokens, at most `validate.forced_max_tokens`, so a run routes exactly
  the trace's first prompt_len + generated - 1 tokens of the request.
- `loop=transformers`: the runs' traces are recorded by the router / experts hooks, as for a workload of
  conf/workload/; they equal the forcing trace's rows (tests/validation/test_validate_forced.py).
- `loop=fast`: a replayed CUDA graph runs no Python hook, so a run's trace is written from the forcing
  trace's rows of the tokens it routed (`write_forced_trace`), and every manager visit of an offloaded
  run is checked against those rows (`VisitCheck`): a visit whose ids differ is an error, not a silent
  approximation. The check keeps each visit's result, whose cache fields fill the rows it visited (hits,
  residents, admissions, copies: as a transformers-loop run's trace has them); a row no visit saw (a
  layer the fast loop runs fused, every expert resident under a fixed placement) keeps them null.

Legend: L MoE layers, N tokens of a request, K top-k, T tokens of one visit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from moecache.errors import MoecacheError
from moecache.trace.logger import RoutingLogger, StepContext
from moecache.trace.schema import read_trace
from moecache.validation.runs import Request


@dataclass
class ForcedWorkload:
    name: str  # the workload's name (the trace's)
    ref: str  # the trace's identity (artifact id, or path@sha256)
    path: Path
    forced: object  # ForcedRouting
    requests: list[Request]
    weights: dict[str, np.ndarray]  # request id -> float32 [L, N, K] of the trace (for write_forced_trace)


def load_forced(store, ref: str, *, num_requests: int | None, max_tokens: int | None, arch: dict,
                vocab_size: int) -> ForcedWorkload:  # fmt: skip
    """The forced workload of `validate.forced_trace=ref` (module docstring)."""
    from moecache.runtime.forced_routing import ForcedRouting
    from moecache.sim.inputs import resolve_traces

    (trace,) = resolve_traces(store, [ref])
    table, _ = read_trace(trace.path)
    forced = ForcedRouting.from_trace(
        table, num_layers=arch["num_layers"], num_experts=arch["num_experts"], top_k=arch["top_k"]
    )
    ids = forced.request_ids[:num_requests] if num_requests is not None else forced.request_ids
    if num_requests is not None and len(ids) < num_requests:
        raise MoecacheError(
            f"validate.forced_requests={num_requests}: the trace {trace.path} has {len(ids)} requests"
        )
    requests = []
    for rid in ids:
        new = forced.decode_steps(rid) + 1
        if max_tokens is not None:
            new = min(new, max_tokens)
        prompt = tuple(forced.input_ids(rid, vocab_size)[0].tolist())
        requests.append(Request(rid, prompt, new))
    weights = _weights(table, ids, arch["num_layers"], arch["top_k"]) if forced.has_weights else {}
    return ForcedWorkload(trace.name, trace.ref, trace.path, forced, requests, weights)


def _weights(table, request_ids: list[str], L: int, K: int) -> dict[str, np.ndarray]:
    """float32 [L, N, K] router weights per request, rows ordered as ForcedRouting orders its ids."""
    out = {}
    for rid in request_ids:
        rows = table.filter(pc.equal(table["request_id"].cast("string"), rid))
        layer_R = rows["layer_id"].to_numpy().astype(np.int64)
        token_R = rows["token_index"].to_numpy().astype(np.int64)
        w_RK = pc.list_flatten(rows["router_weights"]).to_numpy().astype(np.float32).reshape(-1, K)
        order = np.lexsort((token_R, layer_R))
        out[rid] = np.ascontiguousarray(w_RK[order].reshape(L, -1, K))
    return out


def routed_tokens(request: Request) -> int:
    """Tokens of the request a run routes: the prompt, then every generated token but the last."""
    return len(request.prompt_ids) + int(request.max_new_tokens) - 1


def write_forced_trace(
    workload: ForcedWorkload, requests: list[Request], logger: RoutingLogger, visits: dict | None = None
) -> None:
    """Log, as the run executed them, the forcing rows of the tokens each request routed: step 0 the
    prompt (prefill), then one token per step (decode). `visits`: VisitCheck.visits, whose results fill
    the cache columns of the rows they visited (module docstring); None: every cache column null."""
    forced = workload.forced
    for req in requests:
        ids_LNK = forced.expert_ids(req.request_id)
        w_LNK = workload.weights[req.request_id]
        seen = (visits or {}).get(req.request_id, {})
        P, n = len(req.prompt_ids), routed_tokens(req)
        spans = [(0, P)] + [(t, t + 1) for t in range(P, n)]
        for step, (a, b) in enumerate(spans):
            logger.set_step(StepContext(req.request_id, step, "prefill" if step == 0 else "decode", a))
            for layer in range(ids_LNK.shape[0]):
                logger.log(
                    layer, torch.from_numpy(np.array(ids_LNK[layer, a:b])),
                    torch.from_numpy(np.array(w_LNK[layer, a:b])), cache=seen.get((layer, a)),
                )  # fmt: skip


class VisitCheck:
    """While entered, every `manager.visit(layer, ids_TK)` is compared with the forcing trace's next T
    rows of that layer in the current request (`start_request`); a difference raises at once. `visits`:
    {request id: {(layer, first token): the visit's result}}, for the trace's cache columns."""

    def __init__(self, manager, forced):
        self.manager, self.forced = manager, forced
        self.rows_checked = 0
        self.visits: dict[str, dict[tuple[int, int], object]] = {}
        self._ids_LNK: np.ndarray | None = None
        self._pos_L: list[int] = []
        self._request: str | None = None

    def start_request(self, request_id: str) -> None:
        self._request = request_id
        self._ids_LNK = self.forced.expert_ids(request_id)
        self._pos_L = [0] * self._ids_LNK.shape[0]
        self.visits[request_id] = {}

    def __enter__(self) -> VisitCheck:
        visit = self.manager.visit

        def checked(layer: int, topk_ids_TK, **options):
            got = topk_ids_TK.detach().cpu().numpy() if isinstance(topk_ids_TK, torch.Tensor) else topk_ids_TK
            got = np.asarray(got).reshape(-1, self.forced.top_k)
            start = self._pos_L[layer]
            want = self._ids_LNK[layer, start : start + got.shape[0]]
            if not np.array_equal(got, want):
                raise MoecacheError(
                    f"validate: request {self._request!r}, MoE layer {layer}, tokens {start}.."
                    f"{start + got.shape[0] - 1}: the manager visited experts {got[:2].tolist()}..., the "
                    f"forcing trace has {want[:2].tolist()}...: the run is not forced"
                )
            self._pos_L[layer] = start + got.shape[0]
            self.rows_checked += got.shape[0]
            result = visit(layer, topk_ids_TK, **options)
            self.visits[self._request][(layer, start)] = result
            return result

        self.manager.visit = checked  # an instance attribute: every caller of manager.visit sees it
        return self

    def __exit__(self, *exc) -> None:
        self.manager.__dict__.pop("visit", None)
