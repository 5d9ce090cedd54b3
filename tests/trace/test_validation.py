"""The validity rules of a trace (docs/trace-format.md, "Validity"): each broken rule is one line naming
the file, the column, the row and the value, from `read_trace` (whole table, or the simulator's column
subset with dictionary strings) and from the CLI (exit 2, no artifact)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.cli import app
from moecache.errors import MoecacheError
from moecache.sim.trace_arrays import load_trace
from moecache.trace.schema import read_trace
from moecache.trace.validity import canonical_order, check_row_order
from tests.conftest import ESFT_LAW, trace_table

LAYERS, EXPERTS = 2, 8
SIM_COLUMNS = ["request_id", "step_index", "token_index", "layer_id", "phase", "expert_ids"]
# two requests: a prefill step of 2 tokens, then 2 decode steps; 2 layers, top-2
STEPS = [
    (f"q{q}", s, layer, [[(q + s + t) % 4, 4 + (layer + t) % 4] for t in range(2 if s == 0 else 1)])
    for q in range(2)
    for s in range(3)
    for layer in range(LAYERS)
]


def good_table() -> pa.Table:
    table, _ = trace_table(STEPS, LAYERS, EXPERTS, top_k=2)
    return table


def with_column(table: pa.Table, name: str, values: list) -> pa.Table:
    """`table` with column `name` replaced by `values` (nullable, so that nulls can be written)."""
    field = table.schema.field(name).with_nullable(True)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))


def with_value(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table[name].to_pylist()
    values[row] = value
    return with_column(table, name, values)


def rows(table: pa.Table, order) -> pa.Table:
    return table.take(pa.array(np.asarray(order, np.int64)))


N = good_table().num_rows  # 2 requests x (2 + 1 + 1 tokens) x 2 layers = 16
# (case, table, what the one-line error must contain)
BAD = [
    *[
        (f"null {name}", with_value(good_table(), name, 5, None), [f"column '{name}' is null at row 5"])
        for name in ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids")
    ],
    ("null expert", with_value(good_table(), "expert_ids", 3, [1, None]), ["null expert at row 3", "[1, None]"]),
    ("repeated expert", with_value(good_table(), "expert_ids", 6, [5, 5]), ["repeats an expert at row 6", "[5, 5]"]),
    ("duplicate row", rows(good_table(), [0, 1, 2, 3, 3, *range(4, N)]), ["row 4 duplicates row 3", "'q0'"]),
    ("every row twice", rows(good_table(), np.repeat(np.arange(N), 2)), ["row 1 duplicates row 0"]),
    ("swapped layers", rows(good_table(), [2, 3, 0, 1, *range(4, N)]), ["row 2 is out of canonical order", "'q0'"]),
    ("reversed", rows(good_table(), np.arange(N)[::-1]), ["row 1 is out of canonical order", "'q1'"]),
    ("request split", rows(good_table(), [*range(4), *range(8, N), *range(4, 8)]), ["'q0' are not contiguous", "row 12"]),
    ("negative token", with_value(good_table(), "token_index", 7, -1), ["column 'token_index' is -1 at row 7"]),
    ("layer out of range", with_value(good_table(), "layer_id", 9, 2), ["column 'layer_id' is 2 at row 9"]),
    ("expert out of range", with_value(good_table(), "expert_ids", 4, [1, 8]), ["[1, 8] at row 4", "num_experts"]),
    ("empty list", with_value(good_table(), "expert_ids", 4, []), ["[] at row 4", "expected 1..2"]),
    ("short weights", with_value(good_table(), "router_weights", 8, [1.0]), ["'router_weights' holds [1.0] at row 8"]),
    ("null weights", with_value(good_table(), "router_weights", 8, None), ["'router_weights' is null at row 8"]),
]  # fmt: skip


def write(table: pa.Table, path) -> str:
    pq.write_table(table.replace_schema_metadata(good_table().schema.metadata), path)
    return str(path)


@pytest.mark.parametrize("case,table,needles", BAD, ids=[c for c, *_ in BAD])
def test_read_trace_refuses(tmp_path, case, table, needles):
    path = write(table, tmp_path / "bad.parquet")
    subset = {"columns": SIM_COLUMNS, "dictionary_strings": True, "use_threads": False}
    for kwargs in ({}, subset) if "weights" not in case else ({},):  # the simulator reads no weights
        with pytest.raises(MoecacheError) as err:
            read_trace(path, **kwargs)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{path}: ")
        for needle in needles:
            assert needle in message, message
    if "weights" not in case:
        with pytest.raises(MoecacheError):  # the simulator's reader goes through the same checks
            load_trace(path)


# the crashes and wrong answers of the issue: a segfault (null layer_id), numba tracebacks (null
# request_id, phase), silent passes (null token_index, null expert, duplicates, disorder)
CLI_NAMES = ("null layer_id", "null request_id", "null phase", "null token_index", "null expert")
CLI_NAMES += ("duplicate row", "every row twice", "reversed", "request split", "repeated expert")
CLI_CASES = [c for c in BAD if c[0] in CLI_NAMES]


@pytest.mark.parametrize("case,table,needles", CLI_CASES, ids=[c for c, *_ in CLI_CASES])
def test_cli_refuses_with_one_line_and_no_artifact(tmp_path, case, table, needles):
    path = write(table, tmp_path / "bad.parquet")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", f"output_root={out}", f"traces=[{path}]", "capacity=2"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and all(n in lines[0] for n in needles), lines
    assert not (out / "simulate").exists() or not any((out / "simulate").iterdir())


def test_a_token_lacking_layers_is_valid(tmp_path):
    table = good_table()
    keep = np.ones(table.num_rows, bool)
    keep[[1, 9]] = False  # q0 token 1 at layer 0, q1's first decode token at layer 0
    path = write(table.filter(pa.array(keep)), tmp_path / "holes.parquet")
    got, _ = read_trace(path)
    assert got.num_rows == table.num_rows - 2
    assert load_trace(path).num_accesses > 0


def test_rows_with_fewer_experts_are_valid_and_still_checked_for_repeats(tmp_path):
    short = with_value(good_table(), "expert_ids", 4, [3])  # ragged lists: the padded comparison
    short = with_value(short, "router_weights", 4, [1.0])
    read_trace(write(short, tmp_path / "short.parquet"))
    with pytest.raises(MoecacheError, match=r"repeats an expert at row 6 \(\[1, 1\]"):
        read_trace(write(with_value(short, "expert_ids", 6, [1, 1]), tmp_path / "repeat.parquet"))


def test_dictionary_strings_over_chunks_are_checked(tmp_path):
    """Row groups become chunks with their own dictionaries: codes are unified before comparing."""
    path = tmp_path / "chunks.parquet"
    pq.write_table(good_table(), path, row_group_size=3)
    read_trace(path, columns=SIM_COLUMNS, dictionary_strings=True)
    split = rows(good_table(), [*range(4), *range(8, N), *range(4, 8)])
    pq.write_table(split, path, row_group_size=3)
    with pytest.raises(MoecacheError, match="'q0' are not contiguous"):
        read_trace(path, columns=SIM_COLUMNS, dictionary_strings=True)


def test_canonical_order_restores_a_shuffle_and_names_duplicates_by_file_row():
    table = good_table()
    shuffled = rows(table, np.random.default_rng(0).permutation(table.num_rows))
    first = shuffled["request_id"][0].as_py()  # requests keep the order of their first row
    by_request = sorted(("q0", "q1"), key=lambda q: q != first)
    expected = pa.concat_tables([table.filter(pc.equal(table["request_id"], q)) for q in by_request])
    assert rows(shuffled, canonical_order(shuffled)).equals(expected)
    doubled = rows(shuffled, [*range(table.num_rows), 0])
    order = canonical_order(doubled)
    with pytest.raises(MoecacheError, match=f"row {table.num_rows} duplicates row 0"):
        check_row_order(rows(doubled, order), "t", row_N=order)


def test_checks_cost_little_on_the_real_law_trace(tmp_path):
    """Not a benchmark: only that the row checks stay vectorised (a Python loop over the law trace's
    216,502 rows would take far longer than the bound)."""
    import time

    if not ESFT_LAW.is_file():
        pytest.skip("../shared/data is not present")
    from moecache.trace import validity
    from moecache.trace.esft_import import esft_to_table, load_esft_npz
    from moecache.trace.schema import TraceMeta

    meta = TraceMeta(num_layers=26, num_experts=64, top_k=6, expert_bytes=1)
    table = esft_to_table(
        load_esft_npz(ESFT_LAW, num_layers=26, num_experts=64, top_k=6),
        name="law", run_id="law", tokens_per_step=1, meta=meta,
    )  # fmt: skip
    start = time.perf_counter()
    validity.check_distinct_experts(table, "law")
    validity.check_row_order(table, "law")
    assert time.perf_counter() - start < 0.5
