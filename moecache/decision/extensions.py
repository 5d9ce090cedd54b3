"""Second part of the decision: is any other swept policy better than the first-part selection, generally
or only on some workloads and capacities?

Legend: N per_block rows of one (trace, capacity, label), U bootstrap units, P compared labels (2).

Judged: every policy named by `rule.extensions` (by default every swept policy but the baseline's and
`extensions.exclude`, i.e. LFU reset per request, decayed and windowed LFU, LRU, LRFU, per-layer budgets
and the predictive policies alike). Each swept parameter set of a policy is one choice:
1. Choice on a prefix: per trace, the blocks whose tokens start before `prefix_fraction` of the trace's
   tokens form the prefix; the parameter set with the lowest estimated time per token on the prefix,
   averaged over the trace's useful capacities, is chosen there (ties: the first label in sorted order).
2. Held-out: at each useful capacity of that trace, the chosen label against the reference (the
   first-part selection) on the remaining blocks: paired bootstrap over units (requests with at least
   `bootstrap.min_requests` of them among the held-out blocks, else blocks), verdict as in part one.
3. Other workload: the label chosen on a trace, against the reference on every trace of another workload
   (all of its blocks: none of them chose it), at each of that trace's useful capacities.
A cell counts for the policy when its verdict is "better" (the interval below 0) and the label passes the
first part's limits there (hit-rate deficit, bytes per token, copy-engine busy fraction).

Outcomes (decision.json):
- consistent: every cell counts, every required workload has held-out cells and, when two or more
  workloads are present, every trace was judged on another workload too. The consistent policy first in
  `extensions.preference`, then with the lowest mean held-out relative difference, replaces the
  first-part selection, with the parameter set chosen on the most traces (ties: the lowest mean prefix
  time). This is the `selected` policy.
- best generic: the policy whose every cell is competitive (better, equivalent or non-inferior, within
  the limits) with the lowest mean relative difference over all its cells; the reference itself (r = 0)
  when none does better. Descriptive: it need not be better everywhere.
- wins: every (policy, trace, split) whose cells count at some capacities, with r and its interval
  per capacity, for every policy but the selected one (their capacity- or workload-specific wins).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from moecache.analysis.schema import BOOL, F64, I64, STR, schema
from moecache.decision.bootstrap import paired_ratio_bootstrap
from moecache.decision.decide import BlockIndex, cell_seed, comparison_columns, finite_or_none, policy_labels
from moecache.decision.rule import COMPETITIVE, MIN_UNITS, Rule, classify
from moecache.sim.sweep import base_rows

SCHEMA = schema(
    policy=STR, label=STR, chosen_on=STR, trace=STR, workload=STR, split=STR, capacity=I64,
    capacity_fraction=F64, reference=STR,
    **comparison_columns("reference"),
    passes_limits=BOOL, limits=STR,
)  # fmt: skip


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


def _choose(index, rule, trace, capacities, labels, reference):
    """(the label with the lowest mean prefix time per token, {label: that mean}, {capacity: prefix mask})."""
    masks = {
        c: _prefix_mask(index, index.get(trace, c, reference), rule.extensions.prefix_fraction)
        for c in capacities
    }
    score = {}
    for label in labels:
        per_cap = []
        for c in capacities:
            sl, m = index.get(trace, c, label), masks[c]
            tokens = index.tokens_N[sl][m].sum()
            per_cap.append(index.est_us_N[sl][m].sum() / 1e3 / tokens if tokens > 0 else np.inf)
        score[label] = float(np.mean(per_cap))
    return min(labels, key=lambda x: (score[x], x)), score, masks


def _mean(values) -> float | None:
    values = [x for x in values if x is not None]
    return float(np.mean(values)) if values else None


def _judge(name, labels, ctx) -> tuple[list[dict], dict]:
    """(cell rows, summary) of one policy: its choices on the prefixes and every judged cell."""
    rule, index, reference = ctx["rule"], ctx["index"], ctx["reference"]
    useful, workload_of, fraction_of = ctx["useful"], ctx["workload_of"], ctx["fraction_of"]
    traces = sorted(useful)
    chosen, prefix_ms, cells = {}, {}, []
    for t in traces:
        chosen[t], prefix_ms[t], masks = _choose(index, rule, t, useful[t], labels, reference)
        cells += [("held_out", t, t, c, ~masks[c]) for c in useful[t]]
    for t in traces:
        for other in traces:
            if workload_of[other] != workload_of[t]:
                for c in useful[other]:
                    sl = index.get(other, c, reference)
                    cells.append(("other_workload", t, other, c, np.ones(sl.stop - sl.start, bool)))
    rows, reasons, verdicts = [], [], {}
    for split, chosen_on, t, c, keep in cells:
        label = chosen[chosen_on]
        unit, units, metric, rel, lo, hi, verdict = _compare(
            rule, index, t, c, reference, label, keep, f"{name}|{split}|{chosen_on}|{t}"
        )
        failed = ctx["limits"].get((t, c, label), "")
        rows.append(
            {
                "policy": name, "label": label, "chosen_on": chosen_on, "trace": t, "workload": workload_of[t],
                "split": split, "capacity": c, "capacity_fraction": fraction_of.get((t, c)),
                "reference": reference, "unit": unit, "units": units, "metric": finite_or_none(metric[1]),
                "reference_metric": finite_or_none(metric[0]), "rel_diff": rel, "ci_lo": lo, "ci_hi": hi,
                "verdict": verdict, "passes_limits": not failed, "limits": failed,
            }
        )  # fmt: skip
        verdicts.setdefault(workload_of[t], []).append(verdict if not failed else "fails limits")
        if failed:
            reasons.append(f"{name} [{label}]: fails limits at {t} C={c} ({failed})")
        elif verdict != "better":
            where = f"{t} C={c}" + (f" (chosen on {chosen_on})" if split == "other_workload" else "")
            reasons.append(f"{name} [{label}]: {verdict} on {split.replace('_', ' ')} at {where}")
    present, required = ctx["present"], ctx["required"]
    wins = [w for w, v in verdicts.items() if v and all(x == "better" for x in v)]
    reasons += [f"{name}: no held-out cell of workload {w}" for w in required if w not in verdicts]
    if len(present) >= 2 and not any(s == "other_workload" for s, *_ in cells):
        reasons.append(f"{name}: not judged on another workload")
    if not cells:
        reasons.append(f"{name}: no useful cell")
    consistent = bool(cells) and not reasons
    notes = [] if len(present) >= 2 else [
        f"{name}: judged on one workload class only ({present}): a workload-specific result"
    ]  # fmt: skip
    if not consistent and wins:
        reasons.append(f"{name}: workload-specific win: better everywhere on {wins} only")
    competitive = bool(rows) and all(r["verdict"] in COMPETITIVE and r["passes_limits"] for r in rows)
    label = _most_chosen(chosen, prefix_ms)
    return rows, {
        "consistent": consistent,
        "competitive_everywhere": competitive,
        "chosen": chosen,
        "label": label,
        "params": ctx["spec_of"][label].params if label else None,
        "better_on_workloads": wins,
        "verdicts": dict(sorted(Counter(r["verdict"] for r in rows).items())),
        "mean_held_out_rel_diff": _mean(r["rel_diff"] for r in rows if r["split"] == "held_out"),
        "mean_rel_diff": _mean(r["rel_diff"] for r in rows),
        "prefix_ms_per_token": prefix_ms,
        "reasons": reasons,
        "notes": notes,
    }


def _most_chosen(chosen: dict[str, str], prefix_ms: dict[str, dict[str, float]]) -> str | None:
    """The label chosen on the most traces (ties: the lowest mean prefix time, then the label)."""
    if not chosen:
        return None
    counts = Counter(chosen.values())
    mean_prefix = {x: np.mean([prefix_ms[t][x] for t in chosen]) for x in counts}
    return min(counts, key=lambda x: (-counts[x], mean_prefix[x], x))


def _wins(rows: list[dict], policies: dict[str, dict], selected: str | None, spec_of) -> list[dict]:
    """Every (policy, trace, split, chosen_on) with cells that count (better, within the limits), but the
    selected policy's, in policy then trace order; each with r and its interval per capacity."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["policy"] != selected and r["verdict"] == "better" and r["passes_limits"]:
            groups.setdefault((r["policy"], r["trace"], r["split"], r["chosen_on"], r["label"]), []).append(r)
    out = []
    for (name, trace, split, chosen_on, label), cells in sorted(groups.items()):
        judged = [r for r in rows if (r["policy"], r["trace"], r["split"], r["chosen_on"]) ==
                  (name, trace, split, chosen_on)]  # fmt: skip
        out.append(
            {
                **spec_of[label].to_dict(),
                "label": label,
                "trace": trace,
                "workload": cells[0]["workload"],
                "split": split,
                "chosen_on": chosen_on,
                "reference": cells[0]["reference"],
                "capacities": [r["capacity"] for r in cells],
                "of_capacities": len(judged),
                "consistent": policies[name]["consistent"],
                "cells": [
                    {k: r[k] for k in ("capacity", "capacity_fraction", "rel_diff", "ci_lo", "ci_hi")}
                    for r in cells
                ],
            }
        )
    return out


def _best_generic(policies: dict[str, dict], reference: str, spec_of) -> dict:
    """The policy competitive in every cell with the lowest mean r (< 0), else the reference."""
    fits = [n for n, p in policies.items() if p["competitive_everywhere"] and (p["mean_rel_diff"] or 0) < 0]
    if not fits:
        return {
            **spec_of[reference].to_dict(),
            "label": reference,
            "mean_rel_diff": 0.0,
            "is_reference": True,
        }
    best = min(fits, key=lambda n: (policies[n]["mean_rel_diff"], n))
    p = policies[best]
    return {
        "policy": best,
        "params": p["params"],
        "label": p["label"],
        "mean_rel_diff": p["mean_rel_diff"],
        "verdicts": p["verdicts"],
        "consistent": p["consistent"],
        "is_reference": False,
    }


def evaluate(
    sweep: pa.Table, blocks: pa.Table, rule: Rule, reference: str, baseline: str, limits: dict | None = None
) -> tuple[pa.Table, dict]:
    """(rows of SCHEMA, summary) of the judged policies against the `reference` label; useful
    capacities are where the `baseline` label's hit rate lies in the rule's useful range. `limits`:
    (trace, capacity, label) -> the first part's failed limits in words ("" when it passes); a cell
    whose label fails them counts against the policy like a verdict other than better."""
    rows = base_rows(sweep, rule.mode).to_pylist()
    spec_of = policy_labels(rows)
    workload_of = {r["trace"]: r["workload"] for r in rows}
    fraction_of = {(r["trace"], int(r["capacity"])): finite_or_none(r.get("capacity_fraction")) for r in rows}
    useful: dict[str, list[int]] = {}
    for r in rows:
        if r["label"] == baseline and rule.in_useful_range(finite_or_none(r["hit_rate"])):
            useful.setdefault(r["trace"], []).append(int(r["capacity"]))
    swept = sorted({s.name for s in spec_of.values()})
    names = rule.extensions.judged(swept, spec_of[baseline].name)
    labels_of = {n: sorted(x for x, s in spec_of.items() if s.name == n) for n in names}
    present = sorted({workload_of[t] for t in useful})
    ctx = {
        "rule": rule,
        "reference": reference,
        "index": BlockIndex(blocks, {reference} | {x for ls in labels_of.values() for x in ls}, rule.mode),
        "useful": useful,
        "workload_of": workload_of,
        "fraction_of": fraction_of,
        "limits": limits or {},
        "spec_of": spec_of,
        "present": present,
        "required": list(rule.required_workloads) if rule.required_workloads is not None else present,
    }
    out_rows: list[dict] = []
    policies: dict[str, dict] = {}
    for name, labels in labels_of.items():
        if not labels:
            policies[name] = {"consistent": False, "competitive_everywhere": False, "chosen": {},
                              "reasons": [f"{name}: not in the sweep"], "notes": []}  # fmt: skip
            continue
        cells, policies[name] = _judge(name, labels, ctx)
        out_rows += cells

    order = {n: i for i, n in enumerate(rule.extensions.preference)}
    winners = sorted(
        (n for n, p in policies.items() if p["consistent"]),
        key=lambda n: (order.get(n, len(order)), policies[n]["mean_held_out_rel_diff"], n),
    )
    selected = None
    if winners:
        p = policies[winners[0]]
        selected = {"policy": winners[0], "params": p["params"], "label": p["label"]}
    summary = {
        "reference": reference,
        "judged": names,
        "workloads": {"present": present, "required": ctx["required"]},
        "policies": policies,
        "selected": selected,
        "best_generic": _best_generic(
            {n: p for n, p in policies.items() if "label" in p}, reference, spec_of
        ),
        "wins": _wins(out_rows, policies, selected["policy"] if selected else None, spec_of),
    }
    return pa.Table.from_pylist(out_rows, schema=SCHEMA), summary


def apply(
    decision: dict, sweep: pa.Table, blocks: pa.Table, rule: Rule, verdicts: pa.Table | None = None
) -> pa.Table:
    """Run the second part against the first-part selection and record it in `decision` (in place):
    `extensions` holds the evaluation, `best_generic` and `wins` its findings; a consistent policy
    becomes `selected` and the first-part choice moves to `first_part`. Returns the comparison table."""
    limits = {}
    if verdicts is not None:
        for v in verdicts.select(["trace", "capacity", "label", "passes_limits", "reasons"]).to_pylist():
            limits[v["trace"], v["capacity"], v["label"]] = "" if v["passes_limits"] else v["reasons"]
    table, summary = evaluate(
        sweep, blocks, rule, decision["selected"]["label"], decision["baseline"]["label"], limits
    )
    decision["first_part"] = decision["selected"]
    decision["best_generic"] = summary.pop("best_generic")
    decision["wins"] = summary.pop("wins")
    decision["extensions"] = summary
    reference = summary["reference"]
    if summary["selected"] is not None:
        decision["selected"] = summary["selected"]
        decision["reasons"].append(
            f"selected {summary['selected']['label']}: consistently better than {reference} on held-out tokens"
            + (" and other workloads" if len(summary["workloads"]["present"]) >= 2 else "")
        )
        decision["reasons"] += summary["policies"][summary["selected"]["policy"]]["notes"]
    else:
        decision["reasons"].append(f"no judged policy is consistently better than {reference}: keeping it")
        for p in summary["policies"].values():
            decision["reasons"] += p["reasons"][:2]
    best = decision["best_generic"]
    if not best["is_reference"]:
        decision["reasons"].append(
            f"best generic policy: {best['label']} (competitive in every judged cell, mean r"
            f" {best['mean_rel_diff']:+.3f} against {reference})"
        )
    for w in decision["wins"]:
        if not w["consistent"]:
            decision["reasons"].append(win_sentence(w))
    return table


def win_sentence(w: dict) -> str:
    """One line naming a win: policy, trace, split, capacities, r and its interval per capacity."""
    cells = ", ".join(
        f"C={c['capacity']}: r {c['rel_diff']:+.3f} [{c['ci_lo']:+.3f}, {c['ci_hi']:+.3f}]"
        for c in w["cells"]
    )
    chosen = f", chosen on {w['chosen_on']}" if w["split"] == "other_workload" else ""
    return (
        f"specific win: {w['label']} better than {w['reference']} on {w['trace']} ({w['workload']},"
        f" {w['split'].replace('_', ' ')}{chosen}) at {len(w['capacities'])} of {w['of_capacities']}"
        f" capacities: {cells}"
    )
