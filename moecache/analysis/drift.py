"""Does the expert mix drift: across requests, along a request, and how fast do counts converge.

Legend: T tokens, L MoE layers, K experts chosen per token and layer (top-k), E experts per layer,
R requests, W windows (of one request, or the most any request has), N keys (L*E; key = l * E + e),
X any leading axes, C cache capacities (in experts).

JS divergence: Jensen-Shannon in bits between two count vectors normalised to distributions,
JS = 0.5 KL(p||m) + 0.5 KL(q||m), m = (p+q)/2, 0 log 0 = 0; undefined (None / NaN) when either vector
is all zeros. "Per-layer mean": JS computed per layer over its E experts, averaged over the layers where
it is defined.

Tables (see the issue-4 spec): `request_drift_table` -> request_drift.parquet, `window_drift_table` ->
window_drift.parquet, `convergence_table` -> convergence.parquet.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moecache.analysis.correlation import average_ranks, spearman  # noqa: F401 (re-exported)
from moecache.analysis.frequency import expert_counts, keys_TLK, order_by_count
from moecache.analysis.schema import F64, I64, STR, schema
from moecache.analysis.tokens import TokenTrace
from moecache.errors import MoecacheError

# largest window-count block (windows * L * E cells) built at once by window_drift_table
_MAX_BLOCK_CELLS = 1 << 22


def js_bits(p_XE: np.ndarray, q_XE: np.ndarray) -> np.ndarray:
    """float64 [X]: JS divergence (bits) over the last axis; NaN where either side sums to 0."""
    p_XE = np.asarray(p_XE, np.float64)
    q_XE = np.asarray(q_XE, np.float64)
    p_sum_X = p_XE.sum(axis=-1, keepdims=True)
    q_sum_X = q_XE.sum(axis=-1, keepdims=True)
    p = p_XE / np.where(p_sum_X > 0, p_sum_X, 1.0)
    q = q_XE / np.where(q_sum_X > 0, q_sum_X, 1.0)
    m = 0.5 * (p + q)
    safe_m = np.where(m > 0, m, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl_p = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0) / safe_m), 0.0).sum(axis=-1)
        kl_q = np.where(q > 0, q * np.log2(np.where(q > 0, q, 1.0) / safe_m), 0.0).sum(axis=-1)
    js_X = np.maximum(0.5 * kl_p + 0.5 * kl_q, 0.0)
    defined_X = (p_sum_X[..., 0] > 0) & (q_sum_X[..., 0] > 0)
    return np.where(defined_X, js_X, np.nan)


def js_divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> float | None:
    """JS divergence (bits) of two count vectors; None when either is all zeros."""
    p_counts = np.asarray(p_counts)
    q_counts = np.asarray(q_counts)
    if p_counts.ndim != 1 or p_counts.shape != q_counts.shape:
        raise MoecacheError(f"js_divergence: count vectors of shapes {p_counts.shape} and {q_counts.shape}")
    js = float(js_bits(p_counts, q_counts))
    return None if np.isnan(js) else js


def layer_mean_js_X(p_XLE: np.ndarray, q_XLE: np.ndarray) -> np.ndarray:
    """float64 [X]: per-layer-mean JS of [..., L, E] counts; NaN where no layer is defined."""
    js_XL = js_bits(p_XLE, q_XLE)
    defined_XL = ~np.isnan(js_XL)
    n_X = defined_XL.sum(axis=-1)
    total_X = np.where(defined_XL, js_XL, 0.0).sum(axis=-1)
    return np.where(n_X > 0, total_X / np.maximum(n_X, 1), np.nan)


def layer_mean_js(p_LE: np.ndarray, q_LE: np.ndarray) -> float | None:
    """Per-layer-mean JS (bits) of two [L, E] count arrays; None when no layer is defined."""
    js = float(layer_mean_js_X(p_LE, q_LE))
    return None if np.isnan(js) else js


def _none_if_nan(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def _mean_or_none(values_X: np.ndarray) -> float | None:
    values_X = np.asarray(values_X, np.float64)
    values_X = values_X[~np.isnan(values_X)]
    return float(values_X.mean()) if values_X.size else None


def _float_column(values_X: np.ndarray) -> pa.Array:
    values_X = np.asarray(values_X, np.float64)
    return pa.array(values_X, pa.float64(), mask=np.isnan(values_X))


def _counts_of_segments(key_SLK: np.ndarray, segment_S: np.ndarray, segments: int, n: int) -> np.ndarray:
    """int64 [segments, N]: counts of the keys of each segment (segment_S: the segment of each token)."""
    flat = (segment_S.astype(np.int64)[:, None, None] * n + key_SLK).ravel()
    return np.bincount(flat, minlength=segments * n).reshape(segments, n)


def request_counts(tt: TokenTrace) -> np.ndarray:
    """int64 [R, L, E]: selections per request, layer and expert."""
    L, E = tt.num_layers, tt.num_experts
    counts_RN = _counts_of_segments(keys_TLK(tt), tt.request_T, tt.num_requests, L * E)
    return counts_RN.reshape(tt.num_requests, L, E)


def request_drift_table(tt: TokenTrace) -> tuple[pa.Table, dict]:
    """Per request: tokens, js_vs_rest (per-layer-mean JS of the request's counts vs the counts of all
    other requests; null with one request) and js_vs_previous (vs the previous request; null for the
    first). Summary: request_js_vs_rest_mean, request_js_vs_previous_mean (over defined values)."""
    R = tt.num_requests
    counts_RLE = request_counts(tt)
    rest_RLE = counts_RLE.sum(axis=0, keepdims=True) - counts_RLE
    vs_rest_R = layer_mean_js_X(counts_RLE, rest_RLE) if R > 1 else np.full(R, np.nan)
    vs_previous_R = np.full(R, np.nan)
    if R > 1:
        vs_previous_R[1:] = layer_mean_js_X(counts_RLE[1:], counts_RLE[:-1])
    table = pa.table(
        {
            "trace": pa.array([tt.name] * R, pa.string()),
            "request": np.arange(R, dtype=np.int64),
            "request_id": pa.array(list(tt.request_ids), pa.string()),
            "tokens": np.diff(tt.request_bounds()).astype(np.int64),
            "js_vs_rest": _float_column(vs_rest_R),
            "js_vs_previous": _float_column(vs_previous_R),
        }
    )
    summary = {
        "request_js_vs_rest_mean": _mean_or_none(vs_rest_R),
        "request_js_vs_previous_mean": _mean_or_none(vs_previous_R),
    }
    return table, summary


def _windows_vs_first(key_TLK: np.ndarray, window_tokens: int, L: int, E: int) -> np.ndarray:
    """float64 [W]: per-layer-mean JS of each whole window of one request's tokens vs its window 0
    (W = tokens // window_tokens; the short tail is dropped). Built in blocks of windows to bound memory."""
    W = key_TLK.shape[0] // window_tokens
    out_W = np.full(W, np.nan)
    if W == 0:
        return out_W
    n = L * E
    first_LE = np.bincount(key_TLK[:window_tokens].ravel(), minlength=n).reshape(L, E)
    block = max(1, _MAX_BLOCK_CELLS // n)
    for w0 in range(0, W, block):
        w1 = min(W, w0 + block)
        segment = np.repeat(np.arange(w1 - w0), window_tokens)
        counts_WN = _counts_of_segments(key_TLK[w0 * window_tokens : w1 * window_tokens], segment, w1 - w0, n)
        out_W[w0:w1] = layer_mean_js_X(counts_WN.reshape(w1 - w0, L, E), first_LE)
    return out_W


def _early_late(key_TLK: np.ndarray, L: int, E: int) -> float:
    """Per-layer-mean JS of the first half (tokens // 2 tokens) vs the rest of one request's tokens."""
    half = key_TLK.shape[0] // 2
    n = L * E
    early_LE = np.bincount(key_TLK[:half].ravel(), minlength=n).reshape(L, E)
    late_LE = np.bincount(key_TLK[half:].ravel(), minlength=n).reshape(L, E)
    return float(layer_mean_js_X(early_LE, late_LE))


def window_drift_table(tt: TokenTrace, window_tokens: int, seed: int) -> tuple[pa.Table, dict]:
    """Each request's tokens split into consecutive windows of window_tokens (a final shorter window is
    dropped). Per window index w: token_start = w * window_tokens, requests = how many requests have
    window w, js_vs_first = mean over those requests of per-layer-mean JS(window w, window 0), and
    js_vs_first_shuffled = the same after permuting each request's tokens (one
    np.random.default_rng(seed), one permutation per request in request order, every request drawn):
    the no-drift baseline of sampling noise.
    Summary: js_early_late (mean over requests with >= 2 * window_tokens tokens of per-layer-mean
    JS(first half, second half)), js_early_late_shuffled, js_last_window_vs_first and
    js_last_window_vs_first_shuffled (the last window index's row; None with fewer than two windows),
    window_tokens."""
    if (
        isinstance(window_tokens, bool)
        or not isinstance(window_tokens, (int, np.integer))
        or window_tokens < 1
    ):
        raise MoecacheError(f"window_drift: window_tokens must be an integer >= 1, got {window_tokens!r}")
    window_tokens = int(window_tokens)
    L, E = tt.num_layers, tt.num_experts
    key_TLK = keys_TLK(tt)
    bounds = tt.request_bounds()
    rng = np.random.default_rng(seed)
    W = int((np.diff(bounds) // window_tokens).max()) if tt.num_requests else 0
    sums = {False: np.zeros(W), True: np.zeros(W)}
    defined = {False: np.zeros(W, np.int64), True: np.zeros(W, np.int64)}
    requests_W = np.zeros(W, np.int64)
    early_late = {False: [], True: []}
    for r in range(tt.num_requests):
        own_TLK = key_TLK[bounds[r] : bounds[r + 1]]
        shuffled_TLK = own_TLK[rng.permutation(own_TLK.shape[0])]
        n_windows = own_TLK.shape[0] // window_tokens
        requests_W[:n_windows] += 1
        for shuffled, keys in ((False, own_TLK), (True, shuffled_TLK)):
            js_W = _windows_vs_first(keys, window_tokens, L, E)
            ok_W = ~np.isnan(js_W)
            sums[shuffled][:n_windows] += np.where(ok_W, js_W, 0.0)
            defined[shuffled][:n_windows] += ok_W
            if own_TLK.shape[0] >= 2 * window_tokens:
                early_late[shuffled].append(_early_late(keys, L, E))
    mean = {s: np.where(defined[s] > 0, sums[s] / np.maximum(defined[s], 1), np.nan) for s in (False, True)}
    table = pa.table(
        {
            "trace": pa.array([tt.name] * W, pa.string()),
            "window": np.arange(W, dtype=np.int64),
            "token_start": np.arange(W, dtype=np.int64) * window_tokens,
            "requests": requests_W,
            "js_vs_first": _float_column(mean[False]),
            "js_vs_first_shuffled": _float_column(mean[True]),
        }
    )
    summary = {
        "window_tokens": window_tokens,
        "js_early_late": _mean_or_none(np.array(early_late[False], np.float64)),
        "js_early_late_shuffled": _mean_or_none(np.array(early_late[True], np.float64)),
        "js_last_window_vs_first": _none_if_nan(mean[False][-1]) if W > 1 else None,
        "js_last_window_vs_first_shuffled": _none_if_nan(mean[True][-1]) if W > 1 else None,
    }
    return table, summary


def top_overlap(x_N: np.ndarray, y_N: np.ndarray, capacity: int) -> float:
    """|topC(x) ∩ topC(y)| / C, top-C taken by count descending then key ascending."""
    top_x = order_by_count(x_N)[:capacity]
    top_y = order_by_count(y_N)[:capacity]
    return np.intersect1d(top_x, top_y).size / capacity


def _checkpoints(T: int) -> list[int]:
    """1, 2, 4, ... (powers of two < T), then T."""
    points = []
    c = 1
    while c < T:
        points.append(c)
        c *= 2
    return [*points, T] if T > 0 else []


def _first_from_which(points: list[int], ok: list[bool]) -> int | None:
    """The first checkpoint from which every later one is ok (None if the last is not)."""
    first = None
    for point, good in zip(points, ok, strict=True):
        if good and first is None:
            first = point
        elif not good:
            first = None
    return first


def convergence_table(tt: TokenTrace, capacities: list[int]) -> tuple[pa.Table, dict]:
    """At checkpoints tokens_seen = 1, 2, 4, ... (< T) and T: the counts over the first tokens_seen tokens
    (trace order) vs the final counts over all L*E keys: spearman (average ranks; null when either side
    is constant) and, per capacity C (C <= 0 or C > L*E skipped), overlap = |topC(seen) ∩ topC(final)| / C.
    One row per (tokens_seen, capacity), spearman repeated; with no usable capacity, one row per
    checkpoint with null capacity and overlap.
    Summary: tokens_to_spearman_0.9 (first checkpoint from which spearman stays >= 0.9; None if never)
    and per capacity tokens_to_overlap_0.9_C<cap>."""
    n = tt.num_layers * tt.num_experts
    caps = sorted({int(c) for c in capacities if 0 < int(c) <= n})
    key_TLK = keys_TLK(tt)
    final_N = expert_counts(tt).ravel()
    points = _checkpoints(tt.num_tokens)
    seen_N = np.zeros(n, np.int64)
    previous = 0
    rows = []
    rho_P, overlap_PC = [], []
    for point in points:
        seen_N += np.bincount(key_TLK[previous:point].ravel(), minlength=n)
        previous = point
        rho = spearman(seen_N, final_N)
        overlaps = [top_overlap(seen_N, final_N, c) for c in caps]
        rho_P.append(rho)
        overlap_PC.append(overlaps)
        for c, overlap in zip(caps, overlaps, strict=True):
            rows.append({"tokens_seen": point, "spearman": rho, "capacity": c, "overlap": overlap})
        if not caps:
            rows.append({"tokens_seen": point, "spearman": rho, "capacity": None, "overlap": None})
    columns = schema(trace=STR, tokens_seen=I64, spearman=F64, capacity=I64, overlap=F64)
    table = pa.Table.from_pylist([{"trace": tt.name, **row} for row in rows], schema=columns)
    summary: dict = {
        "tokens_to_spearman_0.9": _first_from_which(points, [rho is not None and rho >= 0.9 for rho in rho_P])
    }
    for i, c in enumerate(caps):
        summary[f"tokens_to_overlap_0.9_C{c}"] = _first_from_which(points, [o[i] >= 0.9 for o in overlap_PC])
    return table, summary
