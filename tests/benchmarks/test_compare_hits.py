"""benchmarks/compare_hits.py on a trace-forced fast-loop validate of the CPU stand-in (the artifact of
tests/validation/test_validate_forced.py): the stand-in lands every copy before the next visit, as the
instant replay does, so its runs' hits agree with the replay access by access; a trace without the cache
columns is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.benchmarks.script_module import run_script
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
