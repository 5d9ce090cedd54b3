"""Loading traces into TraceArrays (trace_arrays.py) and the per-group sums of a replay (aggregate.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moecache.errors import MoecacheError
from moecache.sim.aggregate import group_sums
from moecache.sim.replay import ReplayResult
from moecache.sim.trace_arrays import from_table, load_trace
from moecache.trace.schema import read_trace, validate_table

# (request, step, layer, [[experts of token 0], ...]): a prefill step of 3 tokens that share
# experts, then decode steps; request "b" comes before "a" (request order = first appearance).
STEPS = [
    ("b", 0, 0, [[1, 2], [2, 3], [1, 2]]),
    ("b", 0, 1, [[0, 1], [1, 0], [3, 1]]),
    ("b", 1, 0, [[3, 0]]),
    ("b", 1, 1, [[2, 1]]),
    ("a", 0, 0, [[0, 1], [2, 0]]),
    ("a", 0, 1, [[1, 2], [1, 3]]),
    ("a", 1, 0, [[1, 2]]),
    ("a", 1, 1, [[0, 3]]),
    ("c", 0, 0, [[2, 3]]),
    ("c", 0, 1, [[3, 2]]),
]


@pytest.fixture
def table_of(make_trace_file, tmp_path):
    """table_of(steps, num_layers, num_experts): the canonical table (plain strings) and its meta."""

    def build(steps, num_layers, num_experts):
        path = make_trace_file(tmp_path / f"steps{len(steps)}.parquet", steps, num_layers, num_experts)
        return read_trace(path)

    return build


def _fields(trace) -> dict:
    return {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}


def _assert_same(a, b):
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        if isinstance(fa[name], np.ndarray):
            assert fa[name].dtype == fb[name].dtype and np.array_equal(fa[name], fb[name]), name
        else:
            assert fa[name] == fb[name], name


def test_from_table_flattens_steps_and_dedups_experts(table_of):
    table, meta = table_of(STEPS, 2, 4)
    t = from_table(table, meta)
    assert t.request_ids == ("b", "a", "c")
    assert t.request_V.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert t.tokens_V.tolist() == [3, 3, 1, 1, 2, 2, 1, 1, 1, 1]
    assert t.phase_V.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    assert t.clock_V.tolist() == [0, 0, 3, 3, 4, 4, 6, 6, 7, 7]
    # first step: experts 1, 2, 3 in order of first selection, used by 2, 3 and 1 tokens
    assert t.key_A[: t.start_V[1]].tolist() == [1, 2, 3]
    assert t.uses_A[: t.start_V[1]].tolist() == [2, 3, 1]
    # second step (layer 1: keys 4 + expert): experts 0, 1, 3
    assert t.key_A[t.start_V[1] : t.start_V[2]].tolist() == [4, 5, 7]
    assert t.uses_A[t.start_V[1] : t.start_V[2]].tolist() == [2, 3, 1]
    assert t.num_accesses == int(t.start_V[-1]) and t.num_tokens == 8


def test_dictionary_columns_and_row_groups_give_the_same_arrays(table_of, tmp_path):
    table, meta = table_of(STEPS, 2, 4)
    plain = from_table(table, meta, name="t")
    # read back from a file of many row groups (one dictionary per row group)
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    assert pq.ParquetFile(tmp_path / "t.parquet").metadata.num_row_groups > 1
    loaded, _ = read_trace(tmp_path / "t.parquet", dictionary_strings=True)
    assert pa.types.is_dictionary(loaded.schema.field("request_id").type)
    _assert_same(plain, from_table(loaded, meta, name="t"))
    _assert_same(plain, load_trace(tmp_path / "t.parquet", name="t"))
    # a dictionary whose order is not the order of first appearance
    ids = table["request_id"].to_pylist()
    values = sorted(set(ids), reverse=True)
    request_id = pa.DictionaryArray.from_arrays(pa.array([values.index(i) for i in ids], pa.int32()), values)
    shuffled = table.set_column(table.schema.get_field_index("request_id"), "request_id", request_id)
    _assert_same(plain, from_table(shuffled, meta, name="t"))


def test_rows_of_a_request_must_be_contiguous(make_trace_file, tmp_path):
    """from_table refuses such rows itself (read_trace refuses them first; its order check is skipped
    here to reach from_table, which also flattens tables that did not come from read_trace)."""
    steps = [("a", 0, 0, [[0]]), ("b", 0, 0, [[1]]), ("a", 1, 0, [[0]])]
    table, meta = read_trace(make_trace_file(tmp_path / "split.parquet", steps, 1, 2), require_order=False)
    with pytest.raises(MoecacheError, match="not contiguous"):
        from_table(table, meta)


def test_read_trace_checks_phase_values_of_dictionary_columns(table_of, tmp_path):
    table, meta = table_of(STEPS, 2, 4)
    phase = ["decode"] * (table.num_rows - 1) + ["warmup"]
    bad = table.set_column(table.schema.get_field_index("phase"), "phase", pa.array(phase))
    pq.write_table(bad, tmp_path / "bad.parquet")
    for dictionary in (False, True):
        with pytest.raises(MoecacheError, match="phase"):
            read_trace(tmp_path / "bad.parquet", dictionary_strings=dictionary)
    # a dictionary entry that no row uses is not a value of the column
    values = ["prefill", "decode", "warmup"]
    codes = pa.array([values.index(p) for p in table["phase"].to_pylist()], pa.int32())
    unused = table.set_column(
        table.schema.get_field_index("phase"), "phase", pa.DictionaryArray.from_arrays(codes, values)
    )
    validate_table(unused, meta, "unused")


def test_subset_requests_recomputes_request_numbers_and_clock(make_trace):
    sub = make_trace(STEPS, 2, 4).subset_requests(np.array([0, 2]))
    _assert_same(make_trace([s for s in STEPS if s[0] != "a"], 2, 4), sub)


@pytest.mark.parametrize("timed", [False, True])
def test_group_sums_equal_bincounts(make_trace, timed):
    rng = np.random.default_rng(0)
    steps = []
    for r in range(4):
        for step, n in enumerate([5, 1, 1, 3, 1]):
            for layer in range(3):
                steps += [(r, step, layer, [list(rng.choice(6, 2, replace=False)) for _ in range(n)])]
    trace = make_trace(steps, 3, 6)
    s, a = trace.num_steps, trace.num_accesses
    result = ReplayResult(
        "x", 1, rng.random(a) < 0.4, rng.integers(0, 3, s, np.int32), rng.integers(0, 3, s, np.int32)
    )
    step_us_V = rng.random(s) * 100 if timed else None
    if timed:
        result.slot_A = result.hit_A | (rng.random(a) < 0.3)
    step_A = np.repeat(np.arange(s), np.diff(trace.start_V))
    for group_V, n in ((trace.layer_V, trace.num_layers), (trace.request_V, len(trace.request_ids))):
        got = group_sums(trace, result, group_V, n, step_us_V)
        group_A = group_V[step_A]
        uses = trace.uses_A.astype(np.int64)
        slot_A = result.slot_A if timed else result.hit_A
        want = {
            "accesses": np.bincount(group_A, minlength=n),
            "hits": np.bincount(group_A, result.hit_A, minlength=n),
            "selections": np.bincount(group_A, uses, minlength=n),
            "hit_selections": np.bincount(group_A, uses * result.hit_A, minlength=n),
            "slots": np.bincount(group_A, slot_A, minlength=n),
            "admissions": np.bincount(group_V, result.admits_V, minlength=n),
            "evictions": np.bincount(group_V, result.evicts_V, minlength=n),
        }
        for name, values in want.items():
            assert getattr(got, name).dtype == np.int64
            assert np.array_equal(getattr(got, name), values), name
        # step times are summed in step order: exactly np.bincount's float sums
        us = np.bincount(group_V, step_us_V, minlength=n) if timed else np.zeros(n)
        assert np.array_equal(got.step_us, us)


def test_a_token_missing_at_some_layers_counts_once(table_of):
    """An exported trace that lacks layer 0 of one prefill token: the forward step still has 3 tokens,
    so the clock of the next step, the trace's tokens and the per-request tokens count it."""
    from moecache.sim.metrics import per_request, summarize
    from moecache.sim.policy import make_policy
    from moecache.sim.replay import replay_instant

    table, meta = table_of(STEPS, 2, 4)
    first = pa.array([r == "b" and s == 0 and layer == 0 and t == 2 for r, s, layer, t in zip(
        table["request_id"].to_pylist(), table["step_index"].to_pylist(),
        table["layer_id"].to_pylist(), table["token_index"].to_pylist(), strict=True)])  # fmt: skip
    missing = table.filter(pa.compute.invert(first))
    validate_table(missing, meta, "missing.parquet")  # a valid trace
    full, part = from_table(table, meta), from_table(missing, meta)
    assert part.num_tokens == full.num_tokens == 3 + 1 + 2 + 1 + 1
    assert np.array_equal(part.clock_V, full.clock_V)
    result = replay_instant(part, make_policy("lru"), 2)
    assert summarize(part, result)["tokens"] == full.num_tokens
    assert [r["tokens"] for r in per_request(part, result)] == [4, 3, 1]
