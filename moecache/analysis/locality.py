"""Temporal locality of expert selections: reuse distances and runs.

Legend: T tokens (trace order: request by request, token order within a request), L layers, K top-k,
E experts per layer, X selections (T * L * K, one per (token, layer, router slot)), D reuses (selections
with an earlier selection of the same key), N runs.

A selection (t, l, e) is a use of the key l * E + e. Its reuse distance is t - t', t' < t the latest
earlier token, in trace order and across requests, whose S_{t',l} contains e; a key's first use is
cold (no distance). Distances count the tokens analysed (the complete tokens, tokens.py). A run is a
maximal stretch of consecutive tokens of one request that all select the key; runs end at request
boundaries and at a token left out of the analysis (TokenTrace.segment_T).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moecache.analysis.schema import I64, STR, schema
from moecache.analysis.tokens import TokenTrace

REUSE_SCHEMA = schema(trace=STR, distance=I64, count=I64)
RUN_SCHEMA = schema(trace=STR, run_length=I64, count=I64)


def _key_ordered(tt: TokenTrace) -> tuple[np.ndarray, np.ndarray]:
    """(key_X, token_X) of every selection, sorted by key and, within a key, by token. A key appears
    at most once per token (a row's experts are distinct)."""
    T, L, K, E = tt.num_tokens, tt.num_layers, tt.top_k, tt.num_experts
    key_TLK = np.arange(L, dtype=np.int64)[None, :, None] * E + tt.expert_TLK.astype(np.int64)
    key_X = key_TLK.reshape(-1)
    token_X = np.repeat(np.arange(T, dtype=np.int64), L * K)
    order_X = np.argsort(key_X, kind="stable")  # stable: tokens stay in trace order within a key
    return key_X[order_X], token_X[order_X]


def _histogram(values: np.ndarray, name: str, trace: str, schema: pa.Schema) -> pa.Table:
    value_V, count_V = np.unique(values, return_counts=True)
    return pa.table(
        {
            "trace": [trace] * len(value_V),
            name: value_V.astype(np.int64),
            "count": count_V.astype(np.int64),
        },
        schema=schema,
    )


def _share(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if mask.size else None


def reuse_table(tt: TokenTrace) -> tuple[pa.Table, dict]:
    """Histogram of reuse distances (trace, distance, count; distances that occur) and summary:
    reuse_median (None without reuses), reuse_share_1, reuse_share_le_8, cold_selections, cold_share
    (of all selections), cross_request_share (share of reuses whose previous use is in another request)."""
    key_X, token_X = _key_ordered(tt)
    same_X = key_X[1:] == key_X[:-1]  # selection x+1 reuses the key of selection x
    prev_D, next_D = token_X[:-1][same_X], token_X[1:][same_X]
    distance_D = next_D - prev_D
    cross_D = tt.request_T[prev_D] != tt.request_T[next_D]
    selections = int(key_X.size)
    cold = selections - int(distance_D.size)
    summary = {
        "reuse_median": float(np.median(distance_D)) if distance_D.size else None,
        "reuse_share_1": _share(distance_D == 1),
        "reuse_share_le_8": _share(distance_D <= 8),
        "cold_selections": cold,
        "cold_share": cold / selections if selections else None,
        "cross_request_share": _share(cross_D),
    }
    return _histogram(distance_D, "distance", tt.name, REUSE_SCHEMA), summary


def run_lengths(tt: TokenTrace) -> np.ndarray:
    """int64 [N]: the length (tokens) of every run, ordered by key, then start token."""
    key_X, token_X = _key_ordered(tt)
    if key_X.size == 0:
        return np.zeros(0, np.int64)
    continues_X = (
        (key_X[1:] == key_X[:-1])
        & (token_X[1:] - token_X[:-1] == 1)
        & (tt.segment_T[token_X[1:]] == tt.segment_T[token_X[:-1]])
    )
    run_X = np.cumsum(np.concatenate([[True], ~continues_X])) - 1
    return np.bincount(run_X).astype(np.int64)


def run_table(tt: TokenTrace) -> tuple[pa.Table, dict]:
    """Histogram of run lengths (trace, run_length, count) and summary: run_mean, run_share_1."""
    length_N = run_lengths(tt)
    summary = {
        "run_mean": float(length_N.mean()) if length_N.size else None,
        "run_share_1": _share(length_N == 1),
    }
    return _histogram(length_N, "run_length", tt.name, RUN_SCHEMA), summary
