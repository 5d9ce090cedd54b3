"""Second part of the decision: does a predictive policy consistently beat the first-part selection?

Legend: N per_block rows of one (trace, capacity, label), U bootstrap units, P compared labels (2).

For each policy of `rule.predictive.policies` (every parameter set swept is one choice):
1. Choice on a prefix: per trace, the blocks whose tokens start before `prefix_fraction` of the trace's
   tokens form the prefix; the parameter set with the lowest estimated time per token on the prefix,
   averaged over the trace's useful capacities, is chosen there (ties: the first label in sorted order).
2. Held-out: at each useful capacity of that trace, the chosen label against the reference (the
   first-part selection) on the remaining blocks: paired bootstrap over units (requests with at least
   `bootstrap.min_requests` of them among the held-out blocks, else blocks), verdict as in part one.
3. Other workload: the label chosen on a trace, against the reference on every trace of another workload
   (all of its blocks: none of them chose it), at each of that trace's useful capacities.
The policy is consistent when every one of those cells is "better" (the interval below 0) and passes the
first part's limits (hit-rate deficit, bytes per token, copy-engine busy fraction), every
required workload has held-out cells and, when two or more workloads are present, every trace was
judged on another workload too. Wins on some workloads only are reported as workload-specific. Among
consistent policies the one with the lowest mean held-out relative difference is selected, with the
parameter set chosen on the most traces (ties: the lowest mean prefix time).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa

from moecache.decision.bootstrap import paired_ratio_bootstrap
from moecache.decision.decide import BlockIndex, cell_seed, finite_or_none
from moecache.decision.rule import MIN_UNITS, Rule, classify
from moecache.sim.sweep import base_rows

SCHEMA = pa.schema(
    [
        ("policy", pa.string()),
        ("label", pa.string()),
        ("chosen_on", pa.string()),
        ("trace", pa.string()),
        ("workload", pa.string()),
        ("split", pa.string()),
        ("capacity", pa.int64()),
        ("reference", pa.string()),
        ("unit", pa.string()),
        ("units", pa.int64()),
        ("metric", pa.float64()),
        ("reference_metric", pa.float64()),
        ("rel_diff", pa.float64()),
        ("ci_lo", pa.float64()),
        ("ci_hi", pa.float64()),
        ("verdict", pa.string()),
    ]
)


def _prefix_mask(blocks: BlockIndex, sl: slice, fraction: float) -> np.ndarray:
    """Blocks (rows of `sl`, in trace order) whose first token comes before `fraction` of the tokens."""
    tokens_N = blocks.tokens_N[sl]
    start_N = np.cumsum(tokens_N) - tokens_N
    return start_N < fraction * tokens_N.sum()


def _compare(rule, blocks, trace, capacity, ref, label, keep_N, seed_key):
    """(unit, units, metrics, rel, lo, hi, verdict) of `label` vs `ref` on the kept blocks of a cell."""
    s_ref, s_lab = blocks.get(trace, capacity, ref), blocks.get(trace, capacity, label)
    if not keep_N.any():
        return "block", 0, [None, None], None, None, None, "inconclusive"
    req_N = blocks.request_N[s_ref][keep_N]
    starts = np.flatnonzero(np.r_[True, req_N[1:] != req_N[:-1]]) if len(req_N) else np.zeros(0, int)
    by_request = len(starts) >= rule.bootstrap.min_requests
    agg = (lambda x: np.add.reduceat(x, starts)) if by_request else (lambda x: x)
    num_PU = np.stack([agg(blocks.est_us_N[s][keep_N]) for s in (s_ref, s_lab)])
    den_PU = np.stack([agg(blocks.tokens_N[s][keep_N]) for s in (s_ref, s_lab)])
    rel, lo, hi = paired_ratio_bootstrap(
        num_PU, den_PU, 0, rule.bootstrap.resamples, cell_seed(rule.seed, seed_key, capacity), rule.confidence
    )
    units = num_PU.shape[1]
    verdict = (
        classify(finite_or_none(lo[1]), finite_or_none(hi[1]), rule.margin)
        if units >= MIN_UNITS
        else "inconclusive"
    )
    metric = [n.sum() / 1e3 / d.sum() if d.sum() > 0 else None for n, d in zip(num_PU, den_PU, strict=True)]
    return (
        "request" if by_request else "block",
        units,
        metric,
        finite_or_none(rel[1]),
        finite_or_none(lo[1]),
        finite_or_none(hi[1]),
        verdict,
    )


def evaluate(
    sweep: pa.Table, blocks: pa.Table, rule: Rule, reference: str, baseline: str, limits: dict | None = None
) -> tuple[pa.Table, dict]:
    """(rows of SCHEMA, summary) of the predictive policies against the `reference` label; useful
    capacities are where the `baseline` label's hit rate lies in the rule's useful range. `limits`:
    (trace, capacity, label) -> the first part's failed limits in words ("" when it passes); a cell
    whose label fails them counts against the policy like a verdict other than better."""
    limits = limits or {}
    rows = base_rows(sweep, rule.mode).to_pylist()
    workload_of = {r["trace"]: r["workload"] for r in rows}
    useful: dict[str, list[int]] = {}
    for r in rows:
        if r["label"] == baseline and rule.in_useful_range(finite_or_none(r["hit_rate"])):
            useful.setdefault(r["trace"], []).append(int(r["capacity"]))
    traces = sorted(useful)
    labels_of = {
        name: sorted({r["label"] for r in rows if r["policy"] == name}) for name in rule.predictive.policies
    }
    wanted = {reference} | {x for labels in labels_of.values() for x in labels}
    index = BlockIndex(blocks, wanted, rule.mode)
    present = sorted({workload_of[t] for t in traces})
    required = list(rule.required_workloads) if rule.required_workloads is not None else present

    out_rows: list[dict] = []
    policies: dict[str, dict] = {}
    for name, labels in labels_of.items():
        if not labels:
            policies[name] = {"consistent": False, "reasons": [f"{name}: not in the sweep"], "chosen": {}}
            continue
        chosen, prefix_ms, reasons, cells = {}, {}, [], []
        for t in traces:
            masks = {
                c: _prefix_mask(index, index.get(t, c, reference), rule.predictive.prefix_fraction)
                for c in useful[t]
            }
            score = {}
            for label in labels:
                per_cap = []
                for c in useful[t]:
                    sl, m = index.get(t, c, label), masks[c]
                    tokens = index.tokens_N[sl][m].sum()
                    per_cap.append(index.est_us_N[sl][m].sum() / 1e3 / tokens if tokens > 0 else np.inf)
                score[label] = float(np.mean(per_cap))
            chosen[t] = min(labels, key=lambda x: (score[x], x))
            prefix_ms[t] = score
            for c in useful[t]:
                cells.append(("held_out", t, t, c, ~masks[c]))
        for t in traces:
            for other in traces:
                if workload_of[other] != workload_of[t]:
                    for c in useful[other]:
                        keep = np.ones(
                            index.get(other, c, reference).stop - index.get(other, c, reference).start, bool
                        )
                        cells.append(("other_workload", t, other, c, keep))
        verdicts: dict[str, list[str]] = {}
        for split, chosen_on, t, c, keep in cells:
            label = chosen[chosen_on]
            unit, units, metric, rel, lo, hi, verdict = _compare(
                rule, index, t, c, reference, label, keep, f"{name}|{split}|{chosen_on}|{t}"
            )
            out_rows.append(
                {
                    "policy": name, "label": label, "chosen_on": chosen_on, "trace": t,
                    "workload": workload_of[t], "split": split, "capacity": c, "reference": reference,
                    "unit": unit, "units": units, "metric": finite_or_none(metric[1]), "reference_metric": finite_or_none(metric[0]),
                    "rel_diff": rel, "ci_lo": lo, "ci_hi": hi, "verdict": verdict,
                }
            )  # fmt: skip
            failed = limits.get((t, c, label), "")
            verdicts.setdefault(workload_of[t], []).append(verdict if not failed else "fails limits")
            if failed:
                reasons.append(f"{name} [{label}]: fails limits at {t} C={c} ({failed})")
            elif verdict != "better":
                where = f"{t} C={c}" + (f" (chosen on {chosen_on})" if split == "other_workload" else "")
                reasons.append(f"{name} [{label}]: {verdict} on {split.replace('_', ' ')} at {where}")
        wins = [w for w, v in verdicts.items() if v and all(x == "better" for x in v)]
        missing = [w for w in required if w not in verdicts]
        reasons += [f"{name}: no held-out cell of workload {w}" for w in missing]
        if len(present) >= 2 and not any(s == "other_workload" for s, *_ in cells):
            reasons.append(f"{name}: not judged on another workload")
        if not cells:
            reasons.append(f"{name}: no useful cell")
        consistent = bool(cells) and not reasons
        one_class = f"{name}: judged on one workload class only ({present}): a workload-specific result"
        notes = [] if len(present) >= 2 else [one_class]
        if not consistent and wins:
            reasons.append(f"{name}: workload-specific win: better everywhere on {wins} only")
        held = [r["rel_diff"] for r in out_rows if r["policy"] == name and r["split"] == "held_out"]
        policies[name] = {
            "consistent": consistent,
            "chosen": chosen,
            "better_on_workloads": wins,
            "mean_held_out_rel_diff": float(np.mean([x for x in held if x is not None])) if held else None,
            "prefix_ms_per_token": prefix_ms,
            "reasons": reasons,
            "notes": notes,
        }

    summary = {
        "reference": reference,
        "workloads": {"present": present, "required": required},
        "policies": policies,
    }
    winners = [n for n, p in policies.items() if p["consistent"]]
    if winners:
        best = min(winners, key=lambda n: (policies[n]["mean_held_out_rel_diff"], n))
        counts = Counter(policies[best]["chosen"].values())
        mean_prefix = {
            x: np.mean([policies[best]["prefix_ms_per_token"][t][x] for t in policies[best]["chosen"]])
            for x in counts
        }
        label = min(counts, key=lambda x: (-counts[x], mean_prefix[x], x))
        params = next(json.loads(r["params"]) for r in rows if r["label"] == label)
        summary["selected"] = {"policy": best, "params": params, "label": label}
    else:
        summary["selected"] = None
    return pa.Table.from_pylist(out_rows, schema=SCHEMA), summary


def apply(
    decision: dict, sweep: pa.Table, blocks: pa.Table, rule: Rule, verdicts: pa.Table | None = None
) -> pa.Table:
    """Run the second part against the first-part selection and record it in `decision` (in place):
    `predictive` holds the evaluation; a consistent predictive policy becomes `selected` and the
    first-part choice moves to `first_part`. Returns the comparison table."""
    if not rule.predictive.policies:
        decision["predictive"] = None
        return pa.Table.from_pylist([], schema=SCHEMA)
    limits = {}
    if verdicts is not None:
        for v in verdicts.select(["trace", "capacity", "label", "passes_limits", "reasons"]).to_pylist():
            limits[v["trace"], v["capacity"], v["label"]] = "" if v["passes_limits"] else v["reasons"]
    table, summary = evaluate(
        sweep, blocks, rule, decision["selected"]["label"], decision["baseline"]["label"], limits
    )
    decision["predictive"] = summary
    decision["first_part"] = decision["selected"]
    if summary["selected"] is not None:
        decision["selected"] = summary["selected"]
        decision["reasons"].append(
            f"selected {summary['selected']['label']}: consistently better than {summary['reference']}"
            " on held-out tokens"
            + (" and other workloads" if len(summary["workloads"]["present"]) >= 2 else "")
        )
        decision["reasons"] += summary["policies"][summary["selected"]["policy"]]["notes"]
    else:
        decision["reasons"].append(
            f"no predictive policy consistently beats {summary['reference']}: keeping it"
        )
        for p in summary["policies"].values():
            decision["reasons"] += p["reasons"][:3]
    return table
