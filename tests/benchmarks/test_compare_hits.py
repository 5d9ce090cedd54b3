"""benchmarks/compare_hits.py on a trace-forced fast-loop validate of the CPU stand-in (the artifact of
tests/validation/test_validate_forced.py): the stand-in lands every copy before the next visit, as the
instant replay does, so its runs' hits agree with the replay access by access; a trace without the cache
columns is refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.benchmarks.script_module import run_script, script_module
from tests.conftest import build_trace
from tests.validation.test_validate_forced import ESFT, fast_run, trace_root  # noqa: F401  (fixtures)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_hits.py"
pytestmark = pytest.mark.skipif(not ESFT.is_file(), reason="needs ../shared (the ESFT traces)")


def test_the_stand_ins_hits_are_the_instant_replays(fast_run, monkeypatch, capsys):  # noqa: F811
    folder, runs, _ = fast_run
    args = ["--validation", str(folder / "validation.json"), "--traces", str(folder), "--strategies",
            "selected,lru_sync"]  # fmt: skip
    result = run_script(monkeypatch, capsys, SCRIPT, args)
    assert result["timed"] is False
    assert {(r["strategy"], r["capacity"]) for r in result["runs"]} == {
        ("selected", "25%"),
        ("lru_sync", "25%"),
    }
    for got in result["runs"]:
        run = runs[(got["strategy"], got["capacity"])]
        assert got["accesses"] == run["accesses"] and got["runtime_hits"] == run["hits"] > 0
        assert got["replay_hits"] == got["runtime_hits"]
        assert "runtime_only" not in got and "replay_only" not in got and got["top_layers"] == []


def test_a_trace_without_cache_columns_is_refused(fast_run, tmp_path, monkeypatch, capsys):  # noqa: F811
    folder, runs, _ = fast_run
    run = runs[("selected", "25%")]
    table = pq.read_table(folder / run["trace"])
    field = table.schema.field("cache_hit")
    blank = table.set_column(
        table.schema.get_field_index("cache_hit"), field, pa.nulls(table.num_rows, field.type)
    )
    out = tmp_path / run["trace"]
    out.parent.mkdir(parents=True)
    pq.write_table(blank, out)
    args = [
        "--validation",
        str(folder / "validation.json"),
        "--traces",
        str(tmp_path),
        "--strategies",
        "selected",
    ]
    with pytest.raises(SystemExit, match="no cache columns"):
        run_script(monkeypatch, capsys, SCRIPT, args)


def test_each_disagreement_is_counted_by_kind_prefetch_phase_and_layer():
    """Two layers x 4 experts, two decode tokens. The runtime's visit of layer 0 at token 0 admitted
    layer 1's expert 2 (key 6): the runtime hits it at layer 1 where the replay does not (counted as
    admitted at the previous layer); layer 1's expert 3 at token 1 likewise, with no such admission;
    layer 0's expert 1 at token 1 the replay hits and the runtime does not."""
    steps = [(0, 0, 0, [[0, 1]]), (0, 0, 1, [[2, 3]]), (0, 1, 0, [[0, 1]]), (0, 1, 1, [[2, 3]])]
    trace = build_trace(steps, 2, 4)
    rid = trace.request_ids[0]
    visits = {
        (rid, 0, 0): ({0}, {6}),
        (rid, 0, 1): ({2}, set()),
        (rid, 1, 0): ({0}, set()),
        (rid, 1, 1): ({2, 3}, set()),
    }
    hit_A = np.array([True, False, False, False, True, True, True, False])  # keys 0 1 6 7 0 1 6 7
    with script_module("compare_hits_unit", SCRIPT) as module:
        got = module.compare(trace, hit_A, visits)
    assert (got["accesses"], got["runtime_hits"], got["replay_hits"]) == (8, 5, 4)
    assert (got["runtime_only"], got["runtime_only_admitted_at_previous_layer"], got["replay_only"]) == (
        2,
        1,
        1,
    )
    assert (got["runtime_only_decode"], got["replay_only_decode"]) == (2, 1)
    assert got["replay_only_admitted_at_previous_layer"] == 0
    assert got["top_layers"] == [
        {"kind": "runtime_only", "layer": 1, "accesses": 2},
        {"kind": "replay_only", "layer": 0, "accesses": 1},
    ]
