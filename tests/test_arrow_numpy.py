"""moecache/arrow_numpy.py: buffer-level conversions equal pyarrow's own, and a cold simulate never imports pandas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from moecache.arrow_numpy import numpy_view, table_from_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "dtype", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint16(), pa.float32(), pa.float64()]
)
def test_numpy_view_equals_to_numpy(dtype):
    values = pa.array([3, 1, 4, 1, 5, 9, 2, 6], dtype)
    for array in (values, values.slice(2, 4), values.slice(8, 0)):
        got = numpy_view(array)
        want = array.to_numpy(zero_copy_only=False)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_numpy_view_chunked_and_list_offsets():
    chunked = pa.chunked_array(
        [pa.array([1, 2], pa.int16()), pa.array([], pa.int16()), pa.array([7], pa.int16())]
    )
    assert numpy_view(chunked).tolist() == [1, 2, 7]
    assert numpy_view(pa.chunked_array([], pa.int32())).tolist() == []
    lists = pa.array([[1, 2], [3], [], [4, 5, 6]], pa.list_(pa.int16())).slice(1, 3)
    assert numpy_view(lists.offsets).tolist() == lists.offsets.to_numpy().tolist() == [2, 3, 3, 6]


def test_numpy_view_falls_back_for_nulls_and_other_types():
    with_null = pa.array([1, None, 3], pa.int32())
    got = numpy_view(with_null)
    assert np.isnan(got[1]) and got[0] == 1 and got[2] == 3  # pyarrow's own conversion, as before
    assert numpy_view(pa.array([True, False])).tolist() == [True, False]


ROWS = [
    {"trace": "law", "capacity": 416, "hit_rate": 0.5, "flag": True, "note": None, "all_null": None},
    {"trace": "intent", "capacity": 8, "hit_rate": 1, "flag": False, "note": "x\u00e9", "all_null": None},
    {"capacity": -(2**40), "hit_rate": None, "flag": None, "note": "", "extra": 2.5},
]


def test_table_from_rows_equals_from_pylist():
    got, want = table_from_rows(ROWS), pa.Table.from_pylist(ROWS)
    assert got.schema.equals(want.schema) and got.equals(want)
    assert table_from_rows([]).equals(pa.Table.from_pylist([]))


@pytest.mark.parametrize(
    "rows",
    [
        [{"a": [1, 2]}, {"a": [3]}],  # lists
        [{"a": 1}, {"a": "x"}],  # mixed types
        [{"a": np.int32(3)}],  # NumPy scalars
        [{"a": True}, {"a": 2}],  # bool and int
        [{"a": 2**64}],  # beyond int64
    ],
)
def test_table_from_rows_falls_back(rows):
    try:
        want = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        with pytest.raises(type(exc)):
            table_from_rows(rows)
        return
    assert table_from_rows(rows).equals(want)


def test_cold_simulate_does_not_import_pandas(tmp_path):
    """The simulate stage end to end in a fresh process: pyarrow's pandas probe never runs (0.12-0.18 s
    of a cold start), and the second run takes its config from the compose cache."""
    import pyarrow.parquet as pq

    from tests.conftest import trace_table

    table, _ = trace_table(
        [(0, 0, layer, [[0, 1], [2, 3]]) for layer in range(2)]
        + [(0, 1, layer, [[1, 4]]) for layer in range(2)],
        2,
        8,
    )
    pq.write_table(table, tmp_path / "t.parquet")
    script = (
        "import sys\n"
        "from moecache.cli import main\n"
        f"sys.argv = ['moecache', 'simulate', 'traces=[{tmp_path / 't.parquet'}]', 'policy=lru', 'capacity=4', 'force=true']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('PANDAS', 'pandas' in sys.modules, 'HYDRA', 'hydra' in sys.modules)\n"
    )
    env = {
        **os.environ,
        "MOECACHE_OUTPUT_ROOT": str(tmp_path / "out"),
        "MOECACHE_COMPOSE_CACHE": str(tmp_path / "cc"),
    }
    outs = [
        subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert "PANDAS False HYDRA True" in outs[0]  # composed by Hydra, then cached
    assert "PANDAS False HYDRA False" in outs[1]  # from the cache: Hydra not even imported
