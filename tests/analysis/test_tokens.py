"""The token-level reader of `moecache analyze` on valid traces whose tokens are not all complete (a
token lacking some layers, a row with fewer than top_k experts): those tokens are left out and
counted, and statistics over neighbouring tokens do not pair the tokens on either side of one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moecache.analysis import locality, router_weight, transitions
from moecache.analysis.tokens import TokenTrace, from_table, load_token_trace
from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.stages import analyze, import_trace, simulate, sweep
from tests.conftest import trace_table

L, E, K = 2, 4, 2
LENGTHS = {"q0": 5, "q1": 4}


def decode_steps(lengths=LENGTHS):
    """Decode steps, one token each; token t of request q selects two experts that vary with t."""
    return [
        (q, t, layer, [[(t + layer) % E, (t + layer + 1 + n) % E]])
        for n, (q, length) in enumerate(lengths.items())
        for t in range(length)
        for layer in range(L)
    ]


def table_without(drop: set[tuple[str, int, int]]) -> tuple[pa.Table, object]:
    """The decode trace less the rows (request, token, layer) in `drop`."""
    table, meta = trace_table(decode_steps(), L, E, top_k=K)
    return table.filter(pa.array([k not in drop for k in row_keys(table)])), meta


def row_keys(table: pa.Table) -> list[tuple]:
    """(request_id, token_index, layer_id) of every row."""
    return list(zip(*(table[c].to_pylist() for c in ("request_id", "token_index", "layer_id")), strict=True))


def test_complete_trace_keeps_every_token():
    table, meta = table_without(set())
    tt = from_table(table, meta)
    assert tt.num_tokens == 9 and tt.tokens_left_out == 0 and tt.requests_left_out == 0
    assert np.array_equal(tt.segment_T, tt.request_T)


def test_a_token_lacking_a_layer_is_left_out_and_splits_its_request():
    table, meta = table_without({("q0", 2, 1)})
    tt = from_table(table, meta)
    assert tt.num_tokens == 8 and tt.tokens_left_out == 1 and tt.request_ids == ("q0", "q1")
    assert tt.position_T.tolist() == [0, 1, 3, 4, 0, 1, 2, 3]
    assert tt.request_T.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert tt.segment_T.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    full = from_table(*table_without(set()))
    assert np.array_equal(tt.expert_TLK, np.delete(full.expert_TLK, 2, axis=0))


def split_at_gaps(tt: TokenTrace) -> TokenTrace:
    """The same tokens with every run of neighbours made a request of its own."""
    return dataclasses.replace(
        tt,
        request_ids=tuple(f"s{g}" for g in range(int(tt.segment_T.max()) + 1)),
        request_T=tt.segment_T.copy(),
        tokens_left_out=0,
    )


def test_neighbour_statistics_do_not_pair_across_a_left_out_token():
    """Every statistic over t and t + lag equals the one on the trace split at the gap: tokens 1 and
    3 of q0 are not neighbours once token 2 is left out."""
    tt = from_table(*table_without({("q0", 2, 1)}))
    split = split_at_gaps(tt)
    for lag in (1, 2):
        assert np.array_equal(
            transitions.token_transitions(tt, lag), transitions.token_transitions(split, lag)
        )
    assert transitions.token_transitions(tt, 1).sum() == (8 - 3) * L * K * K  # 5 neighbour pairs
    assert np.array_equal(locality.run_lengths(tt), locality.run_lengths(split))
    assert transitions.predictor_table(tt)[0].equals(transitions.predictor_table(split)[0])
    assert transitions.recurrence_table(tt).equals(transitions.recurrence_table(split))
    for a, b in zip(router_weight.reuse_flags(tt), router_weight.reuse_flags(split), strict=True):
        assert np.array_equal(a, b)
    # the reuse distances count analysed tokens; across-request shares still use the real requests
    assert (
        locality.reuse_table(tt)[1]["cross_request_share"]
        == locality.reuse_table(dataclasses.replace(tt, segment_T=None))[1]["cross_request_share"]
    )


def test_short_rows_repeated_layers_and_empty_requests_are_left_out():
    table, meta = table_without({("q1", t, 0) for t in range(4)})  # q1 has no complete token
    values = table["expert_ids"].to_pylist()
    values[0] = values[0][:1]  # q0 token 0, layer 0: one expert of top-2
    table = table.set_column(
        table.schema.get_field_index("expert_ids"), "expert_ids", pa.array(values, pa.list_(pa.int16()))
    )
    tt = from_table(table, meta)
    assert tt.tokens_left_out == 5 and tt.requests_left_out == 1 and tt.request_ids == ("q0",)
    assert tt.position_T.tolist() == [1, 2, 3, 4]
    # a token routed twice at layer 0 (in two steps) and never at layer 1: L rows, not L layers
    twice, meta = trace_table([("q", 0, 0, [[0, 1]]), ("q", 1, 0, [[2, 3]])], L, E, K)
    column = pa.array([0, 0], pa.int32())
    twice = twice.set_column(twice.schema.get_field_index("token_index"), "token_index", column)
    with pytest.raises(MoecacheError, match="no complete token"):
        from_table(twice, meta)


def test_load_token_trace_reads_a_file_with_holes(tmp_path):
    table, meta = table_without({("q0", 2, 1), ("q1", 0, 0), ("q1", 3, 1)})
    pq.write_table(table, tmp_path / "holes.parquet")
    tt = load_token_trace(tmp_path / "holes.parquet")
    assert tt.num_tokens == 6 and tt.tokens_left_out == 3


LAYERS, EXPERTS, TOP_K = 3, 8, 2
SMALL = [
    "sweep.policies={lfu:[{reset_per_request:false}],lru:[{}]}",
    "sweep.sensitivity.policies=[]",
    "analyze.history.candidates={lfu:[{reset_per_request:false}],lfu_window:[{window_tokens:16}]}",
    "analyze.window_tokens=8",
]


def test_every_stage_accepts_a_trace_lacking_layers_of_three_tokens(tmp_path, make_esft_npz):
    """An 8-expert top-2 export that lacks a few layers of three tokens: read_trace accepts it, so
    simulate, sweep and analyze do, and analyze reports the 3 tokens it left out."""
    npz = make_esft_npz(tmp_path / "m.npz", LAYERS, EXPERTS, TOP_K, [30, 20, 25], 0, random_weights=True)
    imported = import_trace.run(
        compose(
            [
                f"output_root={tmp_path / 'out'}", f"trace_import.path={npz}", "trace_import.name=m",
                f"trace_import.num_layers={LAYERS}", f"trace_import.num_experts={EXPERTS}",
                f"trace_import.top_k={TOP_K}", "trace_import.expert_bytes=6291456", "trace_import.licence_file=null",
            ]
        )
    )  # fmt: skip
    table = pq.read_table(imported.artifact / "trace.parquet")
    keys = row_keys(table)
    requests = sorted(set(table["request_id"].to_pylist()))
    drop = {(requests[0], 4, 1), (requests[1], 0, 0), (requests[1], 7, 2)}  # 3 tokens, one layer each
    holes = tmp_path / "holes.parquet"
    pq.write_table(table.filter(pa.array([k not in drop for k in keys])), holes)
    base = [f"output_root={tmp_path / 'out'}", f"traces=[{holes}]", *SMALL]
    assert simulate.run(compose([*base, "capacity=4"])).artifact.is_dir()
    assert sweep.run(compose(base)).artifact.is_dir()
    result = analyze.run(compose(base))
    figures = json.loads((result.artifact / "summary.json").read_text())["holes"]
    assert (
        figures["tokens_left_out"] == 3 and figures["tokens"] == 75 - 3 and figures["requests_left_out"] == 0
    )
    assert "incomplete tokens left out: 3" in result.summary["holes"]
