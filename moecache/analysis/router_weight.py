"""Does a higher router weight mean the expert is used again soon?

Legend: T tokens (trace order: request by request, token order within a request), L layers, K top-k,
E experts per layer, X selections (t, l, k) whose token t has a successor t+1 in its request (its next
token, not left out of the analysis: TokenTrace.segment_T), B bins.

Per selection of expert e at (t, l): reuse_next = e in S_{t+1,l}; reuse_within_8 = e in S_{t+d,l} for
some d in 1..8, defined only when t has at least 8 successors in its request.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moecache.analysis.correlation import average_ranks, pearson, spearman  # noqa: F401
from moecache.analysis.schema import F64, I64, STR, schema
from moecache.analysis.tokens import TokenTrace
from moecache.errors import MoecacheError

WINDOW = 8
ROUTER_WEIGHT_SCHEMA = schema(
    trace=STR,
    by=STR,
    bin=I64,
    weight_lo=F64,
    weight_hi=F64,
    selections=I64,
    reuse_next_rate=F64,
    reuse_within_8_rate=F64,
)


def reuse_flags(tt: TokenTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(weight_X float64, rank_X int64, next_X bool, within_X int8) over the selections whose token has a
    successor, in (token, layer, rank) order; within_X is -1 where fewer than 8 successors exist."""
    T, L, K, E = tt.num_tokens, tt.num_layers, tt.top_k, tt.num_experts
    bounds = tt.segment_bounds()  # successors: the neighbours ahead, no token left out between
    successors_T = bounds[tt.segment_T.astype(np.int64) + 1] - 1 - np.arange(T)
    t_N = np.flatnonzero(successors_T >= 1)
    full_N = successors_T[t_N] >= WINDOW
    next_NLK = np.zeros((len(t_N), L, K), bool)
    within_NLK = np.zeros((len(t_N), L, K), bool)
    member_TE = np.zeros((T, E), np.int32)
    rows_T = np.arange(T)[:, None]
    rows_N = np.arange(len(t_N))[:, None]
    for layer in range(L):
        member_TE[:] = 0
        member_TE[rows_T, tt.expert_TLK[:, layer, :]] = 1
        # cumulative_TE[t] = selections of each expert by tokens < t (at layer l)
        cumulative_TE = np.zeros((T + WINDOW + 1, E), np.int32)
        np.cumsum(member_TE, axis=0, out=cumulative_TE[1 : T + 1])
        cumulative_TE[T + 1 :] = cumulative_TE[T]
        expert_NK = tt.expert_TLK[t_N, layer, :].astype(np.int64)
        next_NLK[:, layer, :] = member_TE[t_N + 1][rows_N, expert_NK] > 0
        window_NE = cumulative_TE[t_N + WINDOW + 1] - cumulative_TE[t_N + 1]
        within_NLK[:, layer, :] = window_NE[rows_N, expert_NK] > 0
    within_NLK = np.where(full_N[:, None, None], within_NLK.astype(np.int8), np.int8(-1))
    # rank by weight within the row (0 = largest; ties keep router order): routers need not log
    # their choices in weight order (the DeepSeek ESFT traces do not)
    order_NLK = np.argsort(-tt.weight_TLK[t_N], axis=2, kind="stable")
    rank_NLK = np.empty_like(order_NLK)
    np.put_along_axis(rank_NLK, order_NLK, np.broadcast_to(np.arange(K), order_NLK.shape), axis=2)
    return (
        tt.weight_TLK[t_N].astype(np.float64).reshape(-1),
        rank_NLK.reshape(-1),
        next_NLK.reshape(-1),
        within_NLK.reshape(-1),
    )


def _rows(tt: TokenTrace, by: str, bin_X, weight_X, next_X, within_X) -> dict[str, list]:
    rows = {name: [] for name in ROUTER_WEIGHT_SCHEMA.names}
    for b in np.unique(bin_X):
        in_bin = bin_X == b
        defined = within_X[in_bin] >= 0
        rows["trace"].append(tt.name)
        rows["by"].append(by)
        rows["bin"].append(int(b))
        rows["weight_lo"].append(float(weight_X[in_bin].min()))
        rows["weight_hi"].append(float(weight_X[in_bin].max()))
        rows["selections"].append(int(in_bin.sum()))
        rows["reuse_next_rate"].append(float(next_X[in_bin].mean()))
        rows["reuse_within_8_rate"].append(float(within_X[in_bin][defined].mean()) if defined.any() else None)
    return rows


def router_weight_table(tt: TokenTrace) -> tuple[pa.Table, dict]:
    """Reuse rates by router-weight decile (by="decile": bin = np.searchsorted(the 0.1..0.9 quantiles
    of the weights, w, side="right")) and by weight rank within the token's row (by="rank": bin = 0 for the largest weight), over the selections whose
    token has a successor; only bins with selections. Columns: trace, by, bin, weight_lo, weight_hi
    (min/max weight in the bin), selections, reuse_next_rate, reuse_within_8_rate (None when no
    selection of the bin has 8 successors). Summary: pearson_next, spearman_next (Pearson of average
    ranks), pearson_within_8 (weight vs the 0/1 flags). A trace without router weights (all NaN) gives
    no rows and None figures."""
    none = {"pearson_next": None, "spearman_next": None, "pearson_within_8": None}
    empty = ROUTER_WEIGHT_SCHEMA.empty_table()
    nan = np.isnan(tt.weight_TLK)
    if nan.all():
        return empty, none
    if nan.any():
        t, layer, k = (int(i[0]) for i in np.nonzero(nan))
        raise MoecacheError(
            f"trace {tt.name}: router weights are missing for some selections only (request "
            f"{tt.request_ids[int(tt.request_T[t])]!r}, token {int(tt.position_T[t])}, layer {layer}, rank {k})"
        )
    weight_X, rank_X, next_X, within_X = reuse_flags(tt)
    if weight_X.size == 0:
        return empty, none
    edges = np.quantile(weight_X, np.arange(1, 10) / 10)
    decile_X = np.searchsorted(edges, weight_X, side="right")
    rows = _rows(tt, "decile", decile_X, weight_X, next_X, within_X)
    by_rank = _rows(tt, "rank", rank_X, weight_X, next_X, within_X)
    for name in rows:
        rows[name].extend(by_rank[name])
    next_f = next_X.astype(np.float64)
    full = within_X >= 0
    summary = {
        "pearson_next": pearson(weight_X, next_f),
        "spearman_next": spearman(weight_X, next_f),
        "pearson_within_8": pearson(weight_X[full], within_X[full].astype(np.float64)),
    }
    return pa.table(rows, schema=ROUTER_WEIGHT_SCHEMA), summary
