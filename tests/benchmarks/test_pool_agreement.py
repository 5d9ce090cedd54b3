"""benchmarks/pool_agreement.py on agreement.parquet files written here in validate's columns: one file
judged as validate judges it, two workloads pooled (max, position-weighted mean, agreeing positions), and
inputs it must refuse in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.benchmarks.script_module import script_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pool_agreement.py"


def _row(workload, run, kind, capacity, positions, max_abs, mean_abs, top1, baseline="grouped_mm") -> dict:
    return {"workload": workload, "run": run, "kind": kind, "capacity": capacity, "baseline": baseline,
            "positions": positions, "max_abs_logit_error": max_abs, "mean_abs_logit_error": mean_abs,
            "top1_agreement": top1}  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# law: 100 positions; intent: 300. "selected 25%" misses top-1 on law (0.88 < 0.90) but, pooled, agrees at
# 88 + 282 = 370 of 400 against the tolerance's 90 + 270 = 360; "all_resident" misses max on intent.
LAW = [
    _row("law", "eager", "tolerance", None, 100, 0.25, 0.030, 0.90),
    _row("law", "all_resident", "moecache", "all", 100, 0.20, 0.020, 0.95),
    _row("law", "selected", "moecache", "25%", 100, 0.25, 0.028, 0.88),
]
INTENT = [
    _row("intent", "eager", "tolerance", None, 300, 0.20, 0.010, 0.90),
    _row("intent", "all_resident", "moecache", "all", 300, 0.26, 0.009, 0.91),
    _row("intent", "selected", "moecache", "25%", 300, 0.15, 0.009, 0.94),
]


def _run(capsys, files: list[Path]) -> tuple[int, str, str]:
    with script_module("pool_agreement", SCRIPT) as module:
        code = module.main([str(f) for f in files])
    out, err = capsys.readouterr()
    return code, out, err


def test_one_file_is_judged_as_validate_judges_it(tmp_path, capsys) -> None:
    code, out, _ = _run(capsys, [_write(tmp_path / "law.parquet", LAW)])
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["workloads"] == ["law"]
    verdicts = {(r["run"], r["capacity"]): r["within"] for r in result["runs"]}
    assert verdicts[("all_resident", "all")] == dict.fromkeys(verdicts[("all_resident", "all")], True)
    assert verdicts[("selected", "25%")] == {
        "max_abs_logit_error": True,
        "mean_abs_logit_error": True,
        "top1_agreement": False,
    }


def test_two_workloads_pool_their_positions(tmp_path, capsys) -> None:
    files = [_write(tmp_path / "law.parquet", LAW), _write(tmp_path / "intent.parquet", INTENT)]
    code, out, _ = _run(capsys, files)
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["workloads"] == ["intent", "law"]
    tol = result["tolerance"]
    assert tol["positions"] == 400 and tol["top1_equal"] == 360
    assert tol["max_abs_logit_error"] == 0.25 and tol["mean_abs_logit_error"] == pytest.approx(0.015)
    runs = {(r["run"], r["capacity"]): r for r in result["runs"]}
    selected = runs[("selected", "25%")]
    assert selected["top1_equal"] == 370 and selected["max_abs_logit_error"] == 0.25
    assert selected["mean_abs_logit_error"] == pytest.approx((100 * 0.028 + 300 * 0.009) / 400)
    assert selected["within_tolerance"] is True
    resident = runs[("all_resident", "all")]
    assert resident["within"]["max_abs_logit_error"] is False and resident["within_tolerance"] is False
    assert result["runs_within"] == 1 and result["runs_judged"] == 2


@pytest.mark.parametrize("case", ["missing_column", "workload_twice", "run_missing", "other_baseline"])
def test_inputs_that_cannot_be_pooled_are_refused_in_one_line(case, tmp_path, capsys) -> None:
    law = _write(tmp_path / "law.parquet", LAW)
    second = {
        "missing_column": [{k: v for k, v in r.items() if k != "positions"} for r in INTENT],
        "workload_twice": LAW,
        "run_missing": INTENT[:2],
        "other_baseline": [r | {"baseline": "eager"} for r in INTENT],
    }[case]
    other = _write(tmp_path / "other.parquet", second)
    code, out, err = _run(capsys, [law, other])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("pool_agreement: ")
    assert str(law if case == "run_missing" else other) in err  # the file the run is missing from
