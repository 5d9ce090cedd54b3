"""`moecache validate` with two forcing traces and a cost profile, through the CLI, on the tiny model (CPU,
fp32): two synthetic ESFT-format routings of the tiny shape (4 MoE layers x 32 experts, top-4), imported
as `alpha` and `beta` with 8-token prefill steps, each a workload of its own.

The fidelity table holds calibrate's profile predicting every run, and both cross-workload directions:
the profile anchored on one workload's all_resident and all_cpu runs (those rows `fitted`, their decode
priced exactly) predicting every run of the other (rows `predicted`, on that profile and no other); the
targets judged per direction and over the held-out runs; the report draws them. The agreement table
holds each workload's tolerance and every run, forced by its trace."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.cli import app
from moecache.sim.policy_spec import PolicySpec
from moecache.validation import predict
from tests.validation.test_anchors import _with_excess
from tests.validation.test_validate_stage import decision

L, E, K = 4, 32, 4  # the tiny model
PROMPT, NEW, REQUESTS = 8, 4, 2
STRATEGIES = ["all_resident", "all_cpu", "selected"]
REPLAYED = {"all_resident": "static_cold", "all_cpu": "static_cold", "selected": "lru"}  # the simulator's


def _import(root: Path, npz: Path, name: str) -> str:
    res = CliRunner().invoke(app, [
        "import-trace", f"output_root={root}", f"trace_import.path={npz}", f"trace_import.name={name}",
        f"trace_import.num_layers={L}", f"trace_import.num_experts={E}", f"trace_import.top_k={K}",
        "trace_import.expert_bytes=24576", f"trace_import.tokens_per_step={PROMPT}",
        "trace_import.licence_file=null",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    return Path(res.stdout.strip().splitlines()[-1]).name


@pytest.fixture(scope="module")
def held_out(tmp_path_factory, make_esft_npz):
    root = tmp_path_factory.mktemp("holdout")
    ids = [
        _import(root, make_esft_npz(root / f"{name}.npz", L, E, K, [24, 20], seed, random_weights=True), name)
        for name, seed in (("alpha", 0), ("beta", 1))
    ]
    decision(root)
    res = CliRunner().invoke(app, [
        "validate", f"output_root={root}", f"validate.forced_trace=[{','.join(ids)}]",
        f"validate.forced_requests={REQUESTS}", f"validate.forced_max_tokens={NEW}", "validate.capacities=[25%]",
        f"validate.strategies=[{','.join(STRATEGIES)}]", f"validate.cost_profile={_with_excess(root, 0.0)}",
        "validate.agreement_requests=2",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    return folder, json.loads((folder / "validation.json").read_text())


def test_each_workload_is_predicted_on_the_profile_fitted_on_the_other(held_out):
    folder, result = held_out
    assert result["workloads"] == ["alpha", "beta"] and len(result["forced"]) == 2
    rows = pq.read_table(folder / "fidelity.parquet").to_pylist()
    runs = {(r["workload"], r["strategy"]): r for r in result["runs"] if r["strategy"] != "unmodified"}
    assert len(runs) == 2 * len(STRATEGIES)
    calibrate = [r for r in rows if r["fit_on"] is None]
    assert len(calibrate) == len(runs) and {r["role"] for r in calibrate} == {"predicted"}
    for fit_on, other in (("alpha", "beta"), ("beta", "alpha")):
        mine = [r for r in rows if r["fit_on"] == fit_on]
        profile = f"cost_profile_anchored_{fit_on}.json"
        assert {r["profile"] for r in mine} == {profile}
        fitted = [r for r in mine if r["role"] == "fitted"]
        predicted = [r for r in mine if r["role"] == "predicted"]
        assert {(r["workload"], r["strategy"]) for r in fitted} == {
            (fit_on, "all_resident"),
            (fit_on, "all_cpu"),
        }
        assert {(r["workload"], r["strategy"]) for r in predicted} == {(other, s) for s in STRATEGIES}
        for r in fitted:  # the anchored prediction of the workload's own anchors: what runs.parquet says
            anchored = json.loads(runs[(fit_on, r["strategy"])]["fidelity_errors_anchored"])
            assert r["time_per_token_error_pct"] == pytest.approx(anchored["time_per_token_error_pct"])
            if r["strategy"] == "all_resident":  # its decode priced exactly (all_cpu's too, unless its excess
                # was kept at 0: tests/validation/test_anchors.py)
                assert anchored["phases"]["decode"]["error_pct"] == pytest.approx(0.0, abs=1e-6)
        for r in predicted:  # the other workload's run, replayed with this profile and no other
            run = runs[(other, r["strategy"])]
            again = predict.predict(
                folder / run["trace"],
                PolicySpec.of(REPLAYED[r["strategy"]]),
                r["slots"],
                str(folder / profile),
                run,
            )
            assert r["predicted_time_per_token_ms"] == pytest.approx(again["predicted_time_per_token_ms"])
            assert r["measured_time_per_token_ms"] == run["time_per_token_ms"]
            assert r["direction"] == f"{fit_on} -> {other}"
            assert r["time_within_target"] == (abs(r["time_per_token_error_pct"]) <= 15.0)


def test_the_targets_are_judged_per_direction_and_over_the_held_out_runs(held_out):
    folder, result = held_out
    fid = result["fidelity"]
    names = [d["direction"] for d in fid["directions"]]
    assert names == ["calibrate -> alpha", "calibrate -> beta", "alpha -> beta", "beta -> alpha"]
    rows = pq.read_table(folder / "fidelity.parquet").to_pylist()
    for d in fid["directions"]:
        mine = [r for r in rows if r["direction"] == d["direction"] and r["role"] == "predicted"]
        assert d["predicted_runs"] == len(mine) == len(STRATEGIES) and {r["workload"] for r in mine} == {
            d["workload"]
        }
        fitted = [r for r in rows if r["direction"] == d["direction"] and r["role"] == "fitted"]
        assert d["fitted_runs"] == len(fitted) == (0 if d["fit_on"] is None else 2)
        assert {r["workload"] for r in fitted} == ({d["fit_on"]} if fitted else set())
        within = sum(r["time_within_target"] for r in mine)
        assert d["time_judged"] == len(STRATEGIES) and d["time_within"] == within
        assert d["time_target_met"] == (within / len(STRATEGIES) >= 0.9)
        assert d["hit_rate_within"] == len(STRATEGIES) and d["hit_rate_target_met"]  # the replay: exact
    held = fid["held_out"]
    assert held["predicted_runs"] == 2 * len(STRATEGIES)
    assert held["time_within"] == sum(d["time_within"] for d in fid["directions"] if d["fit_on"])
    assert fid["targets"] == {
        "time_per_token_pct": 15.0, "time_within_share": 0.9, "hit_rate_pp": 1.0, "machine_steady_pct": 10.0,
    }  # fmt: skip


def test_each_run_carries_the_machine_probe_timed_before_it(held_out):
    """The CPU probe timed just before every offloaded run (a % against the profile's), in runs.parquet and
    on each of the run's fidelity rows; the held-out summary counts the runs on a steady machine (within
    10%) and how many of those are within the time target."""
    folder, result = held_out
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    probed = {(r["workload"], r["strategy"], r["capacity"]): r["cpu_probe_change_pct"] for r in runs}
    assert all((v is None) == (strategy == "unmodified") for (_, strategy, _), v in probed.items()), (
        probed
    )  # the unmodified reference is not predicted: not probed
    rows = pq.read_table(folder / "fidelity.parquet").to_pylist()
    for r in rows:
        assert r["cpu_probe_change_pct"] == probed[(r["workload"], r["strategy"], r["capacity"])]
    across = [r for r in rows if r["fit_on"] is not None and r["role"] == "predicted"]
    steady = [r for r in across if abs(r["cpu_probe_change_pct"]) <= 10.0]
    held = result["fidelity"]["held_out"]
    assert held["time_judged_steady"] == len(steady)
    assert held["time_within_steady"] == sum(r["time_within_target"] for r in steady)


def test_every_run_is_held_to_the_tolerance_on_its_forcing_trace(held_out):
    folder, result = held_out
    rows = pq.read_table(folder / "agreement.parquet").to_pylist()
    for workload in ("alpha", "beta"):
        summary = result["agreement"][workload]
        assert summary["routing"] == f"forced by the trace {workload}" and summary["requests"] == REQUESTS
        assert summary["positions"] == REQUESTS * (PROMPT + NEW - 1)  # what every run routes
        mine = [r for r in rows if r["workload"] == workload]
        assert [(r["kind"], r["run"]) for r in mine] == [
            ("baseline", "grouped_mm"),
            ("tolerance", "eager"),
        ] + [("moecache", s) for s in STRATEGIES]
        selected = mine[-1]
        assert selected["gpu_entries"] > 0 < selected["cpu_entries"]
        assert selected["gpu_entries"] + selected["cpu_entries"] == summary["positions"] * L * K


def test_the_report_draws_fitted_and_predicted_runs(held_out, tmp_path):
    from moecache.report.validation import section

    folder, _ = held_out
    text, figures = section(folder, None, tmp_path / "figures")
    assert [f.name for f in figures] == ["validation_fidelity.png"] and figures[0].is_file()
    assert "| alpha -> beta | 2 | 3 |" in text and "| every cross-workload direction | - | 6 |" in text
    assert "| alpha -> beta | alpha | all_resident | all | fitted |" in text
    assert "forced by the trace beta" in text


def test_the_rejudge_script_reproduces_validates_fidelity(held_out, tmp_path, monkeypatch, capsys):
    """benchmarks/rejudge_fidelity.py predicts the artifact's measured runs again with this tree's
    simulator: with the code that made the artifact, validate's own verdicts, direction by direction."""
    from moecache.env_info import REPO_ROOT
    from tests.benchmarks.script_module import run_script

    folder, result = held_out
    out = run_script(monkeypatch, capsys, REPO_ROOT / "benchmarks/rejudge_fidelity.py", [
        "--validation", str(folder / "validation.json"), "--profile", result["cost_profile"],
        "--traces", str(folder), "--out", str(tmp_path / "rejudge"),
    ])  # fmt: skip
    assert out["directions"] == result["fidelity"]["directions"]
    assert out["held_out"] == result["fidelity"]["held_out"] and out["held_out"]["predicted_runs"] == 6


def test_the_summary_names_the_agreement_baseline(held_out):
    """The stage's summary line per workload: each tolerance named as transformers' pair, the other
    implementation against the baseline (grouped_mm)."""
    from moecache.stages.validate import _summary

    _, result = held_out
    lines = [v for k, v in _summary(result).items() if " agreement (teacher-forced" in k]
    assert len(lines) == 2 and all("(eager vs grouped_mm: max " in v for v in lines), lines
