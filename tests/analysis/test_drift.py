"""JS divergence, request and window drift, and count convergence on hand-built traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moecache.analysis.drift import (
    average_ranks,
    convergence_table,
    js_divergence,
    layer_mean_js,
    request_drift_table,
    spearman,
    window_drift_table,
)
from moecache.analysis.tokens import TokenTrace
from moecache.errors import MoecacheError
from tests.analysis.token_traces import token_trace

# JS([1,1,0,0], [1,1,1,1]) = JS([1,1], [1,0]) after grouping: p = [1/2,1/2,0,0], q = [1/4]*4,
# m = [3/8,3/8,1/8,1/8]; KL(p||m) = log2(4/3); KL(q||m) = 1/2 log2(2/3) + 1/2 log2(2);
# JS = 1/2 (2 - log2 3 + 1/2 - 1/2 log2 3 + 1/2) = 3/2 - 3/4 log2 3 = 0.311278
J = 1.5 - 0.75 * math.log2(3)


def test_js_divergence_known_pairs():
    assert js_divergence(np.array([1, 0]), np.array([0, 1])) == pytest.approx(1.0)  # disjoint: 1 bit
    assert js_divergence(np.array([3, 1, 0]), np.array([3, 1, 0])) == 0.0  # p = q
    assert js_divergence(np.array([6, 2, 0]), np.array([3, 1, 0])) == 0.0  # normalised first
    assert js_divergence(np.array([1, 1, 0, 0]), np.array([1, 1, 1, 1])) == pytest.approx(J)
    assert js_divergence(np.array([1, 1]), np.array([2, 0])) == pytest.approx(J)  # same, symmetric order
    assert js_divergence(np.array([2, 0]), np.array([1, 1])) == pytest.approx(J)
    assert js_divergence(np.array([0, 0]), np.array([1, 1])) is None
    with pytest.raises(MoecacheError):
        js_divergence(np.array([1, 0]), np.array([1, 0, 0]))


def test_layer_mean_js():
    # layer 0 disjoint (1), layer 1 equal (0): mean 0.5
    assert layer_mean_js(np.array([[1, 0], [1, 0]]), np.array([[0, 1], [2, 0]])) == pytest.approx(0.5)
    # layer 1 undefined (p all zero): mean over layer 0 only = 1
    assert layer_mean_js(np.array([[1, 0], [0, 0]]), np.array([[0, 1], [2, 0]])) == pytest.approx(1.0)
    assert layer_mean_js(np.zeros((2, 2)), np.ones((2, 2))) is None


# L=2, E=4, K=2; one token per request:
#   r0: layer 0 {0,1}, layer 1 {0,1}
#   r1: layer 0 {0,1}, layer 1 {2,3}
#   r2: layer 0 {2,3}, layer 1 {2,3}
REQUEST_TRACE = [
    [[0, 1], [0, 1]],
    [[0, 1], [2, 3]],
    [[2, 3], [3, 2]],
]


def test_request_drift():
    tt = token_trace(REQUEST_TRACE, [0, 1, 2], num_experts=4)
    table, summary = request_drift_table(tt)
    assert table.column_names == ["trace", "request", "request_id", "tokens", "js_vs_rest", "js_vs_previous"]
    d = table.to_pydict()
    assert d["trace"] == ["t"] * 3
    assert d["request"] == [0, 1, 2]
    assert d["request_id"] == ["r0", "r1", "r2"]
    assert d["tokens"] == [1, 1, 1]
    # r0 vs rest (r1+r2): layer 0 [1,1,0,0] vs [1,1,1,1] -> J; layer 1 [1,1,0,0] vs [0,0,2,2] -> 1
    # r1 vs rest (r0+r2): layer 0 [1,1,0,0] vs [1,1,1,1] -> J; layer 1 [0,0,1,1] vs [1,1,1,1] -> J
    # r2 vs rest (r0+r1): layer 0 [0,0,1,1] vs [2,2,0,0] -> 1; layer 1 [0,0,1,1] vs [1,1,1,1] -> J
    assert d["js_vs_rest"] == pytest.approx([(J + 1) / 2, J, (1 + J) / 2])
    # r1 vs r0: layer 0 equal (0), layer 1 disjoint (1) -> 0.5; r2 vs r1: 1 and 0 -> 0.5
    assert d["js_vs_previous"][0] is None
    assert d["js_vs_previous"][1:] == pytest.approx([0.5, 0.5])
    # mean js_vs_rest = ((1+J)/2 + J + (1+J)/2) / 3 = (1 + 2J) / 3
    assert summary["request_js_vs_rest_mean"] == pytest.approx((1 + 2 * J) / 3)
    assert summary["request_js_vs_previous_mean"] == pytest.approx(0.5)


def test_request_drift_single_request():
    tt = token_trace(REQUEST_TRACE, [0, 0, 0], num_experts=4)
    table, summary = request_drift_table(tt)
    assert table.to_pydict()["tokens"] == [3]
    assert table.column("js_vs_rest").to_pylist() == [None]
    assert table.column("js_vs_previous").to_pylist() == [None]
    assert summary == {"request_js_vs_rest_mean": None, "request_js_vs_previous_mean": None}


# L=2, E=4, K=2; layer 1 is {0,1} for every token, so its JS is always 0 and every per-layer mean is
# half of layer 0's JS. Layer 0 per request (window_tokens = 2):
#   r0 (5 tokens): {0,1} {0,1} | {2,3} {2,3} | {0,1}         -> w0 [2,2,0,0], w1 [0,0,2,2], tail dropped
#   r1 (4 tokens): {0,1} {2,3} | {0,1} {2,3}                 -> w0 = w1 = [1,1,1,1]
#   r2 (1 token):  {0,1}                                     -> no whole window
#   r3 (6 tokens): {0,1} {0,1} | {0,1} {0,1} | {0,2} {0,2}   -> w0 = w1 [2,2,0,0], w2 [2,0,2,0]
WINDOW_LAYER0 = [
    *[[0, 1], [0, 1], [2, 3], [2, 3], [0, 1]],
    *[[0, 1], [2, 3], [0, 1], [2, 3]],
    *[[0, 1]],
    *[[0, 1], [0, 1], [0, 1], [0, 1], [0, 2], [0, 2]],
]
WINDOW_REQUESTS = [0] * 5 + [1] * 4 + [2] + [3] * 6


def window_trace(layer0=WINDOW_LAYER0, request_T=WINDOW_REQUESTS) -> TokenTrace:
    expert_TLK = [[experts, [0, 1]] for experts in layer0]
    return token_trace(expert_TLK, request_T, num_experts=4)


def test_window_drift():
    table, summary = window_drift_table(window_trace(), window_tokens=2, seed=0)
    assert table.column_names == [
        "trace",
        "window",
        "token_start",
        "requests",
        "js_vs_first",
        "js_vs_first_shuffled",
    ]
    d = table.to_pydict()
    assert d["window"] == [0, 1, 2]
    assert d["token_start"] == [0, 2, 4]
    # window 0 and 1: r0, r1, r3 (r2 has no whole window); window 2: r3 only (r0's 5th token dropped)
    assert d["requests"] == [3, 3, 1]
    # w0: 0. w1: r0 layer 0 disjoint -> 1/2, r1 0, r3 0 -> (0.5 + 0 + 0) / 3.
    # w2: r3 [2,0,2,0] vs [2,2,0,0]: p = [1/2,0,1/2,0], q = [1/2,1/2,0,0], m = [1/2,1/4,1/4,0],
    #     KL(p||m) = 1/2 log2(2) = 1/2 = KL(q||m) -> JS 1/2, per-layer mean 1/4
    assert d["js_vs_first"] == pytest.approx([0.0, 0.5 / 3, 0.25])
    assert d["js_vs_first_shuffled"][0] == 0.0
    # early/late over r0, r1, r3 (>= 4 tokens), split at tokens // 2:
    #   r0: [2,2,0,0] vs [1,1,2,2]: p = [1/2,1/2,0,0], q = [1/6,1/6,1/3,1/3], m = [1/3,1/3,1/6,1/6];
    #       KL(p||m) = log2(3/2), KL(q||m) = 2/6 log2(1/2) + 2/3 log2(2) = 1/3; JS = (log2 1.5 + 1/3) / 2
    #   r1: [1,1,1,1] vs [1,1,1,1] -> 0
    #   r3: [3,3,0,0] vs [3,1,2,0]: p = [1/2,1/2,0,0], q = [1/2,1/6,1/3,0], m = [1/2,1/3,1/6,0];
    #       KL(p||m) = 1/2 log2(3/2), KL(q||m) = 1/6 log2(1/2) + 1/3 log2(2) = 1/6; JS = (1/2 log2 1.5 + 1/6) / 2
    #   each halved by layer 1's 0
    js_r0 = (math.log2(1.5) + 1 / 3) / 2 / 2
    js_r3 = (0.5 * math.log2(1.5) + 1 / 6) / 2 / 2
    assert summary["js_early_late"] == pytest.approx((js_r0 + 0.0 + js_r3) / 3)
    assert summary["js_last_window_vs_first"] == pytest.approx(0.25)
    assert summary["js_last_window_vs_first_shuffled"] == d["js_vs_first_shuffled"][-1]
    assert summary["window_tokens"] == 2


def test_window_drift_shuffled_baseline_is_the_seeded_permutation():
    tt = window_trace()
    table, summary = window_drift_table(tt, window_tokens=2, seed=7)
    again, summary_again = window_drift_table(tt, window_tokens=2, seed=7)
    assert table.equals(again) and summary == summary_again
    # the baseline = the plain figures of the trace whose requests' tokens are permuted by one
    # default_rng(7), one permutation per request in request order
    rng = np.random.default_rng(7)
    bounds = tt.request_bounds()
    order = np.concatenate([bounds[r] + rng.permutation(bounds[r + 1] - bounds[r]) for r in range(4)])
    permuted = token_trace(tt.expert_TLK[order], tt.request_T, num_experts=4)
    plain, plain_summary = window_drift_table(permuted, window_tokens=2, seed=0)
    assert table.column("js_vs_first_shuffled").to_pylist() == pytest.approx(
        plain.column("js_vs_first").to_pylist()
    )
    assert summary["js_early_late_shuffled"] == pytest.approx(plain_summary["js_early_late"])


def test_window_drift_no_whole_window():
    table, summary = window_drift_table(window_trace(), window_tokens=7, seed=0)  # longest request: 6
    assert table.num_rows == 0
    assert summary["js_early_late"] is None and summary["js_last_window_vs_first"] is None


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_window_drift_bad_window_tokens(bad):
    with pytest.raises(MoecacheError, match="window_tokens"):
        window_drift_table(window_trace(), window_tokens=bad, seed=0)


def test_average_ranks_and_spearman():
    # 5 -> 1, 10 -> 2, the two 20s share ranks 3 and 4 -> 3.5
    assert average_ranks(np.array([10, 20, 20, 5])).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman(np.array([1, 2, 3]), np.array([10, 20, 30])) == pytest.approx(1.0)
    assert spearman(np.array([1, 2, 3]), np.array([3, 2, 1])) == pytest.approx(-1.0)
    assert spearman(np.array([2, 2, 2]), np.array([1, 2, 3])) is None  # constant side
    assert spearman(np.array([1, 2, 3]), np.array([0, 0, 0])) is None


# L=1, E=4, K=1; tokens choose experts 0, 1, 1, 2, 2 -> final counts [1, 2, 2, 0]; checkpoints 1, 2, 4, 5.
# final average ranks [2, 3.5, 3.5, 1], centred [-1/2, 1, 1, -3/2] (sum of squares 4.5)
# final top order (count desc, key asc): 1, 2, 0, 3 -> top1 {1}, top2 {1,2}
CONVERGENCE_TRACE = [[[0]], [[1]], [[1]], [[2]], [[2]]]


def test_convergence():
    tt = token_trace(CONVERGENCE_TRACE, [0, 0, 0, 1, 1], num_experts=4)
    table, summary = convergence_table(tt, capacities=[2, 1, 0, 5])  # 0 and 5 > L*E = 4 skipped
    assert table.column_names == ["trace", "tokens_seen", "spearman", "capacity", "overlap"]
    d = table.to_pydict()
    assert d["tokens_seen"] == [1, 1, 2, 2, 4, 4, 5, 5]
    assert d["capacity"] == [1, 2] * 4
    # seen 1 token [1,0,0,0]: ranks [4,2,2,2], centred [3/2,-1/2,-1/2,-1/2] (sum sq 3);
    #   sum of products -3/4 - 1/2 - 1/2 + 3/4 = -1 -> rho = -1 / sqrt(3 * 4.5)
    # seen 2 [1,1,0,0]: ranks [3.5,3.5,1.5,1.5], centred [1,1,-1,-1] (sum sq 4);
    #   products -1/2 + 1 - 1 + 3/2 = 1 -> rho = 1 / sqrt(4 * 4.5)
    # seen 4 [1,2,1,0]: ranks [2.5,4,2.5,1], centred [0,3/2,0,-3/2] (sum sq 4.5);
    #   products 0 + 3/2 + 0 + 9/4 = 3.75 -> rho = 3.75 / 4.5
    # seen 5 = final -> 1
    rho = [-1 / math.sqrt(13.5), 1 / math.sqrt(18), 3.75 / 4.5, 1.0]
    assert d["spearman"] == pytest.approx([r for r in rho for _ in range(2)])
    # top order of seen 1 [1,0,0,0]: 0,1,2,3 -> top1 {0}: 0/1; top2 {0,1} ∩ {1,2} = {1}: 1/2
    # seen 2 [1,1,0,0]: same order -> 0, 1/2;  seen 4 [1,2,1,0]: 1,0,2,3 -> top1 {1}: 1; top2 {1,0}: 1/2
    assert d["overlap"] == pytest.approx([0.0, 0.5, 0.0, 0.5, 1.0, 0.5, 1.0, 1.0])
    assert summary == {
        "tokens_to_spearman_0.9": 5,
        "tokens_to_overlap_0.9_C1": 4,
        "tokens_to_overlap_0.9_C2": 5,
    }


def test_convergence_stays_above():
    # "first checkpoint from which it stays >= 0.9": L=1, E=2, K=1, tokens choose 1, 0, 0, 1, 1 ->
    # final [2, 3], top1 {1}; seen 1 [0,1] -> {1}: 1; seen 2 [1,1] -> {0} (key asc): 0; seen 4 [2,2] -> {0}:
    # 0; seen 5 -> 1. Overlap reaches 1 at the first checkpoint but only stays there from 5 on.
    tt = token_trace([[[1]], [[0]], [[0]], [[1]], [[1]]], [0] * 5, num_experts=2)
    table, summary = convergence_table(tt, capacities=[1])
    assert table.column("overlap").to_pylist() == [1.0, 0.0, 0.0, 1.0]
    assert summary["tokens_to_overlap_0.9_C1"] == 5


def test_convergence_constant_and_no_capacity():
    # L=1, E=2, K=1, tokens 0, 1: final counts [1, 1] are constant -> spearman None everywhere
    tt = token_trace([[[0]], [[1]]], [0, 0], num_experts=2)
    table, summary = convergence_table(tt, capacities=[0, 3])  # no usable capacity (L*E = 2)
    d = table.to_pydict()
    assert d["tokens_seen"] == [1, 2]
    assert d["spearman"] == [None, None]
    assert d["capacity"] == [None, None] and d["overlap"] == [None, None]
    assert summary == {"tokens_to_spearman_0.9": None}


def test_convergence_keys_span_layers():
    # L=2, E=2, K=1: capacity 4 = L*E is usable; layer 0 picks 0, 0; layer 1 picks 1, 0
    # final keys (l*2+e) [2, 0, 1, 1] -> top order 0, 2, 3, 1; seen 1 token: [1, 0, 0, 1] -> order 0, 3, 1, 2
    tt = token_trace([[[0], [1]], [[0], [0]]], [0, 0], num_experts=2)
    table, _ = convergence_table(tt, capacities=[2, 4])
    d = table.to_pydict()
    assert d["capacity"] == [2, 4, 2, 4]
    # top2 seen {0,3} ∩ final {0,2} = {0} -> 1/2; capacity 4 covers every key -> 1
    assert d["overlap"] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    # seen 1 [1,0,0,1]: ranks [3.5,1.5,1.5,3.5] centred [1,-1,-1,1]; final [2,0,1,1]: ranks [4,1,2.5,2.5]
    # centred [1.5,-1.5,0,0] (sum sq 4.5): products 1.5 + 1.5 = 3 -> rho = 3 / sqrt(4 * 4.5)
    assert d["spearman"] == pytest.approx([3 / math.sqrt(18)] * 2 + [1.0] * 2)
