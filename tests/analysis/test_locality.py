"""Reuse distances and runs on a hand-built trace, each figure worked out by hand."""

from __future__ import annotations

import pytest

from moecache.analysis.locality import reuse_table, run_lengths, run_table
from tests.analysis.token_traces import from_requests as make_trace

# 2 layers, 4 experts, top-2; request a = tokens 0..2, request b = tokens 3..4.
#          layer 0   layer 1
# t0 (a)   {0,1}     {2,3}
# t1 (a)   {0,2}     {2,3}
# t2 (a)   {0,1}     {0,1}
# t3 (b)   {1,3}     {0,1}
# t4 (b)   {0,1}     {2,3}
TRACE = make_trace(
    [
        ("a", [[[0, 1], [2, 3]], [[2, 0], [3, 2]], [[1, 0], [0, 1]]]),
        ("b", [[[1, 3], [1, 0]], [[0, 1], [2, 3]]]),
    ],
    num_experts=4,
)


def test_reuse_distances_cold_and_cross_request():
    table, summary = reuse_table(TRACE)
    # uses of each key (token list) -> distances; * = previous use in the other request
    # L0 e0: t0 t1 t2 t4 -> cold, 1, 1, 2*      L0 e1: t0 t2 t3 t4 -> cold, 2, 1*, 1
    # L0 e2: t1 -> cold                         L0 e3: t3 -> cold
    # L1 e2: t0 t1 t4 -> cold, 1, 3*            L1 e3: t0 t1 t4 -> cold, 1, 3*
    # L1 e0: t2 t3 -> cold, 1*                  L1 e1: t2 t3 -> cold, 1*
    # distances: eight 1s, two 2s, two 3s (12 reuses); 8 cold of 20 selections; 6 cross-request reuses
    assert table.column_names == ["trace", "distance", "count"]
    assert table.to_pydict() == {"trace": ["t"] * 3, "distance": [1, 2, 3], "count": [8, 2, 2]}
    assert summary["reuse_median"] == 1.0  # 6th and 7th of the 12 sorted distances are both 1
    assert summary["reuse_share_1"] == pytest.approx(8 / 12)
    assert summary["reuse_share_le_8"] == 1.0
    assert summary["cold_selections"] == 8
    assert summary["cold_share"] == pytest.approx(8 / 20)
    assert summary["cross_request_share"] == pytest.approx(6 / 12)


def test_reuse_median_between_two_distances():
    # one layer, 3 experts, top-1, one request: t0..t6 select 0 1 0 0 2 1 0
    # e0 at t0 t2 t3 t6 -> distances 2, 1, 3; e1 at t1 t5 -> 4; e2 at t4 -> cold
    # distances (1, 2, 3, 4) -> median (2 + 3) / 2 = 2.5; share at distance 1 = 1/4
    tt = make_trace([("a", [[[e]] for e in (0, 1, 0, 0, 2, 1, 0)])], num_experts=3)
    table, summary = reuse_table(tt)
    assert table.to_pydict()["distance"] == [1, 2, 3, 4]
    assert summary["reuse_median"] == 2.5
    assert summary["reuse_share_1"] == 0.25
    assert summary["cold_selections"] == 3  # e0, e1, e2
    assert summary["cross_request_share"] == 0.0


def test_runs_end_at_request_boundaries():
    table, summary = run_table(TRACE)
    # L0 e0: t0-t2 | t4 -> 3, 1            L0 e1: t0 | t2 (end of a) | t3-t4 -> 1, 1, 2
    # L0 e2: 1   L0 e3: 1                  L1 e2: t0-t1 | t4 -> 2, 1     L1 e3: 2, 1
    # L1 e0: t2 (a) | t3 (b) -> 1, 1       L1 e1: 1, 1
    # 15 runs: one of 3, three of 2, eleven of 1; they cover the 20 selections
    assert table.to_pydict() == {"trace": ["t"] * 3, "run_length": [1, 2, 3], "count": [11, 3, 1]}
    assert run_lengths(TRACE).sum() == 20
    assert summary["run_mean"] == pytest.approx(20 / 15)
    assert summary["run_share_1"] == pytest.approx(11 / 15)


def test_one_token_has_no_reuse_and_one_run_per_selection():
    tt = make_trace([("a", [[[0, 1]]])], num_experts=2)
    table, summary = reuse_table(tt)
    assert table.num_rows == 0
    assert table.schema.field("distance").type == "int64"
    assert summary["reuse_median"] is None and summary["reuse_share_1"] is None
    assert summary["cold_selections"] == 2 and summary["cold_share"] == 1.0
    runs, run_summary = run_table(tt)
    assert runs.to_pydict() == {"trace": ["t"], "run_length": [1], "count": [2]}
    assert run_summary == {"run_mean": 1.0, "run_share_1": 1.0}
