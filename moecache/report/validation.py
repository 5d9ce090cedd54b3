"""The report's validation section: the runs of a validate artifact (moecache/stages/validate.py) as one
table per workload (strategy x capacity); the output agreement per workload (transformers' own tolerance,
then every offloaded run held to it); the simulator's fidelity per direction (the profile fitted on one
workload's runs, or calibrate's, predicting another's) with every run marked fitted or predicted, and
its predicted-vs-measured figure. Numbers are printed from the artifact's tables and validation.json,
never computed anew."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from moecache.report import markdown as md
from moecache.report.figures import fidelity_scatter
from moecache.report.tables import read_json

HEADERS = [
    "strategy", "capacity", "slots", "loop", "decode tok/s", "TTFT ms", "ITL p50 / p90 / p99 ms", "prefill tok/s",
    "hit rate", "copies", "late copies", "CPU fallbacks", "predicted hit rate", "predicted ms/token",
    "measured ms/token", "every repeat's ms/token (validate.repeats; the median kept)",
]  # fmt: skip
PHASE_HEADERS = [
    "workload", "strategy", "capacity", "time/token error %", "prefill ms/token measured -> predicted",
    "prefill error %", "decode ms/token measured -> predicted", "decode error %",
    "time/token error %, anchored on this workload (its all_resident, all_cpu fitted)",
]  # fmt: skip
AGREEMENT_HEADERS = [
    "run", "capacity", "slots", "max abs logit error", "mean abs logit error", "top-1 agreement",
    "within tolerance (max / mean / top-1)", "vs float32: max / mean / top-1", "within float32 spread",
    "GPU / CPU entries",
]  # fmt: skip
DIRECTION_HEADERS = [
    "fitted on -> predicted", "fitted runs", "predicted runs", "time/token within target", "time target",
    "hit rate within target", "hit rate target",
]  # fmt: skip
FIDELITY_HEADERS = [
    "direction", "run of", "strategy", "capacity", "role", "measured ms/token", "predicted ms/token",
    "error %", "measured hit rate", "predicted hit rate", "error pp", "CPU probe vs profile %",
]  # fmt: skip


def _row(r: dict) -> list:
    itl = " / ".join(md.num(r[f"itl_p{q}_ms"], 3) for q in (50, 90, 99))
    return [
        r["strategy"], r["capacity"] or "-", md.num(r["slots"]), r.get("loop") or "-",
        md.num(r["decode_tokens_per_s"], 4),
        md.num(r["ttft_ms"], 4), itl, md.num(r["prefill_tokens_per_s"], 4), md.num(r["hit_rate"], 4),
        md.num(r["copies"]), md.num(r["late_copies"]), md.num(r["cpu_fallbacks"]), md.num(r["predicted_hit_rate"], 4),
        md.num(r["predicted_time_per_token_ms"], 4), md.num(r["time_per_token_ms"], 4), _repeats(r),
    ]  # fmt: skip


def _repeats(r: dict) -> str:
    """Every repeat's time per token where the run was measured more than once (a row of validate
    schema 5); "-" otherwise."""
    times = r.get("time_per_token_ms_repeats") or []
    return " / ".join(md.num(t, 4) for t in times) if len(times) > 1 else "-"


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


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def agreement_lines(result: dict, rows: list[dict]) -> list[str]:
    """The output-agreement subsection: per workload, how it was fed and routed, then transformers'
    implementations (the tolerance) and every offloaded run against the baseline, its default path."""
    summary = result.get("agreement") or {}
    lines = [
        "### Output agreement: within the tolerance of transformers' own implementations",
        "",
    ]
    if not summary:
        return [*lines, "Not measured (validate.agreement_requests=0).", ""]
    lines += [
        "Every run teacher-forced on the same tokens with the same routing; its logits against transformers'"
        " default experts path (grouped_mm) at every position (max and mean |logit error| over positions x"
        " vocabulary, top-1 agreement). The tolerance is transformers' other implementation (its eager"
        " per-expert loop) against the same baseline; a moecache run is within it when its errors are at most"
        " that and its top-1 agreement at least that. The baseline is rounded too: against the eager loop in"
        " float32 (the truth; a float32 model's baseline is the truth itself) a run is within the spread when"
        " it is no further from it than transformers' own implementations are.",
        "",
    ]
    for workload, a in summary.items():
        mine = [r for r in rows if r["workload"] == workload]
        table = [
            [
                f"transformers {r['run']} ({r['kind']})" if r["kind"] != "moecache" else r["run"],
                r["capacity"] or "-", md.num(r["slots"]), md.num(r["max_abs_logit_error"], 3),
                md.num(r["mean_abs_logit_error"], 3), md.num(r["top1_agreement"], 4),
                "-" if r["kind"] != "moecache" else " / ".join(
                    _yes(r[f"{f}_within"]) for f in ("max_abs_logit_error", "mean_abs_logit_error", "top1_agreement")
                ),
                "-" if r.get("float32_max_abs_logit_error") is None else (
                    f"{md.num(r['float32_max_abs_logit_error'], 3)} / {md.num(r['float32_mean_abs_logit_error'], 3)}"
                    f" / {md.num(r['float32_top1_agreement'], 4)}"
                ),
                _yes(r.get("within_float32_spread")),
                "-" if r["gpu_entries"] is None else f"{r['gpu_entries']} / {r['cpu_entries']}",
            ]
            for r in mine
        ]  # fmt: skip
        spread = a.get("runs_within_float32_spread")
        lines += [
            f"{md.code(workload)}: {a['requests']} requests, {a['positions']} positions ({a['fed_tokens']} fed"
            f" tokens); routing {a['routing']}; {a['runs_within']} of {a['runs']} runs within the tolerance"
            + (f", {spread} of {a['runs']} within the float32 spread." if spread is not None else "."),
            "",
            md.table(AGREEMENT_HEADERS, table),
            "",
        ]
    return lines


def fidelity_lines(result: dict, rows: list[dict]) -> list[str]:
    """The fidelity subsection: the targets judged per direction, then every row marked fitted or
    predicted (validation.json's fidelity, fidelity.parquet)."""
    fid = result.get("fidelity")
    lines = ["### Simulator fidelity on runs the profile was not fitted on", ""]
    if not fid:
        return [*lines, "No fidelity table in this artifact.", ""]
    t = fid["targets"]
    lines += [
        f"Targets: time per token within {t['time_per_token_pct']:g}% for at least {t['time_within_share']:.0%}"
        f" of the predicted runs, hit rate within {t['hit_rate_pp']:g} percentage point for every one. 'calibrate"
        " -> W': the cost profile as calibrate fitted it on its own runs (random routing), none of them a run"
        " here. 'A -> B': the profile's decode anchors (non-expert time, CPU-step excess) fitted on workload A's"
        " all_resident and all_cpu runs (role fitted: priced exactly by construction), predicting every run of"
        " workload B (role predicted). 'no cost profile -> W': the hit rate alone, the replay of each run's own"
        " trace.",
        "",
    ]

    def verdict(d: dict, judged: str, within: str, met: str, share: bool) -> tuple[str, str]:
        if not d[judged]:
            return "-", "-"
        text = f"{d[within]} of {d[judged]}" + (f" ({d['time_within_share']:.0%})" if share else "")
        return text, "met" if d[met] else "**missed**"

    table = []
    for d in [*fid["directions"], *([{**fid["held_out"], "direction": "every cross-workload direction",
                                       "fitted_runs": "-"}] if fid["held_out"] else [])]:  # fmt: skip
        time_cell, time_met = verdict(d, "time_judged", "time_within", "time_target_met", True)
        hit_cell, hit_met = verdict(d, "hit_rate_judged", "hit_rate_within", "hit_rate_target_met", False)
        table.append(
            [d["direction"], d["fitted_runs"], d["predicted_runs"], time_cell, time_met, hit_cell, hit_met]
        )
    lines += [md.table(DIRECTION_HEADERS, table), ""]
    held = fid["held_out"]
    if held and held.get("time_judged_steady"):
        lines += [
            f"Of the held-out runs judged on time, {held['time_judged_steady']} ran on a steady machine (the CPU"
            f" probe timed just before the run within {t['machine_steady_pct']:g}% of the profile's); of those,"
            f" {held['time_within_steady']} are within {t['time_per_token_pct']:g}%. The others' errors mix the"
            " model's with the machine's change.",
            "",
        ]
    per_run = [
        [
            r["direction"], r["workload"], r["strategy"], r["capacity"] or "-", r["role"],
            md.num(r["measured_time_per_token_ms"], 4), md.num(r["predicted_time_per_token_ms"], 4),
            md.num(r["time_per_token_error_pct"], 3), md.num(r["measured_hit_rate"], 4),
            md.num(r["predicted_hit_rate"], 4), md.num(r["hit_rate_error_pp"], 3),
            md.num(r.get("cpu_probe_change_pct"), 3),
        ]
        for r in rows
    ]  # fmt: skip
    return [*lines, md.table(FIDELITY_HEADERS, per_run), ""]


def _table(folder: Path, name: str):
    path = folder / name
    return pq.read_table(path) if path.is_file() else None


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
    agreement = _table(validation_dir, "agreement.parquet")
    lines += agreement_lines(result, agreement.to_pylist() if agreement is not None else [])
    fidelity = _table(validation_dir, "fidelity.parquet")
    lines += fidelity_lines(result, fidelity.to_pylist() if fidelity is not None else [])
    written = []
    if fidelity is not None and fidelity.num_rows:
        target = result["fidelity"]["targets"]["time_per_token_pct"]
        written.append(fidelity_scatter(fidelity, figure_dir / "validation_fidelity.png", target))
        lines += ["![Predicted vs measured, fitted and predicted runs](figures/validation_fidelity.png)", ""]
    phase_rows = _phase_rows(runs)
    if phase_rows:
        lines += [
            "### Where the time-per-token error comes from",
            "",
            "The simulator's error per phase (per prompt token, per decoded token; runs.parquet's fidelity_errors),"
            " and its time-per-token error with the profile's decode anchors (non-expert time, CPU-step excess)"
            " moved onto the same workload's all_resident and all_cpu runs (fidelity_errors_anchored: those two"
            " runs fitted, the others predicted on the workload they were fitted on; '-': not both runs, or no"
            " fast-loop profile):",
            "",
            md.table(PHASE_HEADERS, phase_rows),
            "",
        ]
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
