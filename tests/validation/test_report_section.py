"""The report's validation section: one table per workload with every run, the output agreement against
transformers' tolerance, the fidelity per direction with every run marked fitted or predicted and its
figure only where the artifact has fidelity rows, and a sentence (not a crash) without an artifact."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from moecache.report.validation import section
from moecache.validation import holdout
from moecache.validation.tables import AGREEMENT_SCHEMA, RUNS_SCHEMA, write


def run_row(workload: str, strategy: str, capacity: str | None, predicted: float | None) -> dict:
    row = dict.fromkeys(RUNS_SCHEMA.names)
    row.update(
        workload=workload, strategy=strategy, capacity=capacity, slots=None if capacity is None else 32,
        decode_tokens_per_s=123.4, ttft_ms=5.0, itl_p50_ms=1.0, itl_p90_ms=2.0, itl_p99_ms=3.0,
        prefill_tokens_per_s=1000.0, hit_rate=0.25, time_per_token_ms=2.5, predicted_hit_rate=predicted,
        predicted_time_per_token_ms=None if predicted is None else 2.0, trace="traces/x/trace.parquet",
    )  # fmt: skip
    return row


def fidelity_row(direction: str, fit_on, workload: str, role: str, within: bool) -> dict:
    return {
        "direction": direction, "fit_on": fit_on, "profile": "p.json", "workload": workload, "strategy": "selected",
        "capacity": "25%", "slots": 32, "role": role, "measured_time_per_token_ms": 2.5,
        "predicted_time_per_token_ms": 2.0 if within else 1.0, "time_per_token_error_pct": -20.0 if not within else -5.0,
        "time_within_target": within, "measured_hit_rate": 0.25, "predicted_hit_rate": 0.25,
        "hit_rate_error_pp": 0.0, "hit_rate_within_target": True,
    }  # fmt: skip


def artifact(folder, predicted, errors=None, machine_check=None, fidelity=()):
    folder.mkdir()
    runs = [run_row(w, s, c, predicted) for w in ("multi_request", "long_single") for s, c in
            (("unmodified", None), ("selected", "25%"))]  # fmt: skip
    for r in runs:
        if errors is not None and r["strategy"] == "selected":
            r["fidelity_errors"] = json.dumps(errors)
    write(folder, runs, [], [], list(fidelity))
    result = {
        "decision": "decide-abc", "selected": {"label": "lfu"}, "model": "tiny", "device": "cpu",
        "execution": "transformers generate (eager)", "workloads": ["multi_request", "long_single"],
        "runs": runs, "machine_check": machine_check, "agreement": {},
        "fidelity": holdout.summary(list(fidelity)) if fidelity else None,
    }  # fmt: skip
    (folder / "validation.json").write_text(json.dumps(result))
    return folder


def test_a_table_per_workload_and_no_figure_without_predictions(tmp_path):
    text, figures = section(artifact(tmp_path / "validate-1", None), "decide-abc", tmp_path / "figures")
    assert (
        text.count("### ") == 4 and "### multi_request" in text and "### long_single" in text
    )  # + agreement, fidelity
    assert text.count("| selected | 25% | 32 | - | 123.4 |") == 2 and "| unmodified | - |" in text
    assert figures == [] and "No fidelity table in this artifact" in text and "another decision" not in text
    assert "Not measured (validate.agreement_requests=0)" in text
    assert "Where the time-per-token error comes from" not in text  # no run has a phase's figures


def test_the_error_per_phase_is_a_table_of_its_own(tmp_path):
    errors = {
        "time_per_token_error_pct": -20.0,
        "phases": {"prefill": {"predicted_ms": 3.0, "measured_ms": 6.0, "error_pct": -50.0}},
    }
    text, _ = section(artifact(tmp_path / "validate-3", 0.3, errors), "decide-abc", tmp_path / "figures")
    assert "### Where the time-per-token error comes from" in text
    assert text.count("| selected | 25% | -20 | 6 -> 3 | -50 | - | - | - |") == 2  # one row per workload


def test_the_anchored_error_is_a_column_of_the_phase_table(tmp_path):
    errors = {
        "time_per_token_error_pct": -20.0,
        "phases": {"decode": {"predicted_ms": 2.0, "measured_ms": 2.5, "error_pct": -20.0}},
    }
    folder = artifact(tmp_path / "validate-7", 0.3, errors)
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    for r in runs:
        if r["strategy"] == "selected":
            r["fidelity_errors_anchored"] = json.dumps({"time_per_token_error_pct": -4.5})
    write(folder, runs, [], [], [])
    text, _ = section(folder, "decide-abc", tmp_path / "figures")
    assert "anchored on this workload (its all_resident, all_cpu fitted)" in text
    assert text.count("| selected | 25% | -20 | - | - | 2.5 -> 2 | -20 | -4.5 |") == 2


def test_the_machine_check_is_said_and_a_change_is_flagged(tmp_path):
    cpu = {
        "probe": "cpu expert", "what": "one expert, 1 token, bfloat16, 16 threads", "profile_median_us": 600.0,
        "before_median_us": 630.0, "after_median_us": 990.0, "change_pct_before": 5.0, "change_pct_after": 65.0,
    }  # fmt: skip
    host = cpu | {"probe": "host loop", "what": "20000 Python loop iterations, one thread", "profile_median_us": 900.0,
                  "change_pct_before": 1.0, "change_pct_after": 2.0}  # fmt: skip
    check = {"probes": [cpu, host], "change_target_pct": 10.0, "changed": True}
    text, _ = section(artifact(tmp_path / "validate-4", 0.3, None, check), "decide-abc", tmp_path / "f")
    assert (
        "cpu expert (one expert, 1 token, bfloat16, 16 threads: 600.0 us then) +5.0% before the runs, +65.0% after;"
        in text
    )
    assert (
        "host loop (20000 Python loop iterations, one thread: 900.0 us then) +1.0%" in text
        and "Beyond 10%" in text
    )
    quiet = {"probes": [host], "change_target_pct": 10.0, "changed": False}
    text, _ = section(artifact(tmp_path / "validate-5", 0.3, None, quiet), "decide-abc", tmp_path / "f")
    assert "+2.0% after." in text and "Beyond" not in text
    text, _ = section(artifact(tmp_path / "validate-6", 0.3), "decide-abc", tmp_path / "f")
    assert "since the cost profile" not in text


def test_the_fidelity_is_judged_per_direction_drawn_and_another_decision_is_named(tmp_path):
    rows = [
        fidelity_row("calibrate -> long_single", None, "long_single", "predicted", True),
        fidelity_row("multi_request -> long_single", "multi_request", "multi_request", "fitted", True),
        *[fidelity_row("multi_request -> long_single", "multi_request", "long_single", "predicted", ok)
          for ok in (True, False)],
    ]  # fmt: skip
    for r, probe in zip(rows, (1.0, 2.0, -3.0, 35.0), strict=True):  # the held-out miss: a slower machine
        r["cpu_probe_change_pct"] = probe
    folder = artifact(tmp_path / "validate-2", 0.3, fidelity=rows)
    text, figures = section(folder, "decide-other", tmp_path / "figures")
    assert [f.name for f in figures] == ["validation_fidelity.png"] and figures[0].is_file()
    assert "figures/validation_fidelity.png" in text and "`decide-other`" in text
    assert "| calibrate -> long_single | 0 | 1 | 1 of 1 (100%) | met | 1 of 1 | met |" in text
    assert "| multi_request -> long_single | 1 | 2 | 1 of 2 (50%) | **missed** | 2 of 2 | met |" in text
    assert "| every cross-workload direction | - | 2 | 1 of 2 (50%) | **missed** |" in text
    assert "| multi_request -> long_single | multi_request | selected | 25% | fitted | 2.5 | 2 | -5 |" in text
    assert "Of the held-out runs judged on time, 1 ran on a steady machine" in text
    assert "of those, 1 are within 15%" in text
    assert "| -20 | 0.25 | 0.25 | 0 | 35 |" in text  # the per-run table's probe column


def test_the_agreement_is_a_table_per_workload_with_its_tolerance_first(tmp_path):
    folder = artifact(tmp_path / "validate-8", None)
    figures = dict.fromkeys(("max_abs_logit_error", "mean_abs_logit_error", "top1_agreement"))
    rows = [
        {**dict.fromkeys(AGREEMENT_SCHEMA.names), "workload": "multi_request", "run": "eager", "kind": "tolerance",
         "baseline": "grouped_mm", "requests": 1, "positions": 40, "max_abs_logit_error": 0.5,
         "mean_abs_logit_error": 0.01, "top1_agreement": 0.95},
        {**dict.fromkeys(AGREEMENT_SCHEMA.names), "workload": "multi_request", "run": "selected", "kind": "moecache",
         "capacity": "25%", "slots": 32, "baseline": "grouped_mm", "requests": 1, "positions": 40,
         "max_abs_logit_error": 0.25, "mean_abs_logit_error": 0.02, "top1_agreement": 0.975,
         **{f"{f}_within": f != "mean_abs_logit_error" for f in figures}, "within_tolerance": False,
         "gpu_entries": 100, "cpu_entries": 60},
    ]  # fmt: skip
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    write(folder, runs, [], rows, [])
    result = json.loads((folder / "validation.json").read_text())
    result["agreement"] = {"multi_request": {
        "requests": 1, "positions": 40, "fed_tokens": 8, "routing": "forced by the trace t", "runs": 1,
        "runs_within": 0,
    }}  # fmt: skip
    (folder / "validation.json").write_text(json.dumps(result))
    text, _ = section(folder, "decide-abc", tmp_path / "figures")
    assert (
        "`multi_request`: 1 requests, 40 positions (8 fed tokens); routing forced by the trace t; 0 of 1"
        in text
    )
    assert "| transformers eager (tolerance) | - | n/a | 0.5 | 0.01 | 0.95 | - | - | - | - |" in text
    assert "| selected | 25% | 32 | 0.25 | 0.02 | 0.975 | yes / NO / yes | - | - | 100 / 60 |" in text


def test_no_artifact_is_a_sentence(tmp_path):
    text, figures = section(None, None, tmp_path)
    assert "No validation artifact" in text and figures == []


def test_a_repeated_run_shows_every_repeats_time(tmp_path):
    """A row with validate.repeats' times shows them all in the run table; a run measured once shows "-"."""
    folder = artifact(tmp_path / "validate-r", None)
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    runs[1]["time_per_token_ms_repeats"] = [2.75, 2.5, 2.625]
    runs[3]["time_per_token_ms_repeats"] = [2.5]
    write(folder, runs, [], [], [])
    text, _ = section(folder, "decide-abc", tmp_path / "figures")
    assert "| 2.5 | 2.75 / 2.5 / 2.625 |" in text
    assert text.count("| 2.5 | - |") == 3  # the references and the run measured once
