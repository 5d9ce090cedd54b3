"""The report's validation section: the runs of a validate artifact (moecache/stages/validate.py) as one
table per workload (strategy x capacity), and a predicted-vs-measured figure where the artifact holds
the simulator's predictions. Numbers are printed from runs.parquet, never computed anew."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pyarrow.parquet as pq

from moecache.report import markdown as md
from moecache.report.tables import read_json

HEADERS = [
    "strategy", "capacity", "slots", "loop", "decode tok/s", "TTFT ms", "ITL p50 / p90 / p99 ms", "prefill tok/s",
    "hit rate", "copies", "late copies", "CPU fallbacks", "token match", "max logit err",
    "predicted hit rate", "predicted ms/token", "measured ms/token",
]  # fmt: skip
PHASE_HEADERS = [
    "workload", "strategy", "capacity", "time/token error %", "prefill ms/token measured -> predicted",
    "prefill error %", "decode ms/token measured -> predicted", "decode error %",
    "time/token error %, anchored here",
]  # fmt: skip


def _row(r: dict) -> list:
    itl = " / ".join(md.num(r[f"itl_p{q}_ms"], 3) for q in (50, 90, 99))
    return [
        r["strategy"], r["capacity"] or "-", md.num(r["slots"]), r.get("loop") or "-",
        md.num(r["decode_tokens_per_s"], 4),
        md.num(r["ttft_ms"], 4), itl, md.num(r["prefill_tokens_per_s"], 4), md.num(r["hit_rate"], 4),
        md.num(r["copies"]), md.num(r["late_copies"]), md.num(r["cpu_fallbacks"]),
        md.num(r["token_match_rate"], 4), md.num(r["max_logit_error"], 3), md.num(r["predicted_hit_rate"], 4),
        md.num(r["predicted_time_per_token_ms"], 4), md.num(r["time_per_token_ms"], 4),
    ]  # fmt: skip


def _phase_rows(runs: list[dict]) -> list[list]:
    rows = []
    for r in runs:
        errors = json.loads(r["fidelity_errors"]) if r.get("fidelity_errors") else {}
        phases = errors.get("phases") or {}
        if not phases:
            continue
        row = [
            r["workload"],
            r["strategy"],
            r["capacity"] or "-",
            md.num(errors.get("time_per_token_error_pct"), 3),
        ]
        for phase in ("prefill", "decode"):
            p = phases.get(phase)
            if p is None:
                row += ["-", "-"]
            else:
                row += [
                    f"{md.num(p['measured_ms'], 4)} -> {md.num(p['predicted_ms'], 4)}",
                    md.num(p["error_pct"], 3),
                ]
        anchored = json.loads(r["fidelity_errors_anchored"]) if r.get("fidelity_errors_anchored") else {}
        anchored_pct = anchored.get("time_per_token_error_pct")
        row.append("-" if anchored_pct is None else md.num(anchored_pct, 3))
        rows.append(row)
    return rows


def predicted_vs_measured(runs: list[dict], path: Path) -> Path | None:
    """Hit rate and time per token, predicted (x) against measured (y), one point per run; None when no
    run has a prediction."""
    pairs = {
        "hit rate": [(r["predicted_hit_rate"], r["hit_rate"]) for r in runs],
        "time per token (ms)": [(r["predicted_time_per_token_ms"], r["time_per_token_ms"]) for r in runs],
    }
    pairs = {k: [(p, m) for p, m in v if p is not None and m is not None] for k, v in pairs.items()}
    if not any(pairs.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), layout="constrained")
    for ax, (what, points) in zip(axes, pairs.items(), strict=True):
        ax.set_title(what)
        ax.set_xlabel("predicted (simulator, the run's own trace)")
        ax.set_ylabel("measured")
        if not points:
            ax.text(0.5, 0.5, "no prediction", ha="center", va="center", transform=ax.transAxes)
            continue
        xs, ys = zip(*points, strict=True)
        ax.scatter(xs, ys, s=18)
        top = max(max(xs), max(ys)) * 1.05
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


def section(validation_dir: Path | None, decision_id: str | None, figure_dir: Path) -> tuple[str, list[Path]]:
    """The section's Markdown and the figures it wrote (links relative to the report folder)."""
    lines = ["## Validation: the selected policy end to end", ""]
    if validation_dir is None:
        return "\n".join([*lines, "No validation artifact (run `moecache validate`).", ""]), []
    result = read_json(validation_dir, "validation.json")
    runs_path = validation_dir / "runs.parquet"  # not tables.read_parquet: analyze has a runs.parquet too
    if result is None or not runs_path.is_file():
        return "\n".join(
            [*lines, f"`{validation_dir.name}` holds no validation.json / runs.parquet.", ""]
        ), []
    runs = pq.read_table(runs_path).to_pylist()
    lines.append(
        f"Artifact `{validation_dir.name}`: decision `{result['decision']}` (selected "
        f"{md.code(result['selected']['label'])}), model {md.code(result['model'])} on {result['device']}, "
        f"execution: {result['execution']}."
    )
    if decision_id is not None and result["decision"] != decision_id:
        lines.append(
            f"It validates another decision than this report's (`{decision_id}`): none validates it."
        )
    lines.append("")
    for workload in result["workloads"]:
        rows = [_row(r) for r in runs if r["workload"] == workload]
        lines += [f"### {workload}", "", md.table(HEADERS, rows), ""]
    lines += _machine_lines(result.get("machine_check"))
    phase_rows = _phase_rows(runs)
    if phase_rows:
        lines += [
            "### Where the time-per-token error comes from",
            "",
            "The simulator's error per phase (per prompt token, per decoded token; runs.parquet's fidelity_errors),"
            " and its time-per-token error with the profile's decode anchors (non-expert time, CPU-step excess)"
            " moved onto this artifact's own all_resident and all_cpu runs (fidelity_errors_anchored; '-':"
            " not both runs, or no fast-loop profile):",
            "",
            md.table(PHASE_HEADERS, phase_rows),
            "",
        ]
    written = []
    figure = predicted_vs_measured(runs, figure_dir / "validation_predicted_vs_measured.png")
    if figure is None:
        lines += ["No predicted values in any run; no predicted-vs-measured figure.", ""]
    else:
        written.append(figure)
        lines += ["![Predicted vs measured per run](figures/validation_predicted_vs_measured.png)", ""]
    return "\n".join(lines), written


def _machine_lines(check: dict | None) -> list[str]:
    """validate's machine check (moecache/validation/machine_check.py) as a paragraph, where it ran."""
    if check is None:
        return []
    said = (
        "The machine since the cost profile was measured: "
        + "; ".join(
            f"{p['probe']} ({p['what']}: {p['profile_median_us']:.1f} us then) {p['change_pct_before']:+.1f}%"
            f" before the runs, {p['change_pct_after']:+.1f}% after"
            for p in check["probes"]
        )
        + "."
    )
    if check["changed"]:
        said += (
            f" Beyond {check['change_target_pct']:.0f}%: the fidelity errors below mix the simulator's error"
            " with the machine's change; calibrate again and validate on a quiet machine."
        )
    return [said, ""]
