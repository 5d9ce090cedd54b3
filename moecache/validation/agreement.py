"""Output agreement of a run with a baseline on the same prompts, teacher-forced: the plan's "within the
tolerance of the existing implementation".

Every run is fed the SAME tokens (the baseline's greedy continuation; the prompt in one forward, then one
token per forward), so its logits at every position are comparable with the baseline's: max and mean
|logits - baseline logits| over all positions x vocabulary, and the share of positions whose top-1 token
equals the baseline's (`LogitErrors`, `teacher_forced`). The baseline is the existing implementation as
users run it: transformers' default experts path (`grouped_mm`, what `from_pretrained` picks). The
tolerance is the disagreement of the other implementation transformers ships for the same layer (its
eager per-expert loop, which sums a token's K expert outputs in bf16 where grouped_mm sums them in
float32) with it on the same inputs: a run is within it when its max and mean errors are at most that
pair's and its top-1 agreement at least theirs (`within`). The baseline is itself rounded: with a
float32 truth (`float32_logits`: the eager loop on the model widened to float32), every bfloat16
implementation is also measured against the same truth, and a run is within their spread when it is no
further from it than they are (`within_spread`). Forced routing
(moecache/runtime/forced_routing.py: a forcing trace, or the baseline's own routing captured by
`RoutingCapture`) keeps every run on the same experts with the same weights. moecache/validation/
agreement_runs.py runs it inside `moecache validate`; benchmarks/bench_agreement.py on its own.

Legend: N positions of one request (prompt + fed tokens), P prompt tokens, V vocabulary, L MoE layers,
K top-k.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

FIGURES = ("max_abs_logit_error", "mean_abs_logit_error", "top1_agreement")


@dataclass
class LogitErrors:
    """Teacher-forced agreement of one run with a baseline, accumulated over requests (module docstring)."""

    positions: int = 0
    top1_equal: int = 0
    max_abs_error: float = 0.0
    abs_error_sum: float = 0.0  # over positions x vocabulary, in float64
    entries: int = 0

    def add(self, logits_NV: torch.Tensor, base_NV: torch.Tensor) -> None:
        """One request's logits against the baseline's at the same N positions (same fed tokens)."""
        if logits_NV.shape != base_NV.shape or logits_NV.dim() != 2:
            raise ValueError(f"logits {tuple(logits_NV.shape)} and baseline {tuple(base_NV.shape)} differ")
        diff_NV = (logits_NV.float() - base_NV.float()).abs()
        if diff_NV.numel():
            self.max_abs_error = max(self.max_abs_error, float(diff_NV.max()))
            self.abs_error_sum += float(diff_NV.double().sum())
        self.entries += diff_NV.numel()
        self.positions += logits_NV.shape[0]
        self.top1_equal += int((logits_NV.argmax(-1) == base_NV.argmax(-1)).sum())

    @property
    def mean_abs_error(self) -> float | None:
        return self.abs_error_sum / self.entries if self.entries else None

    @property
    def top1_agreement(self) -> float | None:
        return self.top1_equal / self.positions if self.positions else None

    def figures(self) -> dict:
        return {
            "positions": self.positions,
            "max_abs_logit_error": self.max_abs_error,
            "mean_abs_logit_error": self.mean_abs_error,
            "top1_agreement": self.top1_agreement,
        }

    @classmethod
    def from_figures(cls, positions: int, max_abs: float, mean_abs: float, top1: float) -> LogitErrors:
        """A run's errors from its reported figures (agreement.parquet's row), for pooling runs of one
        model: each position weighs the same in the mean (one vocabulary)."""
        return cls(positions, round(top1 * positions), max_abs, mean_abs * positions, positions)

    def __add__(self, other: LogitErrors) -> LogitErrors:
        """The errors over both runs' positions."""
        return LogitErrors(
            self.positions + other.positions,
            self.top1_equal + other.top1_equal,
            max(self.max_abs_error, other.max_abs_error),
            self.abs_error_sum + other.abs_error_sum,
            self.entries + other.entries,
        )

    def within(self, tolerance: LogitErrors) -> dict[str, bool]:
        """Per figure, whether this run is within `tolerance` (the two transformers implementations'
        disagreement): errors at most its, top-1 agreement at least its."""
        return {
            "max_abs_logit_error": self.max_abs_error <= tolerance.max_abs_error,
            "mean_abs_logit_error": self.mean_abs_error <= tolerance.mean_abs_error,
            "top1_agreement": self.top1_agreement >= tolerance.top1_agreement,
        }


@dataclass
class Fed:
    """One request run token by token: the N tokens fed (prompt, then the continuation) and the logits
    [N, V] (host float32) at each of those positions."""

    tokens: list[int]
    logits_NV: torch.Tensor


@torch.inference_mode()
def teacher_forced(
    model, prompt_ids: Sequence[int], *, steps: int | None = None, feed: Sequence[int] | None = None
) -> Fed:
    """The prompt in one forward (its P positions' logits: the prefill path), then one forward per further
    token (the decode path) with the model's own cache. `feed`: the tokens after the prompt, fed whatever
    the model predicts (teacher forcing); None: `steps` tokens of greedy decoding (each the argmax of the
    previous position), the baseline's continuation. An offloaded model starts a new request
    (`model.moecache.begin_request()`); forced routing, if any, is the caller's (attached, request
    started)."""
    if (feed is None) == (steps is None):
        raise ValueError("teacher_forced: give exactly one of steps (greedy) or feed (teacher forcing)")
    session = getattr(model, "moecache", None)
    if session is not None:
        session.begin_request()
    device = next(model.parameters()).device
    # the cache's keyword and output field: `cache` from transformers 5.24, `past_key_values` before
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([list(prompt_ids)], device=device)
    out = model(input_ids=ids, use_cache=True)
    logits = [out.logits[0].to("cpu", torch.float32)]
    tokens = list(prompt_ids)
    n = len(feed) if feed is not None else steps
    for i in range(n):
        token = int(feed[i]) if feed is not None else int(logits[-1][-1].argmax())
        tokens.append(token)
        step = torch.tensor([[token]], device=device)
        out = model(input_ids=step, use_cache=True, **{key: getattr(out, key)})
        logits.append(out.logits[0].to("cpu", torch.float32))
    return Fed(tokens, torch.cat(logits))


class RoutingCapture:
    """While entered, the top-k ids and weights every MoE router of `routers` returns, per layer in call
    order (the router output `(router_logits, weights_TK, ids_TK)` of transformers 5). `arrays(P)`: the
    captured rows as ForcedRouting.from_arrays' (ids int64 [L, N, K], weights float32 [L, N, K], P) of one
    request, so other runs can be forced onto exactly this routing."""

    def __init__(self, routers: Sequence[torch.nn.Module]):
        self.routers = list(routers)
        self.ids_L: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.weights_L: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list = []

    def __enter__(self) -> RoutingCapture:
        for layer, router in enumerate(self.routers):

            def hook(module, args, output, layer=layer):
                _, weights_TK, ids_TK = output
                self.ids_L[layer].append(ids_TK.detach().to("cpu", torch.int64))
                self.weights_L[layer].append(weights_TK.detach().to("cpu", torch.float32))

            self._handles.append(router.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def arrays(self, prompt_len: int):
        ids = torch.stack([torch.cat(rows) for rows in self.ids_L]).numpy()
        weights = torch.stack([torch.cat(rows) for rows in self.weights_L]).numpy()
        return ids, weights, prompt_len


def teacher_forced_all(model, prompts: dict, feed: dict, forced=None) -> dict[str, torch.Tensor]:
    """`teacher_forced` over requests: {request id: logits [N, V]}, each request fed `feed[rid]` after
    `prompts[rid]`; `forced` (a ForcedRouting holding those request ids) attached for the whole run, each
    request started on it, so every run routes the same entries with the same weights."""
    out = {}
    if forced is not None:
        forced.attach(model)
    try:
        for rid, prompt in prompts.items():
            if forced is not None:
                forced.start_request(rid)
            out[rid] = teacher_forced(model, prompt, feed=feed[rid]).logits_NV
    finally:
        if forced is not None:
            forced.detach()
    return out


def logit_errors(logits: dict, base: dict) -> LogitErrors:
    """LogitErrors of per-request logits [N, V] against the baseline's of the same request ids."""
    errors = LogitErrors()
    for rid, logits_NV in logits.items():
        errors.add(logits_NV, base[rid])
    return errors


@dataclass
class Tolerance:
    """The baseline's teacher-forced logits per request and the disagreement of transformers' other
    implementations with it (per implementation name): what every run is held to. With a float32
    truth (`float32_logits`): its logits, and the baseline's and each implementation's errors against
    it (`from_truth`, keyed by the baseline's and the implementations' names)."""

    base: dict[str, torch.Tensor]
    pairs: dict[str, LogitErrors]
    truth: dict[str, torch.Tensor] | None = None
    from_truth: dict[str, LogitErrors] = field(default_factory=dict)


def float32_logits(model, prompts: dict, feed: dict, forced=None) -> dict[str, torch.Tensor]:
    """`teacher_forced_all` with the model's bfloat16 / float16 parameters and buffers widened to
    float32 for the pass and narrowed back after it. Both ways are exact (every bfloat16 or float16
    value is a float32 value, and narrowing it back gives the same value), so the model is left bit for
    bit as it was; it holds the widened copy of a tensor and then drops the narrow one, tensor by
    tensor: about twice its narrow bytes at the end of the widening."""
    narrow = [
        (t, t.dtype)
        for t in (*model.parameters(), *model.buffers())
        if t.dtype in (torch.bfloat16, torch.float16)
    ]
    for t, _ in narrow:
        t.data = t.data.float()
    try:
        return teacher_forced_all(model, prompts, feed, forced)
    finally:
        for t, dtype in narrow:
            t.data = t.data.to(dtype)


def implementation_tolerance(
    model,
    prompts: dict,
    feed: dict,
    forced=None,
    impls: Sequence[str] = ("eager",),
    float32: bool = False,
    baseline: str = "grouped_mm",
) -> Tolerance:
    """On the unmodified model (before it is offloaded): every request teacher-forced on `feed` with
    transformers' `baseline` experts path and with each of `impls`, the model's experts implementation
    restored afterwards. `float32`: the eager loop in float32 too (`float32_logits`; a float32 model's
    baseline is that truth itself), every implementation's errors against it."""
    before = getattr(model.config, "_experts_implementation", None)
    model.set_experts_implementation(baseline)
    base = teacher_forced_all(model, prompts, feed, forced)
    truth = None
    if float32:
        narrow = any(t.dtype in (torch.bfloat16, torch.float16) for t in model.parameters())
        if narrow:
            model.set_experts_implementation("eager")
            truth = float32_logits(model, prompts, feed, forced)
        else:
            truth = base
    from_truth = {baseline: logit_errors(base, truth)} if truth is not None else {}
    pairs = {}
    for impl in impls:
        model.set_experts_implementation(impl)
        logits = teacher_forced_all(model, prompts, feed, forced)
        pairs[impl] = logit_errors(logits, base)
        if truth is not None:
            from_truth[impl] = logit_errors(logits, truth)
    if before is not None:
        model.set_experts_implementation(before)
    return Tolerance(base, pairs, truth, from_truth)


def agreement_row(model, prompts: dict, feed: dict, tolerance: Tolerance, forced=None) -> dict:
    """One run's teacher-forced figures against the baseline (the agreement table's columns):
    `positions`, `max_abs_logit_error`, `mean_abs_logit_error`, `top1_agreement`, per figure
    `<figure>_within` (within every pair of `tolerance`), and `within_tolerance` (every figure). With a
    float32 truth, `float32_<figure>` (the run against it) and `within_float32_spread`: every one of
    those within the spread of transformers' own implementations against the same truth (errors at
    most the largest of theirs, top-1 agreement at least the lowest)."""
    logits = teacher_forced_all(model, prompts, feed, forced)
    errors = logit_errors(logits, tolerance.base)
    within = {f: all(errors.within(pair)[f] for pair in tolerance.pairs.values()) for f in FIGURES}
    row = {
        **errors.figures(),
        **{f"{f}_within": ok for f, ok in within.items()},
        "within_tolerance": all(within.values()),
    }
    if tolerance.truth is not None:
        true = logit_errors(logits, tolerance.truth).figures()
        row.update({f"float32_{f}": true[f] for f in FIGURES})
        row["within_float32_spread"] = within_spread(
            true, [e.figures() for e in tolerance.from_truth.values()]
        )
    return row


def within_spread(figures: dict, others: list[dict]) -> bool:
    """Whether `figures` (LogitErrors.figures) are within the spread of `others`: each error at most the
    largest of theirs, the top-1 agreement at least the lowest."""
    return (
        figures["max_abs_logit_error"] <= max(o["max_abs_logit_error"] for o in others)
        and figures["mean_abs_logit_error"] <= max(o["mean_abs_logit_error"] for o in others)
        and figures["top1_agreement"] >= min(o["top1_agreement"] for o in others)
    )
