"""Signals for predictive prefetching: how far ahead the layer-to-layer transitions predict a token's
experts, and what the logit lens (the model's own next-token guess mid-network) adds to them.

Legend: T tokens (trace order: request by request, token order within a request), L MoE layers, K
top-k, E experts per layer, D leads, N samples (pairs or triples), U distinct lens tokens of a layer,
P distinct (layer, lens token) pairs.

S(t, n) is the set of the K experts token t chose at MoE layer n; x(t, n) is the trace's lens token of
token t at layer n (`TokenTrace.lens_TL`: the top-1 token of the residual stream entering layer n's
decoder layer; -1 where the token was not sampled). Online counts are built in trace order from the
tokens before t only (across requests), as in `transitions.predictor_table`; a prediction is the
top-K experts by score, ties broken by the online selection count at the predicted layer, then by the
lower expert id (`transitions._top_k_hits`).

- `lead_table`: inter-layer prefetch with a lead of d layers. A_d[n, i, j] counts the tokens with i in
  S(t, n) and j in S(t, n + d); S(t, n + d) is predicted from the row sum of A_d[n] over S(t, n).
  recall = |prediction ∩ S(t, n + d)| / K averaged over every token and every layer n with n + d < L.
  The lead in time is d x `layer_us` (the time of one MoE layer's forward, when given).
- `token_signal_table`: per layer n >= 1, on the sampled tokens (x(t, n) >= 0) only: the plug-in
  mutual information (bits) between x(t, n) and the experts of S(t, n) (pairs (x, j), j in S(t, n)),
  the conditional mutual information I(x; j | i) over the triples (i in S(t, n-1), x, j in S(t, n)),
  each beside the same with the lens tokens permuted among the layer's samples (seeded: the plug-in
  estimator's bias, which is large when tokens are many and samples few); and the accuracy gain:
  online recall of S(t, n) predicted by "layer" (scores: the row sum of the layer transition counts
  A[n] over S(t, n-1)) against "layer+token" (that row sum normalised to sum 1, plus B[n, x(t, n)]
  normalised to sum 1, B[n, x, j] counting the earlier sampled tokens with lens token x at layer n
  and j in S(t, n)). A learns from every earlier token (routing is always observed), B only from the
  earlier sampled ones, so at a low lens rate the gain is a lower bound.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import pyarrow as pa

from moecache.analysis.schema import F64, I64, STR, schema
from moecache.analysis.tokens import TokenTrace
from moecache.analysis.transitions import _top_k_hits
from moecache.errors import MoecacheError

LEAD_SCHEMA = schema(trace=STR, lead_layers=I64, recall=F64, tokens=I64, lead_us=F64)
TOKEN_SIGNAL_KEYS = (
    "mi_bits",
    "mi_shuffled_bits",
    "cmi_bits",
    "cmi_shuffled_bits",
    "recall_layer",
    "recall_layer_token",
)
TOKEN_SIGNAL_SCHEMA = schema(trace=STR, layer=I64, samples=I64, **dict.fromkeys(TOKEN_SIGNAL_KEYS, F64))


# ------------------------------------------------------------------------------------------ lead


@nb.njit(cache=True, nogil=True)
def _lead_hits(expert_TLK, max_lead, num_experts):
    """(hits_D, predictions_D) for leads d = 1..max_lead (index d - 1): the experts of S(t, n + d)
    that the prediction from S(t, n) contains, summed over t and n < L - d, and the number of those
    predictions. Token t's predictions read counts of tokens < t only (they take t in afterwards)."""
    T, L, K = expert_TLK.shape
    E = num_experts
    A_DLEE = np.zeros((max_lead, L, E, E), np.int64)
    freq_LE = np.zeros((L, E), np.int64)
    hits_D = np.zeros(max_lead, np.int64)
    predictions_D = np.zeros(max_lead, np.int64)
    score_E = np.zeros(E, np.int64)
    member_E = np.zeros(E, np.bool_)
    chosen_E = np.zeros(E, np.bool_)
    pick_K = np.zeros(K, np.int64)
    for t in range(T):
        for d in range(1, max_lead + 1):
            for n in range(L - d):
                score_E[:] = 0
                for k in range(K):
                    score_E += A_DLEE[d - 1, n, expert_TLK[t, n, k]]
                for k in range(K):
                    member_E[expert_TLK[t, n + d, k]] = True
                hits_D[d - 1] += _top_k_hits(score_E, freq_LE[n + d], member_E, chosen_E, pick_K)
                predictions_D[d - 1] += 1
                for k in range(K):
                    member_E[expert_TLK[t, n + d, k]] = False
        # the online counts take in token t
        for d in range(1, max_lead + 1):
            for n in range(L - d):
                for a in range(K):
                    i = expert_TLK[t, n, a]
                    for b in range(K):
                        A_DLEE[d - 1, n, i, expert_TLK[t, n + d, b]] += 1
        for n in range(L):
            for k in range(K):
                freq_LE[n, expert_TLK[t, n, k]] += 1
    return hits_D, predictions_D


def lead_table(tt: TokenTrace, max_lead: int, layer_us: float | None) -> tuple[pa.Table, dict]:
    """Recall of inter-layer prefetch with a lead of d = 1..max_lead layers (module docstring). Rows:
    trace, lead_layers (d), recall (None when no layer pair is d apart), tokens (tokens evaluated; each
    gives L - d predictions), lead_us (d x layer_us; None without layer_us). Summary: recall_lead_<d>
    for each d and layer_us."""
    if isinstance(max_lead, bool) or not isinstance(max_lead, (int, np.integer)) or max_lead < 1:
        raise MoecacheError(f"lead_table: max_lead={max_lead!r} must be a positive integer")
    if layer_us is not None and not layer_us >= 0:
        raise MoecacheError(f"lead_table: layer_us={layer_us!r} must be non-negative or None")
    max_lead = int(max_lead)
    K, L = tt.top_k, tt.num_layers
    hits_D, predictions_D = _lead_hits(
        np.ascontiguousarray(tt.expert_TLK, dtype=np.int64), max_lead, tt.num_experts
    )
    lead_D = np.arange(1, max_lead + 1, dtype=np.int64)
    recall = [
        float(hits_D[d] / (K * predictions_D[d])) if predictions_D[d] else None for d in range(max_lead)
    ]
    table = pa.table(
        {
            "trace": [tt.name] * max_lead,
            "lead_layers": lead_D,
            "recall": recall,
            "tokens": [tt.num_tokens if d < L else 0 for d in lead_D.tolist()],
            "lead_us": [None if layer_us is None else float(d * layer_us) for d in lead_D.tolist()],
        },
        schema=LEAD_SCHEMA,
    )
    summary = {f"recall_lead_{d}": recall[d - 1] for d in lead_D.tolist()}
    summary["layer_us"] = None if layer_us is None else float(layer_us)
    return table, summary


# ---------------------------------------------------------------------------------- token signal


def _dense_codes(values_N: np.ndarray) -> tuple[np.ndarray, int]:
    """(codes_N in 0..U-1, U): the values renumbered by np.unique (sparse ids -> dense codes)."""
    uniques, codes_N = np.unique(values_N, return_inverse=True)
    return codes_N.astype(np.int64).reshape(-1), len(uniques)


def mi_bits(x_N: np.ndarray, y_N: np.ndarray) -> float | None:
    """Plug-in mutual information (bits) of the samples (x_N[s], y_N[s]) (non-negative integers of any
    range, renumbered by np.unique); None without samples. The generic estimator: `token_signal_table`
    gets the same numbers from `_lens_information`, which never expands the K * K triples."""
    N = len(x_N)
    if N == 0:
        return None
    x, X = _dense_codes(x_N)
    y, Y = _dense_codes(y_N)
    xy, _ = _dense_codes(x * Y + y)
    c_xy, c_x, c_y = np.bincount(xy), np.bincount(x, minlength=X), np.bincount(y, minlength=Y)
    # sum over distinct (x, y) of p(x, y) log p(x, y) / (p(x) p(y)) = the mean of the log over samples
    value = np.log2(c_xy[xy] * float(N) / (c_x[x].astype(np.float64) * c_y[y])).mean()
    return max(0.0, float(value))


def cmi_bits(x_N: np.ndarray, y_N: np.ndarray, z_N: np.ndarray) -> float | None:
    """Plug-in conditional mutual information I(x; y | z) (bits) of the samples (x, y, z) (non-negative
    integers of any range); None without samples."""
    if len(x_N) == 0:
        return None
    x, X = _dense_codes(x_N)
    y, Y = _dense_codes(y_N)
    z, Z = _dense_codes(z_N)
    xyz, _ = _dense_codes((z * X + x) * Y + y)
    zx, _ = _dense_codes(z * X + x)
    zy, _ = _dense_codes(z * Y + y)
    c_xyz, c_zx, c_zy, c_z = np.bincount(xyz), np.bincount(zx), np.bincount(zy), np.bincount(z, minlength=Z)
    value = np.log2(c_xyz[xyz] * c_z[z].astype(np.float64) / (c_zx[zx].astype(np.float64) * c_zy[zy])).mean()
    return max(0.0, float(value))


@nb.njit(cache=True, nogil=True)
def _lens_information(x_N, order_N, from_NK, to_NK, num_experts):
    """(mi, cmi) in bits: the plug-in I(x; j) over the pairs (x_N[s], j in to_NK[s]) and I(x; j | i)
    over the triples (i in from_NK[s], x_N[s], j in to_NK[s]), s over the N samples; order_N sorts x_N.
    The joint counts are taken one token group at a time (dense [E] and [E, E] scratch), so neither
    a [tokens, E] nor an [E, tokens, E] table is ever built."""
    N, K = to_NK.shape
    E = num_experts
    c_j = np.zeros(E, np.float64)  # pairs with expert j (at n)
    c_i = np.zeros(E, np.float64)  # triples with i (at n-1)
    c_ij = np.zeros((E, E), np.float64)  # triples with (i, j)
    for s in range(N):
        for b in range(K):
            c_j[to_NK[s, b]] += 1.0
        for a in range(K):
            i = from_NK[s, a]
            c_i[i] += K
            for b in range(K):
                c_ij[i, to_NK[s, b]] += 1.0
    pairs, triples = float(N * K), float(N * K * K)
    g_j = np.zeros(E, np.float64)  # the group's pair counts (x, j)
    g_i = np.zeros(E, np.float64)  # the group's triple counts (i, x)
    g_ij = np.zeros((E, E), np.float64)  # the group's triple counts (i, x, j)
    mi = 0.0
    cmi = 0.0
    start = 0
    while start < N:
        x = x_N[order_N[start]]
        end = start
        while end < N and x_N[order_N[end]] == x:
            end += 1
        for r in range(start, end):
            s = order_N[r]
            for b in range(K):
                g_j[to_NK[s, b]] += 1.0
            for a in range(K):
                i = from_NK[s, a]
                g_i[i] += K
                for b in range(K):
                    g_ij[i, to_NK[s, b]] += 1.0
        c_x = float((end - start) * K)  # pairs with token x
        for r in range(start, end):  # visit the group's cells once each, then clear them
            s = order_N[r]
            for b in range(K):
                j = to_NK[s, b]
                c = g_j[j]
                if c > 0:
                    mi += c * np.log2(c * pairs / (c_x * c_j[j]))
                    g_j[j] = 0.0
            for a in range(K):
                i = from_NK[s, a]
                for b in range(K):
                    j = to_NK[s, b]
                    c = g_ij[i, j]
                    if c > 0:
                        cmi += c * np.log2(c * c_i[i] / (g_i[i] * c_ij[i, j]))
                        g_ij[i, j] = 0.0
        for r in range(start, end):
            for a in range(K):
                g_i[from_NK[order_N[r], a]] = 0.0
        start = end
    return max(0.0, mi / pairs), max(0.0, cmi / triples)


def _layer_information(tt: TokenTrace, layer: int, t_N: np.ndarray, rng) -> list[float | None]:
    """[mi, mi_shuffled, cmi, cmi_shuffled] of `layer` over the sampled tokens t_N."""
    x_N, _ = _dense_codes(tt.lens_TL[t_N, layer])
    shuffled_N = x_N[rng.permutation(len(x_N))]
    to_NK = np.ascontiguousarray(tt.expert_TLK[t_N, layer], dtype=np.int64)
    from_NK = np.ascontiguousarray(tt.expert_TLK[t_N, layer - 1], dtype=np.int64)
    out = {}
    for name, lens_N in (("real", x_N), ("shuffled", shuffled_N)):
        order_N = np.argsort(lens_N, kind="stable")
        out[name] = _lens_information(lens_N, order_N, from_NK, to_NK, tt.num_experts)
    return [out["real"][0], out["shuffled"][0], out["real"][1], out["shuffled"][1]]


@nb.njit(cache=True, nogil=True)
def _token_gain_hits(expert_TLK, key_TL, num_keys, num_experts):
    """(hits_L2, samples_L): per layer n >= 1, over the tokens with key_TL[t, n] >= 0 (the sampled
    ones; the key numbers the (layer, lens token) pair), the experts of S(t, n) that the "layer"
    (column 0) and "layer+token" (column 1) predictions contain, and the number of those tokens."""
    T, L, K = expert_TLK.shape
    E = num_experts
    A_LEE = np.zeros((L, E, E), np.int64)
    B_PE = np.zeros((num_keys, E), np.int32)
    freq_LE = np.zeros((L, E), np.int64)
    hits_L2 = np.zeros((L, 2), np.int64)
    samples_L = np.zeros(L, np.int64)
    layer_E = np.zeros(E, np.float64)
    score_E = np.zeros(E, np.float64)
    member_E = np.zeros(E, np.bool_)
    chosen_E = np.zeros(E, np.bool_)
    pick_K = np.zeros(K, np.int64)
    for t in range(T):
        for n in range(1, L):
            key = key_TL[t, n]
            if key < 0:
                continue
            samples_L[n] += 1
            for k in range(K):
                member_E[expert_TLK[t, n, k]] = True
            layer_E[:] = 0.0
            for k in range(K):
                layer_E += A_LEE[n, expert_TLK[t, n - 1, k]]
            hits_L2[n, 0] += _top_k_hits(layer_E, freq_LE[n], member_E, chosen_E, pick_K)
            total = layer_E.sum()
            for j in range(E):
                score_E[j] = layer_E[j] / total if total > 0 else 0.0
            total = 0.0
            for j in range(E):
                total += B_PE[key, j]
            if total > 0:
                for j in range(E):
                    score_E[j] += B_PE[key, j] / total
            hits_L2[n, 1] += _top_k_hits(score_E, freq_LE[n], member_E, chosen_E, pick_K)
            for k in range(K):
                member_E[expert_TLK[t, n, k]] = False
        # the online counts take in token t
        for n in range(L):
            for b in range(K):
                j = expert_TLK[t, n, b]
                freq_LE[n, j] += 1
                if n >= 1:
                    for a in range(K):
                        A_LEE[n, expert_TLK[t, n - 1, a], j] += 1
                    if key_TL[t, n] >= 0:
                        B_PE[key_TL[t, n], j] += 1
    return hits_L2, samples_L


def token_signal_table(tt: TokenTrace, seed: int = 0) -> tuple[pa.Table, dict]:
    """Per MoE layer n >= 1 over the tokens with a lens token at n (module docstring): trace, layer,
    samples, mi_bits, mi_shuffled_bits, cmi_bits, cmi_shuffled_bits, recall_layer, recall_layer_token
    (None for a layer without samples). The shuffles use np.random.default_rng(seed), one permutation
    per layer in layer order. Summary: lens_<column>_mean over the layers with samples for every statistic,
    `token_gain` = lens_recall_layer_token_mean - lens_recall_layer_mean and `lens_samples` (sampled token-layer rows
    at layers >= 1); every value None, and no rows, when the trace has no lens token."""
    L, K = tt.num_layers, tt.top_k
    lens_TL = np.asarray(tt.lens_TL, np.int64)
    sampled_TL = lens_TL >= 0
    sampled_TL[:, 0] = False  # layer 0 has no previous layer to condition on
    if L < 2 or not sampled_TL.any():
        summary = {f"lens_{k}_mean": None for k in TOKEN_SIGNAL_KEYS}
        return TOKEN_SIGNAL_SCHEMA.empty_table(), {**summary, "token_gain": None, "lens_samples": 0}

    pair_key = np.where(sampled_TL, np.arange(L, dtype=np.int64)[None, :] * (lens_TL.max() + 1) + lens_TL, -1)
    key_TL = np.full(pair_key.shape, -1, np.int64)
    codes, num_keys = _dense_codes(pair_key[sampled_TL])
    key_TL[sampled_TL] = codes
    hits_L2, samples_L = _token_gain_hits(
        np.ascontiguousarray(tt.expert_TLK, dtype=np.int64), key_TL, num_keys, tt.num_experts
    )
    rng = np.random.default_rng(seed)
    rows = {name: [] for name in TOKEN_SIGNAL_SCHEMA.names}
    for layer in range(1, L):
        t_N = np.flatnonzero(sampled_TL[:, layer])
        n = int(samples_L[layer])
        information = _layer_information(tt, layer, t_N, rng) if len(t_N) else [None] * 4
        recall = [float(hits_L2[layer, c] / (K * n)) if n else None for c in range(2)]
        values = [*information, *recall]
        rows["trace"].append(tt.name)
        rows["layer"].append(layer)
        rows["samples"].append(n)
        for key, value in zip(TOKEN_SIGNAL_KEYS, values, strict=True):
            rows[key].append(value)

    def mean(values):
        defined = [v for v in values if v is not None]
        return float(np.mean(defined)) if defined else None

    summary = {f"lens_{k}_mean": mean(rows[k]) for k in TOKEN_SIGNAL_KEYS}
    summary["token_gain"] = summary["lens_recall_layer_token_mean"] - summary["lens_recall_layer_mean"]
    summary["lens_samples"] = int(samples_L.sum())
    return pa.table(rows, schema=TOKEN_SIGNAL_SCHEMA), summary
