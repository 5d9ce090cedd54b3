"""benchmarks/inspect_slot_moe.py: the decode down launches compiled for sm_90 on this machine (no GPU),
their machine code's shape: the "pairs" launch issues every load before its one reduction; a bad
--blocks is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inspect_slot_moe.py"


def test_each_variant_is_compiled_and_the_pairs_launch_loads_before_it_reduces(monkeypatch, capsys):
    result = run_script(monkeypatch, capsys, SCRIPT, ["--blocks", "8,128,8"])
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"two_stage", "pairs"}
    for r in rows.values():
        assert r["registers"] > 0 and r["loads"] > 0 and r["barriers"] > 0, r
    pairs = rows["pairs"]
    assert pairs["loads_before_first_barrier"] == pairs["loads"] and pairs["spills"] == 0
    # two_stage reduces each of its K experts on its own: more barriers than pairs' one reduction
    assert rows["two_stage"]["barriers"] > pairs["barriers"]


def test_bad_blocks_are_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, capsys, SCRIPT, ["--blocks", "8,128"])
    assert exc.value.code == 2 and "--blocks '8,128'" in capsys.readouterr().err
