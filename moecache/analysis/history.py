"""History length: which amount of routing history ranks experts best, chosen on a prefix of a trace
and judged on data it was not chosen on.

Candidates are parameter sets of the counting policies (cumulative LFU, LFU reset per request, windowed
LFU, decayed LFU; the sets are the sweep's, conf/analyze/default.yaml), each a PolicySpec, replayed in instant mode at a few capacities (multiples of layers x top_k). For each
trace: the candidate with the highest mean hit rate over the prefix (the forward steps that start
before `prefix_fraction` of the trace's tokens; ties: the earlier candidate) is selected; the table then
gives every candidate's hit rate on the held-out rest of the same replay (the policy keeps its state across the split, as it would when
running on) and on each other trace as a whole, so a reader sees whether the prefix's choice holds.

Legend: V layer visits, F forward steps, A accesses.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moecache.errors import MoecacheError
from moecache.sim.cost_model import forward_index
from moecache.sim.policy import make_policy
from moecache.sim.policy_spec import PolicySpec
from moecache.sim.replay import replay_instant
from moecache.sim.trace_arrays import TraceArrays


def candidates_from(config: dict) -> list[PolicySpec]:
    """`analyze.history.candidates` (policy name -> list of parameter sets) as PolicySpecs, in order; an
    unknown policy or parameter is an error naming it, and a set listed twice is kept once."""
    out: list[PolicySpec] = []
    for name, sets in config.items():
        for i, p in enumerate(sets or []):
            spec = PolicySpec.of(name, p or {}, f"analyze.history.candidates.{name}[{i}]")
            if spec not in out:
                out.append(spec)
    if not out:
        raise MoecacheError("analyze.history.candidates is empty: nothing to compare")
    return out


def capacities_for(trace: TraceArrays, multiples: list[float]) -> list[int]:
    """Capacities of `multiples` x (layers x top_k) slots, at least 1 and at most every key."""
    per_token = trace.num_layers * trace.top_k
    return sorted({min(trace.num_keys, max(1, int(round(m * per_token)))) for m in multiples})


def split_access(trace: TraceArrays, prefix_fraction: float) -> int:
    """The first access of the held-out part: the prefix is the forward steps that start before
    `prefix_fraction` of the trace's tokens (the rule `moecache decide` splits its blocks by), with
    at least one forward step in each part when the trace has two or more."""
    if not 0 < prefix_fraction < 1:
        raise MoecacheError(f"analyze.history.prefix_fraction={prefix_fraction}: must be in (0, 1)")
    _, first_F = forward_index(trace)
    forwards = len(first_F)
    before_F = trace.clock_V[first_F]  # tokens of the trace before each forward step
    cut = int(np.searchsorted(before_F, prefix_fraction * trace.num_tokens, side="left"))
    cut = min(max(1, cut), max(1, forwards - 1))
    return int(trace.start_V[first_F[cut]]) if cut < forwards else trace.num_accesses


def _rate(hit_A: np.ndarray) -> float | None:
    return float(hit_A.mean()) if hit_A.size else None


def history_table(
    traces: list[TraceArrays], candidates: list[PolicySpec], multiples: list[float], prefix_fraction: float
) -> tuple[pa.Table, dict[str, dict]]:
    """(rows: trace, label, policy, params, capacity, split, hit_rate, selected; per-trace summary)."""
    # hit rates of every candidate on every trace: prefix, held-out and whole trace
    rates: dict[tuple[int, int, int], dict[str, float | None]] = {}
    caps = [capacities_for(t, multiples) for t in traces]
    for ti, trace in enumerate(traces):
        cut = split_access(trace, prefix_fraction)
        for ci, cand in enumerate(candidates):
            for capacity in caps[ti]:
                hit_A = replay_instant(trace, make_policy(cand.name, **cand.params), capacity).hit_A
                rates[ti, ci, capacity] = {
                    "prefix": _rate(hit_A[:cut]),
                    "held_out": _rate(hit_A[cut:]),
                    "whole": _rate(hit_A),
                }
    rows, summary = [], {}
    for ti, trace in enumerate(traces):

        def mean_over_caps(ci: int, split: str, on: int) -> float:
            values = [rates[on, ci, c][split] for c in caps[on]]
            return (
                float(np.mean([v for v in values if v is not None]))
                if any(v is not None for v in values)
                else -1.0
            )

        scores = [mean_over_caps(ci, "prefix", ti) for ci in range(len(candidates))]
        chosen = int(np.argmax(scores))  # first maximum: the earlier candidate wins ties
        for ci, cand in enumerate(candidates):
            base = {
                "trace": trace.name,
                "label": cand.label(),
                "policy": cand.name,
                "params": cand.params_json,
                "selected": ci == chosen,
            }
            for capacity in caps[ti]:
                for split in ("prefix", "held_out"):
                    rows.append(
                        {
                            **base,
                            "capacity": capacity,
                            "split": split,
                            "hit_rate": rates[ti, ci, capacity][split],
                        }
                    )
            for oi, other in enumerate(traces):
                if oi != ti:
                    for capacity in caps[oi]:
                        rows.append(
                            {
                                **base,
                                "capacity": capacity,
                                "split": f"other:{other.name}",
                                "hit_rate": rates[oi, ci, capacity]["whole"],
                            }
                        )
        held = [mean_over_caps(ci, "held_out", ti) for ci in range(len(candidates))]
        best_held = int(np.argmax(held))
        figures = {
            "history_selected": candidates[chosen].label(),
            "history_selected_prefix_hit_rate": scores[chosen],
            "history_selected_held_out_hit_rate": held[chosen],
            "history_best_held_out": candidates[best_held].label(),
            "history_held_out_regret": held[best_held] - held[chosen],
        }
        others = [oi for oi in range(len(traces)) if oi != ti]
        if others:
            regret = [
                max(mean_over_caps(ci, "whole", oi) for ci in range(len(candidates)))
                - mean_over_caps(chosen, "whole", oi)
                for oi in others
            ]
            figures["history_other_traces_mean_regret"] = float(np.mean(regret))
        summary[trace.name] = figures
    return pa.Table.from_pylist(rows), summary
