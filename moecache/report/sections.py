"""The Markdown text of the report's per-trace sections (headline numbers, figures, capacity to target) and
of the prefetch accounting table; the decision's text is in decision_text.py.

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
    """Prefetch accounting (sweep rows, timed, base scales) of the judged (label, trace, capacity) cells
    whose policy prefetched."""
    if sweep is None or any(c not in sweep.column_names for c in PREFETCH_COLUMNS):
        return "The sweep has no prefetch columns."
    cells = {(r["label"], r["trace"], r["capacity"]) for r in table.to_pylist() if r["split"] == "held_out"}
    rows = [
        r
        for r in sweep.to_pylist()
        if (r["label"], r["trace"], r["capacity"]) in cells
        and r["mode"] == "timed"
        and r["prefetches"]
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
