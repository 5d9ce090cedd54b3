"""Output agreement inside `moecache validate`: per workload, transformers' own tolerance measured on the
unmodified model, then every offloaded run held to it (moecache/validation/agreement.py measures).

Per workload, on the unmodified model before it is offloaded (`prepare`, called by pipeline.py):
1. the requests: the workload's first `validate.agreement_requests` (a conversation's later turn built
   from the baseline's answer, as the runs' later turns are built from the reference's: workloads.py);
   a trace-forced workload's first requests;
2. the baseline, transformers' default experts path (grouped_mm), greedily continues each request by
   `validate.agreement_tokens` tokens (null: as many as the workload's runs route after the prompt);
   that continuation is what every run is fed. The routing: a trace-forced workload's forcing trace;
   else the baseline's own, captured in that pass (`RoutingCapture`) and forced on every later pass, so
   every run routes the same (token, expert) entries with the same weights;
3. the tolerance: every request teacher-forced with the baseline (its logits) and with each
   implementation of `validate.agreement_impls` (default: the eager per-expert loop) on the same tokens
   and routing: one row each.
   With `validate.agreement_float32`, the eager loop once more on the model widened to float32 (the
   truth; a float32 model's baseline is the truth itself): the baseline (a row of its own) and each
   implementation measured against it too.

After each offloaded run, its cache as the run left it (`run_row`): the same requests teacher-forced
through the offloaded model, its figures against the baseline's and, per figure, whether it is within
every implementation's; against the float32 truth, and whether it is within the spread of
transformers' own implementations there (no further from the truth than they are); with the (token, k) entries that pass computed from the slot pool and on the
CPU, which say whether both halves of the layer were exercised. The passes go through transformers'
forward (the runtime's experts module; the fast loop's CUDA graphs replay the same operator and CPU path
but cannot be fed tokens).

Legend: L MoE layers, N positions of one request, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from moecache.validation.agreement import (
    FIGURES,
    RoutingCapture,
    Tolerance,
    agreement_row,
    implementation_tolerance,
    teacher_forced,
)
from moecache.validation.runs import Outputs, Request, RunSpec

# transformers' default experts path (what `from_pretrained` picks): the logits every run is compared with
BASELINE = "grouped_mm"
# transformers' other paths, each compared with BASELINE: eager sums a token's K expert outputs in bf16
# (the tolerance); batched_mm shares grouped_mm's arithmetic (a bf16 model: its pair is 0, a bound no other
# implementation can be held to)
IMPLEMENTATIONS = ("eager", "batched_mm")
BASE, TOLERANCE, MOECACHE = "baseline", "tolerance", "moecache"  # the agreement table's row kinds


@dataclass
class AgreementSet:
    """One workload's agreement inputs: the prompts and fed tokens per request id, the routing every
    pass is forced with (a ForcedRouting), where it came from, and the tolerance."""

    workload: str
    prompts: dict[str, list[int]]
    feed: dict[str, list[int]]
    forced: object
    routing: str
    tolerance: Tolerance

    @property
    def positions(self) -> int:
        return sum(len(p) + len(self.feed[rid]) for rid, p in self.prompts.items())


def prepare(
    model, workload: str, requests: Iterable[Request], answers: Outputs, tokens_of: Callable[[Request], int],
    *, forced=None, forced_name: str | None = None, num_experts: int, impls: tuple[str, ...], float32: bool,
) -> AgreementSet:  # fmt: skip
    """Steps 1-3 of the module docstring on the unmodified `model`. `requests` may be a stream reading
    `answers` (each request's continuation is written there before the next is drawn); `tokens_of`:
    the tokens fed after a request's prompt; `forced`: the workload's ForcedRouting (None: the
    baseline's routing is captured); `float32`: measure the float32 truth too."""
    from moecache.runtime.forced_routing import ForcedRouting, moe_routers

    before = getattr(model.config, "_experts_implementation", None)
    model.set_experts_implementation(BASELINE)
    prompts, feed, captured = {}, {}, {}
    for req in requests:
        prompt, n = list(req.prompt_ids), int(tokens_of(req))
        if forced is not None:
            with forced.attach(model):
                forced.start_request(req.request_id)
                fed = teacher_forced(model, prompt, steps=n)
        else:
            with RoutingCapture(moe_routers(model)) as capture:
                fed = teacher_forced(model, prompt, steps=n)
            captured[req.request_id] = capture.arrays(len(prompt))
        prompts[req.request_id] = prompt
        feed[req.request_id] = answers.tokens[req.request_id] = fed.tokens[len(prompt) :]
    if forced is None:
        forced = ForcedRouting.from_arrays(captured, num_experts=num_experts)
        routing = "the baseline's own, captured in its greedy pass and forced on every other"
    else:
        routing = f"forced by the trace {forced_name}"
    tolerance = implementation_tolerance(
        model, prompts, feed, forced, impls, float32=float32, baseline=BASELINE
    )
    if before is not None:
        model.set_experts_implementation(before)
    return AgreementSet(workload, prompts, feed, forced, routing, tolerance)


def _row(aset: AgreementSet, run: str, kind: str, capacity, slots, figures: dict, entries) -> dict:
    return {
        "workload": aset.workload, "run": run, "kind": kind, "capacity": capacity, "slots": slots,
        "baseline": BASELINE, "requests": len(aset.prompts), **figures,
        "gpu_entries": entries[0] if entries else None, "cpu_entries": entries[1] if entries else None,
    }  # fmt: skip


def _from_truth(aset: AgreementSet, name: str) -> dict:
    """A transformers implementation's figures against the float32 truth (none without it)."""
    errors = aset.tolerance.from_truth.get(name)
    return {f"float32_{f}": errors.figures()[f] if errors is not None else None for f in FIGURES}


def tolerance_rows(aset: AgreementSet) -> list[dict]:
    """With a float32 truth, the baseline's row (its error against the truth); then one row per
    transformers implementation: its figures against the baseline, and against the truth (no verdict:
    they are the tolerance)."""
    none = {f"{f}_within": None for f in FIGURES} | {"within_tolerance": None, "within_float32_spread": None}
    rows = []
    if aset.tolerance.truth is not None:
        zero = {"positions": aset.positions, "max_abs_logit_error": 0.0, "mean_abs_logit_error": 0.0,
                "top1_agreement": 1.0}  # fmt: skip
        rows.append(
            _row(aset, BASELINE, BASE, None, None, {**zero, **none, **_from_truth(aset, BASELINE)}, None)
        )
    return rows + [
        _row(aset, impl, TOLERANCE, None, None, {**errors.figures(), **none, **_from_truth(aset, impl)}, None)
        for impl, errors in aset.tolerance.pairs.items()
    ]


def run_row(model, aset: AgreementSet, spec: RunSpec) -> dict:
    """The offloaded run `spec` held to the tolerance (module docstring): its agreement row."""
    counters = model.moecache.runtime.counters
    start = counters.copy()
    figures = agreement_row(model, aset.prompts, aset.feed, aset.tolerance, aset.forced)
    done = counters.since(start)
    entries = (done.gpu_entries, done.cpu_entries)
    return _row(aset, spec.label, MOECACHE, spec.capacity, spec.slots, figures, entries)


def summary(aset: AgreementSet, rows: list[dict]) -> dict:
    """validation.json's agreement entry of one workload: what was fed, how it was routed, the
    tolerance per implementation, and how many of its moecache rows are within it."""
    mine = [r for r in rows if r["workload"] == aset.workload and r["kind"] == MOECACHE]
    truth = aset.tolerance.truth is not None
    return {
        "baseline": f"transformers {BASELINE} (its default experts path)",
        "requests": len(aset.prompts),
        "positions": aset.positions,
        "fed_tokens": sum(len(f) for f in aset.feed.values()),
        "routing": aset.routing,
        "tolerance": {impl: e.figures() for impl, e in aset.tolerance.pairs.items()},
        "float32": {name: e.figures() for name, e in aset.tolerance.from_truth.items()} if truth else None,
        "runs": len(mine),
        "runs_within": sum(bool(r["within_tolerance"]) for r in mine),
        "runs_within_float32_spread": sum(bool(r["within_float32_spread"]) for r in mine) if truth else None,
    }
