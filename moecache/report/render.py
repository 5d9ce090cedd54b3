"""Render one self-contained report (report.md + figures/*.png) from the analysis, sweep and decision
artifacts.

The report reads only the artifacts' files (see moecache/report/tables.py for the columns it needs). An
absent artifact (None) or file skips its part with a sentence saying so. Figure file names are the trace name
made file-name safe plus a fixed suffix; the same inputs give the same report.md and PNG bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from moecache.report import decision_text, sections
from moecache.report import figures as fig
from moecache.report.roles import label_roles, label_specs
from moecache.report.tables import read_json, read_parquet, select, trace_names, unique_slugs

ANALYSIS_FILES = (
    "frequency.parquet",
    "reuse.parquet",
    "runs.parquet",
    "layer_transitions.parquet",
    "layer_mi.parquet",
    "window_drift.parquet",
    "convergence.parquet",
    "prefetch_lead.parquet",
)


def _has_rows(table: pa.Table | None, trace: str) -> bool:
    rows = select(table, trace=trace)
    return rows is not None and rows.num_rows > 0


def _workload(sweep: pa.Table | None, trace: str) -> str | None:
    rows = select(sweep, trace=trace)
    if rows is None or "workload" not in rows.column_names or rows.num_rows == 0:
        return None
    values = sorted({str(v) for v in rows["workload"].to_pylist() if v is not None})
    return ", ".join(values) or None


def _figure_plan(
    data: dict[str, pa.Table | None], labels: list[str], copy_us: dict[str, float], roles: dict, specs: dict
) -> list[tuple[str, str, str, list[str], Callable]]:
    """(suffix, title, artifact, files, draw(trace, path)) per per-trace figure."""
    d = data
    return [
        ("hit_rate", "Hit rate vs capacity", "sweep", ["sweep.parquet"],
         lambda t, p: fig.hit_rate_vs_capacity(d["sweep.parquet"], t, p, roles, specs)),
        ("ms_per_token", "Estimated time per token vs capacity", "sweep", ["sweep.parquet"],
         lambda t, p: fig.ms_per_token_vs_capacity(d["sweep.parquet"], t, p, roles, specs)),
        ("per_layer", "Per-layer hit rate", "sweep", ["per_layer.parquet"],
         lambda t, p: fig.per_layer_heatmap(d["per_layer.parquet"], t, labels, p)),
        ("frequency_cdf", "Expert-frequency concentration", "analysis", ["frequency.parquet"],
         lambda t, p: fig.frequency_cdf(d["frequency.parquet"], t, p)),
        ("reuse_runs", "Reuse distance and run length", "analysis", ["reuse.parquet", "runs.parquet"],
         lambda t, p: fig.reuse_and_runs(d["reuse.parquet"], d["runs.parquet"], t, p)),
        ("layer_transitions", "Adjacent-layer transitions and mutual information", "analysis",
         ["layer_transitions.parquet", "layer_mi.parquet"],
         lambda t, p: fig.layer_transitions(d["layer_transitions.parquet"], d["layer_mi.parquet"], t, p)),
        ("prefetch_lead", "Inter-layer prefetch recall vs lead time", "analysis", ["prefetch_lead.parquet"],
         lambda t, p: fig.prefetch_lead(d["prefetch_lead.parquet"], t, copy_us.get(t), p)),
        ("drift_convergence", "Drift and convergence", "analysis",
         ["window_drift.parquet", "convergence.parquet"],
         lambda t, p: fig.drift_and_convergence(d["window_drift.parquet"], d["convergence.parquet"], t, p)),
    ]  # fmt: skip


def _layer_labels(roles: dict[str, str], specs: dict) -> list[str]:
    """The per-layer heatmap's panels: the selected, first-part and baseline labels (LRU without a
    decision; else the first label)."""
    wanted = [x for x, r in roles.items() if r in ("selected", "first_part", "baseline")]
    wanted = wanted or [x for x, r in roles.items() if r == "lru"] or sorted(specs)[:1]
    return wanted[:3]


def _link(target: Path | None, name: str, out_dir: Path) -> str:
    """A Markdown link to an input artifact's file, relative to the report (artifacts are siblings)."""
    if target is None or not (Path(target) / name).is_file():
        return f"`{name}` (absent)"
    rel = os.path.relpath(Path(target) / name, out_dir)
    return f"[`{Path(target).name}/{name}`]({rel})"


def render_report(
    analysis_dir: Path | None,
    sweep_dir: Path,
    decision_dir: Path | None,
    out_dir: Path,
    validation_dir: Path | None = None,
) -> dict:
    """Write out_dir/report.md and out_dir/figures/*.png; return {"figures": [paths], "report": path}.
    With `validation_dir` (a validate artifact) the report ends its body with the validation section."""
    out_dir = Path(out_dir)
    figure_dir = out_dir / "figures"
    figure_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, pa.Table | None] = {name: read_parquet(analysis_dir, name) for name in ANALYSIS_FILES}
    for name in ("sweep.parquet", "targets.parquet", "per_layer.parquet"):
        data[name] = read_parquet(sweep_dir, name)
    summary = read_json(analysis_dir, "summary.json")
    decision = read_json(decision_dir, "decision.json")
    verdicts = read_parquet(decision_dir, "verdicts.parquet")
    cells = read_parquet(decision_dir, "extensions.parquet")
    specs = label_specs(data["sweep.parquet"])
    roles = label_roles(decision, specs)
    written: list[Path] = []

    dirs = {"analysis": analysis_dir, "sweep": sweep_dir}
    traces = trace_names(*data.values(), summary=summary)
    slugs = unique_slugs(traces)

    opening: list[str] = []
    if data["sweep.parquet"] is not None and traces:
        useful: dict[str, list[int]] = {}
        for v in verdicts.to_pylist() if verdicts is not None else []:
            if v["in_useful_range"]:
                useful.setdefault(v["trace"], []).append(v["capacity"])
        written.append(
            fig.overview(data["sweep.parquet"], traces, figure_dir / "overview.png", roles, specs, useful)
        )
        opening.append("![Estimated time per token vs capacity, every trace](figures/overview.png)")
    if verdicts is not None:
        written.append(fig.decision_verdicts(verdicts, decision, figure_dir / "decision_verdicts.png"))
        opening.append("![First part: the candidate vs the baseline per cell](figures/decision_verdicts.png)")
    extensions_link = None
    if cells is not None and cells.num_rows:
        written.append(fig.extensions_grid(cells, decision, figure_dir / "extensions.png"))
        extensions_link = "figures/extensions.png"
        opening.append(f"![Second part: every judged policy vs the reference]({extensions_link})")

    copy_us = {t: f.get("copy_us") for t, f in (summary or {}).items() if isinstance(f, dict)}
    plan = _figure_plan(data, _layer_labels(roles, specs), copy_us, roles, specs)
    trace_texts = []
    for trace in traces:
        entries: list[tuple[str, str | None, str]] = []
        for suffix, title, artifact, files, draw in plan:
            if dirs[artifact] is None:
                entries.append((title, None, f"The {artifact} artifact is absent; figure skipped."))
                continue
            present = [f for f in files if data[f] is not None]
            if not present:
                entries.append((title, None, f"{' and '.join(files)} absent from the {artifact} artifact."))
                continue
            if not any(_has_rows(data[f], trace) for f in present):
                entries.append((title, None, f"{' and '.join(present)} has no rows for this trace."))
                continue
            name = f"{slugs[trace]}-{suffix}.png"
            written.append(draw(trace, figure_dir / name))
            entries.append((title, f"figures/{name}", ""))
        trace_summary = (summary or {}).get(trace) if summary is not None else None
        trace_texts.append(
            sections.trace_section(
                trace,
                _workload(data["sweep.parquet"], trace),
                trace_summary if isinstance(trace_summary, dict) else None,
                "analysis" if analysis_dir is None else "summary.json" if summary is None else None,
                entries,
                data["targets.parquet"],
            )
        )

    def source(path: Path | None) -> str:
        return "absent" if path is None else f"`{Path(path).name}`"

    head = ["# moecache expert-offloading report", ""]
    if decision is None and verdicts is None:
        head += ["The decision artifact is absent; no decision is shown.", ""]
    else:
        head += [decision_text.headline(decision), "", decision_text.five_rows(decision), ""]
    head += [*(x for o in opening for x in (o, "")), ""]
    head += [
        f"Artifacts: analysis {source(analysis_dir)}, sweep {source(sweep_dir)}, decision {source(decision_dir)}."
        " The long tables are in the [appendix](#appendix).",
        "",
    ]
    if data["sweep.parquet"] is None:
        head += ["sweep.parquet is absent from the sweep artifact; the sweep figures are skipped.", ""]
    if analysis_dir is not None and summary is None:
        head += ["summary.json is absent from the analysis artifact.", ""]
    if not traces:
        trace_texts = ["No trace appears in any artifact.", ""]
    body = [decision_text.decision_details(decision), decision_text.extensions_section(decision, None)]
    text = "\n".join(head) + "\n" + "\n".join(body) + "\n" + "\n".join(trace_texts)
    if validation_dir is not None:
        from moecache.report.validation import section

        validation_text, validation_figures = section(
            Path(validation_dir), Path(decision_dir).name if decision_dir else None, figure_dir
        )
        text += "\n" + validation_text
        written += validation_figures
    text += "\n" + _appendix(
        decision, verdicts, cells, data["sweep.parquet"], decision_dir, sweep_dir, out_dir
    )
    report = out_dir / "report.md"
    report.write_text(text.rstrip("\n") + "\n")
    return {"figures": written, "report": report}


def _appendix(decision, verdicts, cells, sweep, decision_dir, sweep_dir, out_dir) -> str:
    """The long tables, each with a link to the Parquet file it is printed from."""
    out = ["## Appendix", "", "### A. First part: every verdict in the useful range", ""]
    out += [f"From {_link(decision_dir, 'verdicts.parquet', out_dir)}.", ""]
    if verdicts is None:
        out += ["verdicts.parquet is absent; no verdict table.", ""]
    else:
        confidence = ((decision or {}).get("rule") or {}).get("confidence")
        out += [decision_text.verdict_table(verdicts, confidence), ""]
    out += ["### B. Second part: every judged cell", ""]
    out += [f"From {_link(decision_dir, 'extensions.parquet', out_dir)}.", ""]
    out += [
        decision_text.cells_table(cells) if cells is not None and cells.num_rows else "No judged cell.",
        "",
    ]
    out += [
        "### C. Prefetch accounting of the judged prefetching policies (timed replay of the whole trace)",
        "",
    ]
    out += [f"From {_link(sweep_dir, 'sweep.parquet', out_dir)}.", ""]
    out += [sections.prefetch_table(sweep, cells) if cells is not None else "No judged cell.", ""]
    return "\n".join(out)
