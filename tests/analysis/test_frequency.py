"""Expert counts, the frequency table and the concentration figures on a hand-built trace."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moecache.analysis.frequency import (
    concentration_table,
    cover,
    expert_counts,
    frequency_table,
    gini,
)
from moecache.analysis.tokens import TokenTrace
from moecache.errors import MoecacheError
from tests.analysis.token_traces import token_trace


# L=2 layers, E=4 experts, K=2, 4 tokens (request 0: tokens 0-2, request 1: token 3).
#   layer 0: {0,1} {0,1} {0,1} {0,2} -> counts [4, 3, 1, 0]  (8 selections)
#   layer 1: {0,1} {2,3} {1,0} {3,2} -> counts [2, 2, 2, 2]  (8 selections)
# keys (l*4+e): 0:4 1:3 2:1 3:0 4:2 5:2 6:2 7:2  (16 selections)
@pytest.fixture
def tt() -> TokenTrace:
    expert_TLK = [
        [[0, 1], [0, 1]],
        [[1, 0], [2, 3]],
        [[0, 1], [1, 0]],
        [[2, 0], [3, 2]],
    ]
    return token_trace(expert_TLK, [0, 0, 0, 1], num_experts=4)


def test_expert_counts(tt):
    assert expert_counts(tt).dtype == np.int64
    assert expert_counts(tt).tolist() == [[4, 3, 1, 0], [2, 2, 2, 2]]


def test_frequency_table(tt):
    table = frequency_table(tt)
    assert table.column_names == ["trace", "layer", "expert", "count", "share", "global_rank"]
    d = table.to_pydict()
    assert d["trace"] == ["t"] * 8
    assert d["layer"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d["expert"] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert d["count"] == [4, 3, 1, 0, 2, 2, 2, 2]  # zero count kept
    # shares of the layer's 8 selections: 4/8, 3/8, 1/8, 0/8 and 2/8 x 4
    assert d["share"] == pytest.approx([0.5, 0.375, 0.125, 0.0, 0.25, 0.25, 0.25, 0.25])
    # order by count desc, key asc: key0(4) key1(3) key4(2) key5(2) key6(2) key7(2) key2(1) key3(0)
    # -> rank of key 0..7 = 1, 2, 7, 8, 3, 4, 5, 6 (ties among keys 4-7 broken by lower key first)
    assert d["global_rank"] == [1, 2, 7, 8, 3, 4, 5, 6]


def test_cover_and_gini_helpers():
    # counts sorted desc [4,3,1,0], cumulative 4, 7, 8 of 8: 0.8*8 = 6.4 -> 2 keys; 0.9*8 = 7.2 -> 3 keys
    assert cover(np.array([1, 0, 4, 3]), 0.8) == 2
    assert cover(np.array([1, 0, 4, 3]), 0.9) == 3
    assert cover(np.array([1, 0, 4, 3]), 1.0) == 3  # the zero key is never needed
    # 0.07 * 100 is 7.000000000000001 in floats; the exact threshold 7 is met by the first key alone
    assert cover(np.array([7] + [1] * 93), 0.07) == 1
    assert cover(np.zeros(4, np.int64), 0.5) is None
    assert gini(np.array([3, 3, 3])) == 0.0
    assert gini(np.zeros(3)) == 0.0
    # [1, 0]: sum_i sum_j |x_i - x_j| = 2, 2 n^2 mean = 2*4*0.5 = 4 -> 0.5
    assert gini(np.array([1, 0])) == pytest.approx(0.5)


def test_concentration_table(tt):
    table, summary = concentration_table(tt)
    assert table.column_names == [
        "trace",
        "scope",
        "layer",
        "selections",
        "entropy_bits",
        "normalized_entropy",
        "effective_experts",
        "gini",
        "cover_50",
        "cover_80",
        "cover_90",
        "cover_95",
        "global_top_share",
    ]
    g, l0, l1 = table.to_pylist()
    assert (g["trace"], g["scope"], g["layer"], g["selections"]) == ("t", "global", -1, 16)
    assert (l0["scope"], l0["layer"], l0["selections"]) == ("layer", 0, 8)
    assert (l1["scope"], l1["layer"], l1["selections"]) == ("layer", 1, 8)

    # layer 0, p = [1/2, 3/8, 1/8, 0]: H = 0.5*1 + 0.375*log2(8/3) + 0.125*3 = 1.405639
    h0 = 0.5 + 0.375 * math.log2(8 / 3) + 0.125 * 3
    assert l0["entropy_bits"] == pytest.approx(h0)
    assert l0["normalized_entropy"] == pytest.approx(h0 / 2)  # log2(4) = 2
    assert l0["effective_experts"] == pytest.approx(2**h0)
    # gini [4,3,1,0]: unordered |diffs| 1+3+4+2+3+1 = 14, ordered 28; 2 n^2 mean = 2*16*2 = 64 -> 0.4375
    assert l0["gini"] == pytest.approx(28 / 64)
    # sorted desc cumulative 4, 7, 8 of 8: 50% = 4 -> 1; 80% = 6.4 -> 2; 90% = 7.2 -> 3; 95% = 7.6 -> 3
    assert [l0[f"cover_{p}"] for p in (50, 80, 90, 95)] == [1, 2, 3, 3]

    # layer 1 uniform [2,2,2,2]: H = 2, normalized 1, effective 4, gini 0
    assert l1["entropy_bits"] == pytest.approx(2.0)
    assert l1["normalized_entropy"] == pytest.approx(1.0)
    assert l1["effective_experts"] == pytest.approx(4.0)
    assert l1["gini"] == 0.0
    # cumulative 2, 4, 6, 8: 50% = 4 -> 2; 80% = 6.4 -> 4; 90% = 7.2 -> 4; 95% = 7.6 -> 4
    assert [l1[f"cover_{p}"] for p in (50, 80, 90, 95)] == [2, 4, 4, 4]

    # global, p = [4,3,1,0,2,2,2,2]/16: H = 1/4*2 + 3/16*log2(16/3) + 1/16*4 + 4*(1/8*3) = 2.702820
    hg = 0.25 * 2 + 3 / 16 * math.log2(16 / 3) + 1 / 16 * 4 + 4 * (1 / 8 * 3)
    assert g["entropy_bits"] == pytest.approx(hg)
    assert g["normalized_entropy"] == pytest.approx(hg / 3)  # log2(8) = 3
    assert g["effective_experts"] == pytest.approx(2**hg)
    # gini: unordered |diffs| 4-3:1 4-1:3 4-0:4 4-2:2*4 3-1:2 3-0:3 3-2:1*4 1-0:1 1-2:1*4 0-2:2*4 = 38,
    # ordered 76; 2 n^2 mean = 2*64*2 = 256
    assert g["gini"] == pytest.approx(76 / 256)
    # sorted desc [4,3,2,2,2,2,1,0], cumulative 4,7,9,11,13,15,16:
    # 50% = 8 -> 3; 80% = 12.8 -> 5; 90% = 14.4 -> 6; 95% = 15.2 -> 7
    assert [g[f"cover_{p}"] for p in (50, 80, 90, 95)] == [3, 5, 6, 7]

    # global cover_80 placement = keys 0, 1, 4, 5, 6 (count desc, key asc): 2 in layer 0, 3 in layer 1
    assert g["global_top_share"] == 1.0
    assert l0["global_top_share"] == pytest.approx(2 / 5)
    assert l1["global_top_share"] == pytest.approx(3 / 5)

    assert summary["global_selections"] == 16
    assert summary["global_entropy_bits"] == pytest.approx(hg)
    assert summary["global_normalized_entropy"] == pytest.approx(hg / 3)
    assert summary["global_effective_experts"] == pytest.approx(2**hg)
    assert summary["global_gini"] == pytest.approx(76 / 256)
    assert [summary[f"global_cover_{p}"] for p in (50, 80, 90, 95)] == [3, 5, 6, 7]
    # layer cover_80 = [2, 4]: min 2, median 3, max 4; normalized entropy [h0/2, 1]
    assert summary["layer_cover_80_min"] == 2
    assert summary["layer_cover_80_median"] == pytest.approx(3.0)
    assert summary["layer_cover_80_max"] == 4
    assert summary["layer_normalized_entropy_min"] == pytest.approx(h0 / 2)
    assert summary["layer_normalized_entropy_max"] == pytest.approx(1.0)


def test_concentration_custom_fractions(tt):
    table, summary = concentration_table(tt, fractions=(0.25, 1.0))
    assert [c for c in table.column_names if c.startswith("cover_")] == ["cover_25", "cover_100"]
    # global cumulative 4, 7, ...: 25% of 16 = 4 -> 1 key; 100% = 16 -> 7 keys (key 3 has count 0)
    assert table.column("cover_25").to_pylist() == [1, 1, 1]  # layers: 25% of 8 = 2 -> 1 key each
    assert table.column("cover_100").to_pylist() == [7, 3, 4]
    assert summary["global_cover_25"] == 1 and summary["global_cover_100"] == 7
    # the per-layer cover summary is always at 80% (layer 0: 2 keys, layer 1: 4 keys)
    assert summary["layer_cover_80_min"] == 2 and summary["layer_cover_80_max"] == 4


def test_concentration_bad_fraction(tt):
    with pytest.raises(MoecacheError, match="fractions"):
        concentration_table(tt, fractions=(0.5, 1.5))
