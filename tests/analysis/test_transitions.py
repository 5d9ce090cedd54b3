"""Token and layer transitions, layer mutual information, online predictors and self-recurrence on
hand-built traces, each figure worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.analysis.transitions import (
    layer_mi_table,
    layer_transition_table,
    layer_transitions,
    mutual_information_bits,
    predictor_table,
    recurrence_table,
    token_transition_table,
    token_transitions,
)
from tests.analysis.token_traces import from_requests as make_trace


def dense(counts: dict, num_layers: int = 2, num_experts: int = 4) -> np.ndarray:
    C = np.zeros((num_layers, num_experts, num_experts), np.int64)
    for (layer, i, j), n in counts.items():
        C[layer, i, j] = n
    return C


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


def test_token_transitions_lag_1_and_2_stay_within_requests():
    # lag 1: pairs (t0,t1), (t1,t2), (t3,t4); (t2,t3) crosses from a to b
    # layer 0: {0,1}x{0,2} + {0,2}x{0,1} + {1,3}x{0,1}
    #   (0,0) 1+1, (0,2) 1, (1,0) 1+1, (1,2) 1, (0,1) 1, (2,0) 1, (2,1) 1, (3,0) 1, (1,1) 1, (3,1) 1
    # layer 1: {2,3}x{2,3} + {2,3}x{0,1} + {0,1}x{2,3}: twelve distinct pairs, 1 each
    expected_1 = dense(
        {(0, 0, 0): 2, (0, 0, 1): 1, (0, 0, 2): 1, (0, 1, 0): 2, (0, 1, 1): 1, (0, 1, 2): 1, (0, 2, 0): 1}
        | {(0, 2, 1): 1, (0, 3, 0): 1, (0, 3, 1): 1}
        | {(1, i, j): 1 for i in (2, 3) for j in (2, 3)}
        | {(1, i, j): 1 for i in (2, 3) for j in (0, 1)}
        | {(1, i, j): 1 for i in (0, 1) for j in (2, 3)}
    )
    np.testing.assert_array_equal(token_transitions(TRACE, 1), expected_1)
    # lag 2: only (t0,t2) ((t1,t3) and (t2,t4) cross): layer 0 {0,1}x{0,1}, layer 1 {2,3}x{0,1}
    expected_2 = dense(
        {(0, i, j): 1 for i in (0, 1) for j in (0, 1)} | {(1, i, j): 1 for i in (2, 3) for j in (0, 1)}
    )
    np.testing.assert_array_equal(token_transitions(TRACE, 2), expected_2)

    table = token_transition_table(TRACE)
    assert table.column_names == ["trace", "layer", "lag", "from_expert", "to_expert", "count"]
    # nonzero cells: lag 1 10 + 12, lag 2 4 + 4
    assert table.num_rows == 30
    rows = table.to_pylist()
    assert rows[0] == {"trace": "t", "layer": 0, "lag": 1, "from_expert": 0, "to_expert": 0, "count": 2}
    assert [r["lag"] for r in rows].count(2) == 8
    assert sum(r["count"] for r in rows if r["lag"] == 1) == 3 * 2 * 4  # 3 pairs x 2 layers x K*K


def test_layer_transitions():
    # A[1] = pairs (layer-0 expert, layer-1 expert) of each token:
    # t0 {0,1}x{2,3}, t1 {0,2}x{2,3}, t2 {0,1}x{0,1}, t3 {1,3}x{0,1}, t4 {0,1}x{2,3}
    # (0,2): t0 t1 t4 = 3, (0,3) 3, (1,2): t0 t4 = 2, (1,3) 2, (2,2) 1, (2,3) 1,
    # (0,0): t2 = 1, (0,1) 1, (1,0): t2 t3 = 2, (1,1) 2, (3,0) 1, (3,1) 1   (sum 20 = 5 tokens x 4)
    expected = dense(
        {(1, 0, 2): 3, (1, 0, 3): 3, (1, 1, 2): 2, (1, 1, 3): 2, (1, 2, 2): 1, (1, 2, 3): 1}
        | {(1, 0, 0): 1, (1, 0, 1): 1, (1, 1, 0): 2, (1, 1, 1): 2, (1, 3, 0): 1, (1, 3, 1): 1}
    )
    np.testing.assert_array_equal(layer_transitions(TRACE), expected)
    table = layer_transition_table(TRACE)
    assert table.column_names == ["trace", "layer", "from_expert", "to_expert", "count"]
    assert table.num_rows == 12
    assert set(table.column("layer").to_pylist()) == {1}
    assert table.to_pylist()[0] == {"trace": "t", "layer": 1, "from_expert": 0, "to_expert": 0, "count": 1}


def test_mutual_information_of_known_distributions():
    # perfectly dependent, top-1, 4 experts used equally: layer 1 = layer 0 -> log2(4) = 2 bits
    same = make_trace([("a", [[[e], [e]] for e in (0, 1, 2, 3)])], num_experts=4)
    table, summary = layer_mi_table(same, seed=0)
    assert table.column_names == ["trace", "layer", "pairs", "mi_bits", "mi_shuffled_bits"]
    assert table.column("layer").to_pylist() == [1]
    assert table.column("pairs").to_pylist() == [4]  # 4 tokens x 1 x 1
    assert table.column("mi_bits")[0].as_py() == pytest.approx(2.0)
    assert summary["mi_bits_mean"] == pytest.approx(2.0)
    # independent: all four (layer 0, layer 1) combinations once -> uniform joint -> 0 bits
    indep = make_trace([("a", [[[i], [j]] for i in (0, 1) for j in (0, 1)])], num_experts=2)
    assert layer_mi_table(indep, seed=0)[0].column("mi_bits")[0].as_py() == pytest.approx(0.0, abs=1e-12)
    # P(0,0)=1/2, P(0,1)=1/4, P(1,1)=1/4; rows 3/4, 1/4; columns 1/2, 1/2:
    # 1/2 log2((1/2)/(3/8)) + 1/4 log2((1/4)/(3/8)) + 1/4 log2((1/4)/(1/8)) = 1.5 - 0.75 log2(3)
    assert mutual_information_bits(np.array([[2, 1], [0, 1]])) == pytest.approx(1.5 - 0.75 * np.log2(3))
    assert mutual_information_bits(np.zeros((2, 2), np.int64)) is None


def test_pairs_of_top_2_sets():
    # t0: {0,1} -> {2,3}, t1: {2,3} -> {0,1}: 8 pairs of 1/8, every marginal 1/4
    # MI = 8 x 1/8 x log2((1/8) / (1/16)) = 1 bit
    tt = make_trace([("a", [[[0, 1], [2, 3]], [[2, 3], [0, 1]]])], num_experts=4)
    table, _ = layer_mi_table(tt, seed=0)
    assert table.column("pairs").to_pylist() == [8]
    assert table.column("mi_bits")[0].as_py() == pytest.approx(1.0)


def test_shuffled_mi_uses_the_seeded_permutation():
    # top-1, layer 0 = layer 1 = 0 0 1 1 -> MI: P(0,0) = P(1,1) = 1/2 -> 1 bit.
    # Shuffled: layer-1 experts of tokens perm[t]. seed 0: perm = [2, 0, 1, 3] -> layer 1 = 1 0 0 1 ->
    # each of the 4 combinations once -> 0 bits. seed 1: perm = identity -> 1 bit.
    tt = make_trace([("a", [[[e], [e]] for e in (0, 0, 1, 1)])], num_experts=2)
    assert np.random.default_rng(0).permutation(4).tolist() == [2, 0, 1, 3]
    assert np.random.default_rng(1).permutation(4).tolist() == [0, 1, 2, 3]
    table0, summary0 = layer_mi_table(tt, seed=0)
    assert table0.column("mi_bits")[0].as_py() == pytest.approx(1.0)
    assert table0.column("mi_shuffled_bits")[0].as_py() == pytest.approx(0.0, abs=1e-12)
    assert summary0["mi_shuffled_bits_mean"] == pytest.approx(0.0, abs=1e-12)
    assert layer_mi_table(tt, seed=1)[0].column("mi_shuffled_bits")[0].as_py() == pytest.approx(1.0)
    assert layer_mi_table(tt, seed=0)[0].equals(table0)  # reproducible


def recall(table, layer, predictor):
    rows = [r for r in table.to_pylist() if r["layer"] == layer and r["predictor"] == predictor]
    assert len(rows) == 1
    return rows[0]["tokens"], rows[0]["recall"]


def test_predictors_top_1_with_layer_predictor():
    # 2 layers, 3 experts, top-1, one request; layer 0: 0 1 0 1 0, layer 1: 2 0 2 0 2.
    # Evaluated tokens: t2, t3, t4 (two predecessors). Counts are those of the tokens before t.
    # Layer 0:
    #  t2 (0): freq {0:1, 1:1} -> tie -> lower id 0: hit. repeat 1: miss. lag1: C1 = {0->1}, row 1 empty,
    #          all 0 -> by freq 0: hit. lag1+lag2: C2 empty -> 0: hit.
    #  t3 (1): freq {0:2, 1:1} -> 0: miss. repeat 0: miss. lag1: C1 row 0 = {1:1} -> 1: hit.
    #          lag1+lag2: + C2 row 1 (S_{t1}) = {} -> 1: hit.
    #  t4 (0): freq {0:2, 1:2} -> 0: hit. repeat 1: miss. lag1: C1 row 1 = {0:1} -> 0: hit.
    #          lag1+lag2: + C2 row 0 (S_{t2}) = {0:1} -> 0: hit.
    #  -> frequency 2/3, repeat 0, lag1 3/3, lag1+lag2 3/3
    # Layer 1:
    #  t2 (2): freq {2:1, 0:1} -> 0: miss. repeat 0: miss. lag1: C1 = {2->0}, row 0 empty -> by freq,
    #          tie -> 0: miss. lag1+lag2: C2 empty -> miss. layer: A = {0->2, 1->0}, S_{t2,0} = {0}
    #          -> row 0 = {2:1} -> 2: hit.
    #  t3 (0): freq {2:2, 0:1} -> 2: miss. repeat 2: miss. lag1: C1 row 2 = {0:1} -> 0: hit.
    #          lag1+lag2: + C2 row 0 (S_{t1}) = {} -> 0: hit. layer: S_{t3,0} = {1}, A row 1 = {0:1}: hit.
    #  t4 (2): freq {2:2, 0:2} -> 0: miss. repeat 0: miss. lag1: C1 row 0 = {2:1} -> 2: hit.
    #          lag1+lag2: + C2 row 2 = {2:1} -> 2: hit. layer: S_{t4,0} = {0}, A row 0 = {2:2}: hit.
    #  -> frequency 0, repeat 0, lag1 2/3, lag1+lag2 2/3, layer 3/3
    # All layers (3 tokens each): frequency 2/6, repeat 0, lag1 5/6, lag1+lag2 5/6, layer 3/3
    tt = make_trace(
        [("a", [[[a], [b]] for a, b in zip((0, 1, 0, 1, 0), (2, 0, 2, 0, 2), strict=True)])], num_experts=3
    )
    table, summary = predictor_table(tt)
    assert table.column_names == ["trace", "layer", "predictor", "tokens", "recall"]
    assert table.num_rows == 4 + 5 + 5  # no layer predictor at layer 0
    assert recall(table, 0, "frequency") == (3, pytest.approx(2 / 3))
    assert recall(table, 0, "repeat") == (3, 0.0)
    assert recall(table, 0, "lag1") == (3, 1.0)
    assert recall(table, 0, "lag1+lag2") == (3, 1.0)
    assert recall(table, 1, "frequency") == (3, 0.0)
    assert recall(table, 1, "lag1") == (3, pytest.approx(2 / 3))
    assert recall(table, 1, "lag1+lag2") == (3, pytest.approx(2 / 3))
    assert recall(table, 1, "layer") == (3, 1.0)
    assert recall(table, -1, "frequency") == (6, pytest.approx(2 / 6))
    assert recall(table, -1, "layer") == (3, 1.0)
    assert summary == {
        "recall_frequency": pytest.approx(2 / 6),
        "recall_repeat": 0.0,
        "recall_lag1": pytest.approx(5 / 6),
        "recall_lag1+lag2": pytest.approx(5 / 6),
        "recall_layer": 1.0,
    }


def test_predictors_top_2_ties_by_frequency():
    # 1 layer, 4 experts, top-2, one request: t0 {0,1}, t1 {1,2}, t2 {1,3}, t3 {1,2}; evaluated: t2, t3.
    #  t2 ({1,3}): freq {0:1, 1:2, 2:1} -> 1, then 0 (tie with 2, lower id) -> {1,0}: 1 hit.
    #      repeat {1,2}: 1 hit. lag1: C1 = {0,1}x{1,2}; rows 1 + 2 = {1:1, 2:1} -> 1 (freq 2) then 2:
    #      {1,2}: 1 hit. lag1+lag2: C2 empty -> {1,2}: 1 hit.
    #  t3 ({1,2}): freq {0:1, 1:3, 2:1, 3:1} -> 1, then 0 (lowest of the ties) -> {1,0}: 1 hit.
    #      repeat {1,3}: 1 hit. lag1: C1 += {1,2}x{1,3}; rows 1 + 3 = {1:2, 2:1, 3:1} -> 1, then 2
    #      (tie with 3 on score and freq, lower id): {1,2}: 2 hits.
    #      lag1+lag2: C2 = {0,1}x{1,3}; + rows 1 + 2 of C2 = {1:1, 3:1} -> {1:3, 2:1, 3:2} -> {1,3}: 1 hit.
    #  recall = hits / (K * tokens): frequency 2/4, repeat 2/4, lag1 3/4, lag1+lag2 2/4; no layer predictor.
    tt = make_trace([("a", [[[0, 1]], [[2, 1]], [[1, 3]], [[1, 2]]])], num_experts=4)
    table, summary = predictor_table(tt)
    assert summary == {
        "recall_frequency": 0.5,
        "recall_repeat": 0.5,
        "recall_lag1": 0.75,
        "recall_lag1+lag2": 0.5,
        "recall_layer": None,
    }
    assert recall(table, 0, "lag1") == (2, 0.75)
    assert recall(table, -1, "layer") == (0, None)


def test_predictor_counts_cross_requests_and_lag2_breaks_a_lag1_tie():
    # 1 layer, 4 experts, top-1; requests a 1 0 2 | a' 1 0 2 | b 3 0 1 | c 3 0 1 (tokens t0..t11).
    # Evaluated: t2, t5, t8, t11 (the only ones with two predecessors in their request).
    #  t2 (2):  freq {1:1, 0:1} -> 0: miss; repeat 0: miss; lag1: C1 row 0 empty -> by freq 0: miss;
    #           lag1+lag2 the same: miss.
    #  t5 (2):  freq {0:2, 1:2, 2:1} -> 0: miss; repeat: miss; lag1: C1 row 0 = {2:1} (from request a)
    #           -> 2: hit; lag1+lag2: + C2 row 1 = {2:1} -> 2: hit.
    #  t8 (1):  freq {0:3, 1:2, 2:2, 3:1} -> 0: miss; repeat: miss; lag1: row 0 = {2:2} -> 2: miss;
    #           lag1+lag2: + C2 row 3 = {} -> 2: miss.
    #  t11 (1): freq {0:4, 1:3, 2:2, 3:2} -> 0: miss; repeat: miss; lag1: row 0 = {1:1, 2:2} -> 2: miss;
    #           lag1+lag2: + C2 row 3 = {1:1} -> {1:2, 2:2}, tie -> freq 1 (3) > 2 (2) -> 1: hit.
    #  -> frequency 0/4, repeat 0/4, lag1 1/4, lag1+lag2 2/4
    seq = [("a", (1, 0, 2)), ("a2", (1, 0, 2)), ("b", (3, 0, 1)), ("c", (3, 0, 1))]
    tt = make_trace([(r, [[[e]] for e in es]) for r, es in seq], num_experts=4)
    table, summary = predictor_table(tt)
    assert recall(table, 0, "lag1") == (4, 0.25)
    assert summary == {
        "recall_frequency": 0.0,
        "recall_repeat": 0.0,
        "recall_lag1": 0.25,
        "recall_lag1+lag2": 0.5,
        "recall_layer": None,
    }


def test_recurrence():
    # Only t1 has a predecessor and a successor in its request (t0 and t2 of a; b has 2 tokens).
    # layer 0: S_t1 {0,2}, S_t0 {0,1}, S_t2 {0,1}: e0 (in, in) next; e1 (out, in) next;
    #          e2 (in, out) not next; e3 (out, out) not next
    # layer 1: S_t1 {2,3}, S_t0 {2,3}, S_t2 {0,1}: e0, e1 (out, out) next; e2, e3 (in, in) not next
    # (in, in): 3 cases, 1 reused; (in, out): 1, 0; (out, in): 1, 1; (out, out): 3, 2
    table = recurrence_table(TRACE)
    assert table.to_pydict() == {
        "trace": ["t"] * 4,
        "in_t": [True, True, False, False],
        "in_t_minus_1": [True, False, True, False],
        "cases": [3, 1, 1, 3],
        "reused_next": [1, 0, 1, 2],
        "probability": [pytest.approx(1 / 3), 0.0, 1.0, pytest.approx(2 / 3)],
    }


def test_recurrence_without_cases_is_null():
    tt = make_trace([("a", [[[0]], [[1]]]), ("b", [[[1]], [[0]]])], num_experts=2)
    table = recurrence_table(tt)
    assert table.column("cases").to_pylist() == [0, 0, 0, 0]
    assert table.column("probability").to_pylist() == [None] * 4
