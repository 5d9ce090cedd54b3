"""The Markdown text of the report's sections: the decision, and one section per trace.

Each function takes artifact contents (tables, JSON dicts, figure links) and returns Markdown; an absent
artifact gives a sentence saying so. Numbers are printed from the artifacts, never computed anew.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa

from moecache.report import markdown as md
from moecache.report.tables import base_scales, preferred_mode, select

# Topics of the analysis summary figures, matched on the figure's name, in the order they are listed.
TOPICS: tuple[tuple[str, str], ...] = (
    ("concentration", r"gini|entropy|cover|effective|concentration|top_share|share_top"),
    ("reuse", r"reuse|run|distance|recurrence"),
    ("layer MI", r"(^|[_.])mi([_.]|$)|mutual"),
    ("predictors", r"recall|predictor"),
    ("drift", r"drift|js|spearman|converg|overlap"),
)


def topic(name: str) -> str:
    for title, pattern in TOPICS:
        if re.search(pattern, name.lower()):
            return title
    return "other"


def flatten(summary: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(name, value) pairs of a summary dict; nested dicts give dotted names, lists print as JSON."""
    out: list[tuple[str, object]] = []
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flatten(value, f"{name}.")
        elif isinstance(value, list | tuple):
            out.append((name, json.dumps(value)))
        else:
            out.append((name, value))
    return out


def headline_table(summary: dict) -> str:
    """The trace's summary figures, grouped by topic (concentration, reuse, layer MI, predictors, drift)."""
    order = [t for t, _ in TOPICS] + ["other"]
    rows = sorted(flatten(summary), key=lambda kv: (order.index(topic(kv[0])), kv[0]))
    return md.table(["topic", "figure", "value"], [[topic(k), md.code(k), md.num(v)] for k, v in rows])


def _selected_text(decision: dict) -> str:
    selected = decision.get("selected")
    baseline = decision.get("baseline") or {}
    base = md.code(baseline.get("label") or baseline.get("policy") or "n/a")
    if not selected:
        return (
            f"**No candidate was selected**: none was competitive against the baseline {base} under the rule."
        )
    params = json.dumps(selected.get("params") or {}, sort_keys=True)
    return (
        f"**Selected policy: {md.code(selected.get('label') or selected.get('policy'))}** "
        f"(policy {md.code(selected.get('policy'))}, params {md.code(params)}), against the baseline {base}."
    )


def _rule_text(decision: dict) -> str:
    rule = decision.get("rule") or {}
    parts = [
        f"metric {md.code(rule.get('metric', 'n/a'))} in {md.code(rule.get('mode', 'n/a'))} mode "
        "(lower is better)",
        f"equivalence margin ±{md.pct(rule.get('margin'), sign=False)}",
        f"{md.pct(rule.get('confidence'), digits=0, sign=False)} confidence",
    ]
    useful = (rule.get("useful_range") or {}).get("baseline_hit_rate")
    if useful:
        parts.append(f"useful range: baseline hit rate in {json.dumps(useful)}")
    deficit = (rule.get("hit_rate") or {}).get("max_deficit")
    if deficit is not None:
        parts.append(f"hit-rate deficit at most {md.num(deficit)}")
    return "Rule: " + "; ".join(parts) + "."


def verdict_rows(verdicts: pa.Table) -> list[dict]:
    """Candidate rows in the useful range, sorted by trace, capacity and label."""
    rows = [r for r in verdicts.to_pylist() if r["role"] == "candidate" and r["in_useful_range"]]
    return sorted(rows, key=lambda r: (str(r["trace"]), r["capacity"], str(r["label"])))


def verdict_table(verdicts: pa.Table, confidence) -> str:
    rows = verdict_rows(verdicts)
    if not rows:
        return "No candidate row lies in the useful range."
    ci = f"CI ({md.pct(confidence, digits=0, sign=False)})" if confidence is not None else "CI"
    headers = ["trace", "workload", "capacity", "label", "verdict", "rel_diff", ci, "hit rate vs baseline"]
    headers += ["bytes/token", "notes"]
    body = [
        [
            r["trace"],
            r["workload"],
            r["capacity"],
            md.code(r["label"]),
            r["verdict"],
            md.pct(r["rel_diff"]),
            md.interval(r["ci_lo"], r["ci_hi"]),
            f"{md.num(r['hit_rate'])} vs {md.num(r['baseline_hit_rate'])}",
            md.num(r["bytes_per_token"]),
            r["reasons"] or "",
        ]
        for r in rows
    ]
    return md.table(headers, body)


def decision_section(decision: dict | None, verdicts: pa.Table | None, figure: str | None) -> str:
    """The decision: selected policy, reasons, rule, figure and the verdict table."""
    out = ["## Decision", ""]
    if decision is None and verdicts is None:
        return "\n".join(out + ["The decision artifact is absent; this section is skipped.", ""])
    if decision is None:
        out += ["decision.json is absent; only the verdicts are shown.", ""]
    else:
        out += [_selected_text(decision), "", "Reasons:", ""]
        reasons = decision.get("reasons") or []
        out += [f"- {r}" for r in reasons] if reasons else ["- none recorded"]
        out += ["", _rule_text(decision), ""]
        competitive = decision.get("competitive") or {}
        if competitive:
            listed = ", ".join(
                f"{md.code(k)}: {'yes' if v else 'no'}" for k, v in sorted(competitive.items())
            )
            out += [f"Competitive labels: {listed}.", ""]
        workloads = decision.get("workloads") or {}
        if workloads:
            present = ", ".join(map(str, workloads.get("present") or [])) or "none"
            required = ", ".join(map(str, workloads.get("required") or [])) or "none"
            out += [f"Workloads present: {present}; required: {required}.", ""]
        if "cells" in decision or "seed" in decision:
            out += [
                f"Cells judged: {md.num(decision.get('cells'))}; "
                f"bootstrap seed: {md.num(decision.get('seed'))}.",
                "",
            ]
    if figure is not None:
        out += [f"![Verdict per trace and capacity]({figure})", ""]
    if verdicts is None:
        out += ["verdicts.parquet is absent; no verdict table.", ""]
    else:
        confidence = ((decision or {}).get("rule") or {}).get("confidence")
        out += [
            "### Verdicts of the candidates in the useful range",
            "",
            verdict_table(verdicts, confidence),
            "",
        ]
    return "\n".join(out)


def targets_table(targets: pa.Table | None, trace: str) -> str:
    """Per label, the smallest swept capacity reaching each target hit rate (base scales, timed if any)."""
    rows = select(targets, trace=trace)
    if rows is None:
        return "targets.parquet is absent from the sweep artifact."
    rows = base_scales(rows)
    mode = preferred_mode(rows)
    rows = select(rows, mode=mode)
    if rows.num_rows == 0:
        return "targets.parquet has no rows for this trace."
    goals = sorted({float(v) for v in rows["target_hit_rate"].to_pylist() if v is not None})
    found: dict[tuple[str, float], object] = {}
    for r in rows.to_pylist():
        found[(str(r["label"]), float(r["target_hit_rate"]))] = r["capacity"]
    labels = sorted({label for label, _ in found})
    body = [
        [md.code(label)]
        + ["not reached" if found.get((label, g)) is None else md.num(found[(label, g)]) for g in goals]
        for label in labels
    ]
    intro = (
        f"Smallest swept capacity (expert slots) reaching each hit rate ({mode} replay, base cost scales):"
    )
    return intro + "\n\n" + md.table(["label"] + [f"hit rate ≥ {md.num(g)}" for g in goals], body)


def trace_section(
    trace: str,
    workload: str | None,
    summary: dict | None,
    absent: str | None,
    figures: list[tuple[str, str | None, str]],
    targets: pa.Table | None,
) -> str:
    """One trace: headline numbers, figures (title, link or None, sentence when absent), capacity to
    target. `absent` names the missing analysis input ("analysis", "summary.json") or is None."""
    out = [f"## Trace {md.code(trace)}", ""]
    if workload:
        out += [f"Workload: {md.code(workload)}.", ""]
    out += ["### Headline numbers", ""]
    if absent == "analysis":
        out += ["The analysis artifact is absent; no headline numbers.", ""]
    elif absent is not None:
        out += [f"{absent} is absent from the analysis artifact; no headline numbers.", ""]
    elif summary is None:
        out += ["The analysis summary.json has no entry for this trace.", ""]
    else:
        out += ["From the analysis summary.json:", "", headline_table(summary), ""]
    out += ["### Figures", ""]
    for title, link, note in figures:
        out += [f"**{title}**", "", f"![{title}]({link})" if link is not None else note, ""]
    out += ["### Capacity to target", "", targets_table(targets, trace), ""]
    return "\n".join(out)


PREFETCH_COLUMNS = ("prefetches", "prefetch_accuracy", "prefetch_timely", "prefetch_wasted_bytes")


def prefetch_table(sweep: pa.Table | None, table: pa.Table) -> str:
    """Prefetch accounting (sweep rows, timed, base scales) of the judged (label, trace, capacity) cells."""
    if sweep is None or any(c not in sweep.column_names for c in PREFETCH_COLUMNS):
        return "The sweep has no prefetch columns."
    cells = {(r["label"], r["trace"], r["capacity"]) for r in table.to_pylist() if r["split"] == "held_out"}
    rows = [
        r
        for r in sweep.to_pylist()
        if (r["label"], r["trace"], r["capacity"]) in cells
        and r["mode"] == "timed"
        and all(r.get(k, 1.0) == 1.0 for k in ("bandwidth_scale", "cpu_scale", "gpu_scale"))
    ]
    rows.sort(key=lambda r: (r["label"], r["trace"], r["capacity"]))
    body = [
        [md.code(r["label"]), r["trace"], r["capacity"], md.num(r["prefetches"] / r["tokens"] if r["tokens"] else None),
         md.num(r["prefetch_accuracy"]), md.num(r["prefetch_timely"]),
         md.num(r["prefetch_wasted_bytes"] / r["tokens"] if r["tokens"] else None),
         md.num(r.get("prefetch_lead_us_median")), md.num(r["hit_rate"])]
        for r in rows
    ]  # fmt: skip
    headers = ["label", "trace", "capacity", "prefetches/token", "accuracy", "timely", "wasted bytes/token"]
    return md.table(headers + ["median lead (us)", "hit rate"], body) if body else "No judged cell."


def predictive_section(
    decision: dict | None, table: pa.Table | None, figure: str | None, sweep: pa.Table | None = None
) -> str:
    """The second part: each predictive policy's choice on the prefixes, whether it is consistently
    better than the first-part selection, and every judged cell."""
    out = ["## Predictive strategies (second part)", ""]
    summary = (decision or {}).get("predictive")
    if not summary:
        return "\n".join(out + ["The decision judged no predictive policy.", ""])
    first = ((decision or {}).get("first_part") or {}).get("label")
    out += [f"Reference: the first-part selection {md.code(summary.get('reference') or first)}.", ""]
    selected = summary.get("selected")
    present = (summary.get("workloads") or {}).get("present") or []
    where = (
        "on held-out tokens and other workloads"
        if len(present) >= 2
        else f"on held-out tokens of one workload class only ({', '.join(present)}): a workload-specific result"
    )
    out += [
        f"**Selected: {md.code(selected['label'])}**, consistently better {where}."
        if selected
        else "No predictive policy is consistently better: the first-part selection stands.",
        "",
    ]
    body = []
    for name, p in sorted((summary.get("policies") or {}).items()):
        chosen = ", ".join(f"{t}: {md.code(x)}" for t, x in sorted((p.get("chosen") or {}).items()))
        wins = ", ".join(p.get("better_on_workloads") or []) or "none"
        reasons = "; ".join(((p.get("reasons") or []) + (p.get("notes") or []))[:4])
        body.append(
            [
                name,
                chosen or "n/a",
                "yes" if p.get("consistent") else "no",
                md.pct(p.get("mean_held_out_rel_diff")),
                wins,
                reasons,
            ]
        )
    out += [
        md.table(
            ["policy", "chosen on each prefix", "consistent", "mean held-out r", "better on", "reasons"], body
        ),
        "",
    ]
    if figure is not None:
        out += [f"![Predictive policies vs the first-part selection]({figure})", ""]
    if table is not None and table.num_rows:
        out += ["### Prefetch accounting of the chosen parameter sets (timed replay of the whole trace)", ""]
        out += [prefetch_table(sweep, table), "", "### Every judged cell", ""]
        rows = sorted(table.to_pylist(), key=lambda r: (r["policy"], r["split"], r["trace"], r["capacity"]))
        out += [
            md.table(
                ["policy", "label", "split", "trace", "capacity", "unit (n)", "r", "CI", "verdict"],
                [
                    [r["policy"], md.code(r["label"]), r["split"], r["trace"], r["capacity"],
                     f"{r['unit']} ({r['units']})", md.pct(r["rel_diff"]), md.interval(r["ci_lo"], r["ci_hi"]),
                     r["verdict"]]
                    for r in rows
                ],
            ),
            "",
        ]  # fmt: skip
    return "\n".join(out)
