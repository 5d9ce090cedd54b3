"""benchmarks/bench_cpu_experts.py: one row per (mode, gap) with the gap it ran with; a negative gap is
refused; each --pages kind a pool of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ARGS = ["--backends", "torch", "--dtypes", "float32", "--shapes", "qwen3.6", "--threads", "1",
        "--tokens", "1", "--experts", "2", "--repeats", "2", "--warmup", "1", "--max-pool-mib", "64"]  # fmt: skip


def run(monkeypatch, capsys, *extra: str):
    return run_script(monkeypatch, capsys, BENCH / "bench_cpu_experts.py", [*ARGS, *extra])


def test_each_gap_is_a_row(monkeypatch, capsys):
    result = run(monkeypatch, capsys, "--modes", "cold", "--gap-us", "0,200")
    rows = [(r["mode"], r["gap_us"]) for r in result["rows"]]
    assert rows == [("cold", 0), ("cold", 200)]
    assert all(r["call_median_us"] > 0 for r in result["rows"])


def test_the_gap_precedes_each_call_untimed(monkeypatch, capsys):
    # a 20 ms gap before each call: the calls themselves (a few ms) do not include it
    result = run(monkeypatch, capsys, "--modes", "warm", "--gap-us", "20000")
    assert result["rows"][0]["call_median_us"] < 20000


def test_a_negative_gap_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, "--gap-us", "0,-5")
    assert exc.value.code == 2
    assert "--gap-us" in capsys.readouterr().err


def test_each_page_kind_is_a_pool_of_its_own(monkeypatch, capsys):
    result = run(monkeypatch, capsys, "--modes", "cold", "--pages", "base,huge")
    assert [r["pages"] for r in result["rows"]] == ["base", "huge"]
    assert all(r["call_median_us"] > 0 for r in result["rows"])


def test_a_bad_page_kind_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, "--pages", "huge,tiny")
    assert exc.value.code == 2
    assert "--pages: 'tiny'" in capsys.readouterr().err
