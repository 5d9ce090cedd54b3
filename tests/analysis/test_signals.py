"""Prefetch signals (moecache/analysis/signals.py): plug-in MI / CMI, the lead table and the logit-lens
token signal, against hand-computed values and a brute-force reference; TokenTrace's lens_TL."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moecache.analysis.signals import cmi_bits, lead_table, mi_bits, token_signal_table
from moecache.analysis.tokens import TokenTrace, load_token_trace
from moecache.errors import MoecacheError
from tests.analysis.token_traces import from_requests, token_trace

# ------------------------------------------------------------------------------ reference (slow)


def _top_k(score, freq, K):
    """Top-K ids by score, then freq, then lower id (the analyses' tie rule)."""
    return sorted(range(len(score)), key=lambda j: (-score[j], -freq[j], j))[:K]


def _lead_reference(expert_TLK, E, d):
    T, L, K = expert_TLK.shape
    A = np.zeros((L, E, E))
    freq = np.zeros((L, E))
    hits = predictions = 0
    for t in range(T):
        for n in range(L - d):
            score = A[n, expert_TLK[t, n]].sum(axis=0)
            hits += len(set(_top_k(score, freq[n + d], K)) & set(expert_TLK[t, n + d].tolist()))
            predictions += 1
        for n in range(L - d):
            for i in expert_TLK[t, n]:
                for j in expert_TLK[t, n + d]:
                    A[n, i, j] += 1
        for n in range(L):
            freq[n, expert_TLK[t, n]] += 1
    return hits / (K * predictions) if predictions else None


def _gain_reference(expert_TLK, lens_TL, E):
    """Per layer n >= 1: (samples, recall_layer, recall_layer_token), with dict-based B counts."""
    T, L, K = expert_TLK.shape
    A = np.zeros((L, E, E))
    B: dict = {}
    freq = np.zeros((L, E))
    out = {n: [0, 0, 0] for n in range(1, L)}
    for t in range(T):
        for n in range(1, L):
            x = lens_TL[t, n]
            if x < 0:
                continue
            chosen = set(expert_TLK[t, n].tolist())
            a = A[n, expert_TLK[t, n - 1]].sum(axis=0)
            b = B.get((n, x), np.zeros(E))
            score = (a / a.sum() if a.sum() else a) + (b / b.sum() if b.sum() else b)
            out[n][0] += 1
            out[n][1] += len(set(_top_k(a, freq[n], K)) & chosen)
            out[n][2] += len(set(_top_k(score, freq[n], K)) & chosen)
        for n in range(L):
            for j in expert_TLK[t, n]:
                freq[n, j] += 1
                if n >= 1:
                    for i in expert_TLK[t, n - 1]:
                        A[n, i, j] += 1
                    if lens_TL[t, n] >= 0:
                        B.setdefault((n, lens_TL[t, n]), np.zeros(E))[j] += 1
    return {
        n: (s, h1 / (K * s) if s else None, h2 / (K * s) if s else None) for n, (s, h1, h2) in out.items()
    }


def _random_trace(seed, T=40, L=4, K=2, E=6, vocab=(3, 100_000), rate=0.6):
    rng = np.random.default_rng(seed)
    expert_TLK = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)])
    lens_TL = rng.choice(np.array([vocab[0], 17, 5, vocab[1]]), size=(T, L))
    lens_TL[rng.random(T) > rate] = -1  # a token is sampled at every layer or at none
    request_T = np.repeat([0, 1], [T // 2, T - T // 2])
    return token_trace(expert_TLK, request_T, E, lens_TL=lens_TL)


# ------------------------------------------------------------------------------------- MI / CMI


def test_mi_by_hand_with_sparse_ids():
    assert mi_bits(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1])) == pytest.approx(1.0)
    assert mi_bits(np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])) == pytest.approx(0.0)
    # vocabulary-sized ids cost nothing: they are renumbered
    assert mi_bits(np.array([151_000, 151_000, 7, 7]), np.array([3, 3, 60, 60])) == pytest.approx(1.0)
    # x uniform on 4 values, y = x // 2: I = H(y) = 1 bit
    assert mi_bits(np.arange(8) % 4, (np.arange(8) % 4) // 2) == pytest.approx(1.0)
    assert mi_bits(np.array([], np.int64), np.array([], np.int64)) is None


def test_cmi_by_hand():
    # z determines x and y: nothing is left given z
    z = np.array([0, 0, 1, 1])
    assert cmi_bits(z, z, z) == pytest.approx(0.0)
    # z constant: CMI is the MI
    assert cmi_bits(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1]), np.zeros(4, int)) == pytest.approx(1.0)
    # given z=0, x = y (1 bit); given z=1, x and y independent (0 bits); each z half the samples
    x = np.array([0, 0, 1, 1, 0, 1, 0, 1])
    y = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    z = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    assert cmi_bits(x, y, z) == pytest.approx(0.5)
    assert cmi_bits(np.array([], int), np.array([], int), np.array([], int)) is None


# ------------------------------------------------------------------------------------ lead table


def test_lead_table_by_hand():
    # L=3, K=1, E=2; tokens [layer0, layer1, layer2]
    tt = token_trace([[[0], [1], [0]], [[0], [1], [0]], [[1], [0], [1]]], [0, 0, 0], 2)
    table, summary = lead_table(tt, 3, 50.0)
    rows = table.to_pylist()
    assert [r["lead_layers"] for r in rows] == [1, 2, 3]
    # d=1: t0 (empty counts: expert 0) misses at layer 1, hits at layer 2; t1 hits both; t2: unseen
    # source experts, ties broken by frequency (1 at layer 1, 0 at layer 2): both miss -> 3 / 6
    assert rows[0]["recall"] == pytest.approx(0.5)
    # d=2: t0 hits (expert 0 by id), t1 hits (counts), t2 misses (frequency picks 0) -> 2 / 3
    assert rows[1]["recall"] == pytest.approx(2 / 3)
    assert rows[2]["recall"] is None and rows[2]["tokens"] == 0  # no layer pair 3 apart
    assert [r["tokens"] for r in rows[:2]] == [3, 3]
    assert [r["lead_us"] for r in rows] == [50.0, 100.0, 150.0]
    assert summary == {
        "recall_lead_1": pytest.approx(0.5),
        "recall_lead_2": pytest.approx(2 / 3),
        "recall_lead_3": None,
        "layer_us": 50.0,
    }
    table, summary = lead_table(tt, 1, None)
    assert table["lead_us"].to_pylist() == [None] and summary["layer_us"] is None


@pytest.mark.parametrize("seed", [0, 1])
def test_lead_table_matches_a_brute_force_reference(seed):
    tt = _random_trace(seed)
    table, _ = lead_table(tt, 3, None)
    for row in table.to_pylist():
        want = _lead_reference(tt.expert_TLK.astype(int), tt.num_experts, row["lead_layers"])
        assert row["recall"] == pytest.approx(want)


def test_lead_table_refuses_bad_arguments():
    tt = token_trace([[[0], [1]]], [0], 2)
    with pytest.raises(MoecacheError, match="max_lead"):
        lead_table(tt, 0, None)
    with pytest.raises(MoecacheError, match="layer_us"):
        lead_table(tt, 1, -1.0)


# ---------------------------------------------------------------------------------- token signal


def _parity_trace(lens_T):
    """L=2, K=1, E=2: layer 0 always expert 0; layer 1 expert = lens token 10 -> 0, 11 -> 1."""
    lens_T = np.asarray(lens_T)
    experts = [[[0], [0 if x == 10 else 1]] for x in [10, 11, 10, 11, 10, 11]]
    lens_TL = np.stack([lens_T, lens_T], axis=1)
    return token_trace(experts, [0] * 6, 2, lens_TL=lens_TL)


def test_token_signal_by_hand():
    tt = _parity_trace([10, 11, 10, 11, 10, 11])
    table, summary = token_signal_table(tt, seed=3)
    (row,) = table.to_pylist()
    assert row["layer"] == 1 and row["samples"] == 6
    assert row["mi_bits"] == pytest.approx(1.0)  # the lens token decides the expert
    assert row["cmi_bits"] == pytest.approx(1.0)  # and the previous layer says nothing
    # the shuffled baseline: the same statistic with the lens tokens permuted by the seeded rng
    x = np.array([10, 11, 10, 11, 10, 11])
    shuffled = x[np.random.default_rng(3).permutation(6)]
    j = np.array([0, 1, 0, 1, 0, 1])
    assert row["mi_shuffled_bits"] == pytest.approx(mi_bits(shuffled, j))
    assert row["cmi_shuffled_bits"] == pytest.approx(cmi_bits(shuffled, j, np.zeros(6, int)))
    # layer: the counts out of expert 0 grow [1,0] [1,1] [2,1] ... -> always expert 0 -> 3 / 6;
    # layer+token: t0 hits (by id), t1 misses (token 11 unseen), then B decides: 5 / 6
    assert row["recall_layer"] == pytest.approx(0.5)
    assert row["recall_layer_token"] == pytest.approx(5 / 6)
    assert summary["token_gain"] == pytest.approx(5 / 6 - 0.5)
    assert summary["lens_recall_layer_mean"] == pytest.approx(0.5) and summary["lens_samples"] == 6
    assert summary["lens_mi_bits_mean"] == pytest.approx(1.0)


def test_token_counts_learn_from_sampled_tokens_only():
    # token 2 (lens 10) is not sampled: it still feeds the layer counts, never the token counts
    tt = _parity_trace([10, 11, -1, 11, 10, 11])
    (row,) = token_signal_table(tt)[0].to_pylist()
    assert row["samples"] == 5
    assert row["recall_layer"] == pytest.approx(2 / 5)  # hits at t0, t4
    assert row["recall_layer_token"] == pytest.approx(4 / 5)  # t1 misses (token 11 unseen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_gain_matches_a_brute_force_reference(seed):
    tt = _random_trace(seed)
    table, summary = token_signal_table(tt)
    want = _gain_reference(tt.expert_TLK.astype(int), tt.lens_TL.astype(int), tt.num_experts)
    rows = table.to_pylist()
    assert [r["layer"] for r in rows] == list(range(1, tt.num_layers))
    for row in rows:
        samples, recall_layer, recall_token = want[row["layer"]]
        assert row["samples"] == samples
        assert row["recall_layer"] == pytest.approx(recall_layer)
        assert row["recall_layer_token"] == pytest.approx(recall_token)
    assert summary["token_gain"] == pytest.approx(
        np.mean([r["recall_layer_token"] for r in rows]) - np.mean([r["recall_layer"] for r in rows])
    )
    again, _ = token_signal_table(tt)
    assert again.equals(table)  # seeded


@pytest.mark.parametrize("seed", [0, 1])
def test_table_information_equals_the_generic_estimators(seed):
    tt = _random_trace(seed, T=60, K=3, E=7)
    table, _ = token_signal_table(tt)
    K = tt.top_k
    for row in table.to_pylist():
        n = row["layer"]
        t_N = np.flatnonzero(tt.lens_TL[:, n] >= 0)
        x_N = tt.lens_TL[t_N, n].astype(np.int64)
        to_NK = tt.expert_TLK[t_N, n].astype(np.int64)
        from_NK = tt.expert_TLK[t_N, n - 1].astype(np.int64)
        assert row["mi_bits"] == pytest.approx(mi_bits(np.repeat(x_N, K), to_NK.reshape(-1)))
        triples_x = np.repeat(x_N, K * K)
        triples_j = np.broadcast_to(to_NK[:, None, :], (len(t_N), K, K)).reshape(-1)
        triples_i = np.broadcast_to(from_NK[:, :, None], (len(t_N), K, K)).reshape(-1)
        assert row["cmi_bits"] == pytest.approx(cmi_bits(triples_x, triples_j, triples_i))
        assert row["mi_shuffled_bits"] >= 0 and row["cmi_shuffled_bits"] >= 0


def test_no_lens_samples_gives_no_rows_and_none_summary():
    tt = token_trace([[[0], [1]], [[1], [0]]], [0, 0], 2)  # built without lens_TL
    table, summary = token_signal_table(tt)
    assert table.num_rows == 0 and table.schema.names[:3] == ["trace", "layer", "samples"]
    assert (
        summary["token_gain"] is None
        and summary["lens_mi_bits_mean"] is None
        and summary["lens_samples"] == 0
    )
    # lens tokens at layer 0 only: nothing to condition on either
    only_first = token_trace([[[0], [1]], [[1], [0]]], [0, 0], 2, lens_TL=[[4, -1], [5, -1]])
    assert token_signal_table(only_first)[0].num_rows == 0


# ------------------------------------------------------------------------------------ TokenTrace


def test_token_trace_without_lens_is_all_minus_one():
    tt = from_requests([("a", [[[0], [1]], [[1], [0]]])], 2)
    assert tt.lens_TL.shape == (2, 2) and tt.lens_TL.dtype == np.int32 and (tt.lens_TL == -1).all()
    assert not tt.has_lens
    with pytest.raises(MoecacheError, match="lens_TL"):
        TokenTrace(**{**tt.__dict__, "lens_TL": np.zeros((3, 2))})


def test_load_token_trace_reads_lens_tokens_and_accepts_their_absence(tmp_path, make_trace_file):
    # request q: a prefill of 2 tokens then one decode step, 2 layers; canonical row order is
    # (step, layer, token): the lens values must land on the right (token, layer)
    steps = [("q", 0, 0, [[0], [1]]), ("q", 0, 1, [[2], [3]]), ("q", 1, 0, [[1]]), ("q", 1, 1, [[0]])]
    table = pq.read_table(make_trace_file(tmp_path / "t.parquet", steps, num_layers=2, num_experts=4))
    # rows: (t0,l0) (t1,l0) (t0,l1) (t1,l1) (t2,l0) (t2,l1); token 1 not sampled
    lens = pa.array([100, None, 200, None, 300, 301], pa.int32())
    with_lens = table.set_column(table.schema.get_field_index("lens_token"), "lens_token", lens)
    pq.write_table(with_lens, tmp_path / "lens.parquet")
    tt = load_token_trace(tmp_path / "lens.parquet")
    np.testing.assert_array_equal(tt.lens_TL, [[100, 200], [-1, -1], [300, 301]])
    assert tt.has_lens

    old = table.drop_columns(["lens_token"])  # a trace written before the column existed
    pq.write_table(old, tmp_path / "old.parquet")
    tt = load_token_trace(tmp_path / "old.parquet")
    assert (tt.lens_TL == -1).all() and tt.num_tokens == 3
    pq.write_table(table, tmp_path / "null.parquet")  # the column, all null
    assert (load_token_trace(tmp_path / "null.parquet").lens_TL == -1).all()
