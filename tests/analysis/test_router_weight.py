"""Reuse rates by router weight on hand-built traces, each figure worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.analysis.router_weight import average_ranks, router_weight_table
from moecache.errors import MoecacheError
from tests.analysis.token_traces import from_requests as make_trace

# 1 layer, 4 experts, top-2; request a = t0..t3, request b = t4..t6. (expert: weight), router order:
# t0 (0: .95, 1: .05)  t1 (0: .85, 2: .15)  t2 (1: .75, 3: .25)  t3 (1: .6, 0: .4)
# t4 (2: .65, 3: .35)  t5 (2: .55, 0: .45)  t6 (3: .6, 1: .4)
# Selections with a successor: t0 t1 t2 (a), t4 t5 (b) -> 10. Reused by the next token:
# t0 e0 (t1 has 0) yes, e1 no | t1 e0 no (t2 = {1,3}), e2 no | t2 e1 (t3 has 1) yes, e3 no
# t4 e2 (t5 has 2) yes, e3 no | t5 e2 no (t6 = {3,1}), e0 no
# -> by weight .05 .15 .25 .35 .45 .55 .65 .75 .85 .95 : N N N N N N Y Y N Y
TRACE = make_trace(
    [
        ("a", [[[0, 1]], [[0, 2]], [[1, 3]], [[1, 0]]]),
        ("b", [[[2, 3]], [[2, 0]], [[3, 1]]]),
    ],
    num_experts=4,
    weights=[
        [[0.95, 0.05]],
        [[0.85, 0.15]],
        [[0.75, 0.25]],
        [[0.6, 0.4]],
        [[0.65, 0.35]],
        [[0.55, 0.45]],
        [[0.6, 0.4]],
    ],
)


def test_deciles_ranks_and_correlations():
    table, summary = router_weight_table(TRACE)
    assert table.column_names == [
        "trace",
        "by",
        "bin",
        "weight_lo",
        "weight_hi",
        "selections",
        "reuse_next_rate",
        "reuse_within_8_rate",
    ]
    rows = table.to_pylist()
    deciles = [r for r in rows if r["by"] == "decile"]
    # weights v_i = .05 + .1 i (i = 0..9); quantile q = j/10 sits at position 0.9 j -> edge_j = .05 + .09 j,
    # so v_i >= edge_j iff i >= 0.9 j: v_i lands in bin i, one selection per bin
    assert [r["bin"] for r in deciles] == list(range(10))
    assert [r["selections"] for r in deciles] == [1] * 10
    assert [r["weight_lo"] for r in deciles] == pytest.approx([0.05 + 0.1 * i for i in range(10)])
    assert [r["reuse_next_rate"] for r in deciles] == [0, 0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert all(r["reuse_within_8_rate"] is None for r in rows)  # no token has 8 successors
    # rank 0: .95 Y, .85 N, .75 Y, .65 Y, .55 N -> 3/5; rank 1: .05 .15 .25 .35 .45, all N -> 0
    ranks = [r for r in rows if r["by"] == "rank"]
    assert [(r["bin"], r["selections"]) for r in ranks] == [(0, 5), (1, 5)]
    assert [r["reuse_next_rate"] for r in ranks] == [pytest.approx(0.6), 0.0]
    assert [(r["weight_lo"], r["weight_hi"]) for r in ranks] == [
        (pytest.approx(0.55), pytest.approx(0.95)),
        (pytest.approx(0.05), pytest.approx(0.45)),
    ]
    # Pearson: mean w .5, mean y .3; sum (w-.5)(y-.3) = .45 + .25 + .15 = .85 (the Ys; sum(w-.5) = 0);
    # sum (w-.5)^2 = 2 (.45^2 + .35^2 + .25^2 + .15^2 + .05^2) = .825; sum (y-.3)^2 = 10 x .3 x .7 = 2.1
    assert summary["pearson_next"] == pytest.approx(0.85 / np.sqrt(0.825 * 2.1), rel=1e-6)
    # Spearman: weight ranks 1..10, Ys at ranks 7, 8, 10; y ranks: 7 Ns share 4, 3 Ys share 9; means 5.5
    # sum (rw-5.5)(ry-5.5) = 3.5 (1.5 + 2.5 + 4.5) - 1.5 (-8.5) = 42.5; sum (rw-5.5)^2 = 82.5;
    # sum (ry-5.5)^2 = 3 x 3.5^2 + 7 x 1.5^2 = 52.5
    # (equal to Pearson here: the weights are equally spaced, so their ranks are linear in them)
    assert summary["spearman_next"] == pytest.approx(42.5 / np.sqrt(82.5 * 52.5), rel=1e-9)
    assert summary["pearson_within_8"] is None


def test_reuse_within_8_and_tied_deciles():
    # 1 layer, 3 experts, top-1, one request of 10 tokens: experts 0 1 2 2 2 2 2 2 1 0,
    # weights .3 .7 then .5 for the rest. Selections with a successor: t0..t8 (9).
    # next: t0 (0 -> 1) N, t1 (1 -> 2) N, t2..t6 (2 -> 2) Y, t7 (2 -> 1) N, t8 (1 -> 0) N -> 5/9
    # within 8, defined for t0 (9 successors) and t1 (8): t0: 0 not in t1..t8 (it is back at t9, d = 9) N;
    # t1: 1 at t8 (d = 7) Y -> 1/2
    experts = (0, 1, 2, 2, 2, 2, 2, 2, 1, 0)
    weights = (0.3, 0.7) + (0.5,) * 8
    tt = make_trace([("a", [[[e]] for e in experts])], num_experts=3, weights=[[[w]] for w in weights])
    table, summary = router_weight_table(tt)
    rows = table.to_pylist()
    ranks = [r for r in rows if r["by"] == "rank"]
    assert len(ranks) == 1 and ranks[0]["selections"] == 9
    assert ranks[0]["reuse_next_rate"] == pytest.approx(5 / 9)
    assert ranks[0]["reuse_within_8_rate"] == 0.5
    # sorted weights .3, .5 x7, .7 (n = 9): quantile q at position 8 q -> q = .1: .3 + .8 x .2 = .46,
    # q = .2 .. .8: .5, q = .9: .5 + .2 x .2 = .54; side="right": .3 -> bin 0, .5 -> bin 8, .7 -> bin 9
    deciles = [r for r in rows if r["by"] == "decile"]
    assert [(r["bin"], r["selections"]) for r in deciles] == [(0, 1), (8, 7), (9, 1)]
    assert [r["reuse_next_rate"] for r in deciles] == [0.0, pytest.approx(5 / 7), 0.0]
    assert [r["reuse_within_8_rate"] for r in deciles] == [0.0, None, 1.0]
    # within 8: weights (.3, .7) vs (0, 1) -> +1; next: the .3 and .7 deviations (-.2, +.2) both meet
    # y = 0, the rest has w - mean = 0 -> covariance 0 -> Pearson 0 (up to float32 rounding)
    assert summary["pearson_within_8"] == pytest.approx(1.0)
    assert summary["pearson_next"] == pytest.approx(0.0, abs=1e-6)


def test_average_ranks_share_ties():
    # sorted: 1 (rank 1), 2 2 (ranks 2, 3 -> 2.5), 5 (rank 4)
    np.testing.assert_array_equal(average_ranks(np.array([2.0, 5.0, 1.0, 2.0])), [2.5, 4.0, 1.0, 2.5])


def test_trace_without_router_weights_has_no_rows():
    tt = make_trace([("a", [[[0, 1]], [[0, 2]]])], num_experts=3)
    table, summary = router_weight_table(tt)
    assert table.num_rows == 0
    assert table.column_names[:3] == ["trace", "by", "bin"] and table.schema.field("bin").type == "int64"
    assert summary == {"pearson_next": None, "spearman_next": None, "pearson_within_8": None}


def test_partly_missing_weights_are_an_error():
    tt = make_trace([("a", [[[0, 1]], [[0, 2]]])], num_experts=3, weights=[[[0.6, 0.4]], [[0.6, np.nan]]])
    with pytest.raises(MoecacheError, match="trace t: .*request 'a', token 1, layer 0, rank 1"):
        router_weight_table(tt)


def test_rank_is_by_weight_not_by_logged_order():
    # The same trace with each row logged in reverse (smaller weight first): the rank rows must not
    # change, since rank 0 is the largest weight of the row whatever the order the router logged.
    reversed_trace = make_trace(
        [
            ("a", [[[1, 0]], [[2, 0]], [[3, 1]], [[0, 1]]]),
            ("b", [[[3, 2]], [[0, 2]], [[1, 3]]]),
        ],
        num_experts=4,
        weights=[
            [[0.05, 0.95]],
            [[0.15, 0.85]],
            [[0.25, 0.75]],
            [[0.4, 0.6]],
            [[0.35, 0.65]],
            [[0.45, 0.55]],
            [[0.4, 0.6]],
        ],
    )

    def ranks(trace):
        return [r for r in router_weight_table(trace)[0].to_pylist() if r["by"] == "rank"]

    rows = ranks(reversed_trace)
    assert rows == ranks(TRACE)
    # rank 0 = weights .95 .85 .75 .65 .55 with reuse Y N Y Y N -> 3/5
    assert rows[0]["bin"] == 0 and rows[0]["reuse_next_rate"] == pytest.approx(3 / 5)
