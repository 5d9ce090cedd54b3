"""Output agreement of a run with a reference on the same prompts.

Free-running (`Agreement`, validate's `token_match_rate` / `max_logit_error` today): per request, the
token match count is the number of generated positions whose token equals the reference's at the same
position; the logit error is max |logits - reference logits| over the positions up to and including the
first mismatch (after it the two runs continue different prefixes, so their logits are not comparable).
Over a run: match rate = matches / positions, max logit error = the largest. A random-weight model's
greedy tokens diverge at its first near-tie, so the match rate says little.

Teacher-forced (`LogitErrors`, `teacher_forced`, the plan's "within the tolerance of the existing
implementation"): every run is fed the SAME tokens (the baseline's greedy continuation), so its logits
at every position are comparable with the baseline's: max and mean |logits - baseline logits| over all
positions x vocabulary, and the share of positions whose top-1 token equals the baseline's. The
tolerance is the disagreement of two implementations transformers itself ships for the same layer on the
same inputs (its eager per-expert loop, the baseline, against its grouped_mm / batched_mm path): a run is
within it when its max and mean errors are at most that pair's and its top-1 agreement at least theirs
(`within`). benchmarks/bench_agreement.py measures it; trace-forced routing (moecache/runtime/
forced_routing.py) keeps every run on the same experts.

Legend: N positions of one request (prompt + fed tokens), P prompt tokens, V vocabulary, L MoE layers,
K top-k.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FIGURES = ("max_abs_logit_error", "mean_abs_logit_error", "top1_agreement")


@dataclass
class Agreement:
    matches: int = 0
    positions: int = 0
    max_logit_error: float = 0.0

    def add(self, ref_tokens: list[int], ref_logits_NV: torch.Tensor, tokens: list[int], logits_NV) -> None:
        n = min(len(ref_tokens), len(tokens))
        same = [a == b for a, b in zip(ref_tokens[:n], tokens[:n], strict=True)]
        self.matches += sum(same)
        self.positions += max(len(ref_tokens), len(tokens))
        upto = same.index(False) + 1 if False in same else n
        if upto:
            diff = (logits_NV[:upto].float() - ref_logits_NV[:upto].float()).abs().max().item()
            self.max_logit_error = max(self.max_logit_error, float(diff))

    @property
    def match_rate(self) -> float | None:
        return self.matches / self.positions if self.positions else None


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
    implementations with it (per implementation name): what every run is held to."""

    base: dict[str, torch.Tensor]
    pairs: dict[str, LogitErrors]


def implementation_tolerance(
    model, prompts: dict, feed: dict, forced=None, impls: Sequence[str] = ("grouped_mm",)
) -> Tolerance:
    """On the unmodified model (before it is offloaded): every request teacher-forced on `feed` with
    transformers' eager per-expert loop (the baseline) and with each of `impls`, the model left on its
    eager loop's setting restored afterwards."""
    before = getattr(model.config, "_experts_implementation", None)
    model.set_experts_implementation("eager")
    base = teacher_forced_all(model, prompts, feed, forced)
    pairs = {}
    for impl in impls:
        model.set_experts_implementation(impl)
        pairs[impl] = logit_errors(teacher_forced_all(model, prompts, feed, forced), base)
    if before is not None:
        model.set_experts_implementation(before)
    return Tolerance(base, pairs)


def agreement_row(model, prompts: dict, feed: dict, tolerance: Tolerance, forced=None) -> dict:
    """One run's teacher-forced figures against the baseline (columns of validate's runs table):
    `teacher_forced_positions`, `max_abs_logit_error`, `mean_abs_logit_error`, `top1_agreement`, and
    `within_tolerance` (every figure within every pair of `tolerance`)."""
    errors = logit_errors(teacher_forced_all(model, prompts, feed, forced), tolerance.base)
    figures = errors.figures()
    within = all(all(errors.within(pair).values()) for pair in tolerance.pairs.values())
    return {"teacher_forced_positions": figures.pop("positions"), **figures, "within_tolerance": within}
