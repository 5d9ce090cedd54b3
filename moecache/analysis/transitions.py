"""Transitions between expert sets: token to token within a layer, layer to layer within a token, and
how well simple online predictors built on them guess the next expert set.

Legend: T tokens (trace order: request by request, token order within a request), L layers, K top-k,
E experts per layer, P predictors, N token pairs (t, t + lag) of one request.

S_{t,l} is the set of the K experts token t selects at layer l. Token transitions at lag g count,
per layer, the pairs (i in S_{t,l}, j in S_{t+g,l}) for t and t + g in the same request; layer
transitions count the pairs (i in S_{t,l-1}, j in S_{t,l}) of every token (K * K pairs a token).
"""

from __future__ import annotations

import numba as nb
import numpy as np
import pyarrow as pa

from moecache.analysis.schema import BOOL, F64, I64, STR, schema
from moecache.analysis.tokens import TokenTrace

PREDICTORS = ("frequency", "repeat", "lag1", "lag1+lag2", "layer")
LAGS = (1, 2)

TOKEN_TRANSITION_SCHEMA = schema(trace=STR, layer=I64, lag=I64, from_expert=I64, to_expert=I64, count=I64)
LAYER_TRANSITION_SCHEMA = schema(trace=STR, layer=I64, from_expert=I64, to_expert=I64, count=I64)
LAYER_MI_SCHEMA = schema(trace=STR, layer=I64, pairs=I64, mi_bits=F64, mi_shuffled_bits=F64)
PREDICTOR_SCHEMA = schema(trace=STR, layer=I64, predictor=STR, tokens=I64, recall=F64)
RECURRENCE_SCHEMA = schema(
    trace=STR, in_t=BOOL, in_t_minus_1=BOOL, cases=I64, reused_next=I64, probability=F64
)


def _pair_counts(from_NLK: np.ndarray, to_NLK: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E, E]: C[l, i, j] = #{n : i in from[n, l], j in to[n, l]}."""
    N, L, K = from_NLK.shape
    E = num_experts
    layer_L = np.arange(L, dtype=np.int64)[None, :, None, None] * (E * E)
    index = layer_L + from_NLK.astype(np.int64)[:, :, :, None] * E + to_NLK.astype(np.int64)[:, :, None, :]
    return np.bincount(index.reshape(-1), minlength=L * E * E).astype(np.int64).reshape(L, E, E)


def _same_request_ahead(tt: TokenTrace, lag: int) -> np.ndarray:
    """int64: the tokens t whose token t + lag is in the same request, lag tokens later (segment_T:
    no token of the trace left out between them)."""
    T = tt.num_tokens
    if T <= lag:
        return np.zeros(0, np.int64)
    return np.flatnonzero(tt.segment_T[:-lag] == tt.segment_T[lag:]).astype(np.int64)


def token_transitions(tt: TokenTrace, lag: int) -> np.ndarray:
    """int64 [L, E, E]: C[l, i, j] = #{t : i in S_{t,l}, j in S_{t+lag,l}, t and t+lag in one request}."""
    t_N = _same_request_ahead(tt, lag)
    return _pair_counts(tt.expert_TLK[t_N], tt.expert_TLK[t_N + lag], tt.num_experts)


def layer_transitions(tt: TokenTrace) -> np.ndarray:
    """int64 [L, E, E]: A[l, i, j] = #{t : i in S_{t,l-1}, j in S_{t,l}} for l >= 1; A[0] = 0."""
    return _layer_transitions(tt.expert_TLK, tt.expert_TLK, tt.num_experts)


def _layer_transitions(from_TLK: np.ndarray, to_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """A[l] from the layer l-1 sets of from_TLK to the layer l sets of to_TLK (A[0] = 0)."""
    L = from_TLK.shape[1]
    A_LEE = np.zeros((L, num_experts, num_experts), np.int64)
    if L > 1:
        A_LEE[1:] = _pair_counts(from_TLK[:, :-1], to_TLK[:, 1:], num_experts)
    return A_LEE


def _nonzero_columns(C_LEE: np.ndarray) -> dict[str, np.ndarray]:
    layer_N, from_N, to_N = np.nonzero(C_LEE)
    return {
        "layer": layer_N.astype(np.int64),
        "from_expert": from_N.astype(np.int64),
        "to_expert": to_N.astype(np.int64),
        "count": C_LEE[layer_N, from_N, to_N].astype(np.int64),
    }


def token_transition_table(tt: TokenTrace) -> pa.Table:
    """trace, layer, lag (1 | 2), from_expert, to_expert, count: the nonzero token transitions."""
    parts = []
    for lag in LAGS:
        cols = _nonzero_columns(token_transitions(tt, lag))
        n = len(cols["count"])
        parts.append(
            pa.table(
                {
                    "trace": [tt.name] * n,
                    "layer": cols["layer"],
                    "lag": np.full(n, lag, np.int64),
                    "from_expert": cols["from_expert"],
                    "to_expert": cols["to_expert"],
                    "count": cols["count"],
                },
                schema=TOKEN_TRANSITION_SCHEMA,
            )
        )
    return pa.concat_tables(parts)


def layer_transition_table(tt: TokenTrace) -> pa.Table:
    """trace, layer (the "to" layer, >= 1), from_expert, to_expert, count: the nonzero layer transitions."""
    cols = _nonzero_columns(layer_transitions(tt))
    return pa.table({"trace": [tt.name] * len(cols["count"]), **cols}, schema=LAYER_TRANSITION_SCHEMA)


def mutual_information_bits(C_EE: np.ndarray) -> float | None:
    """Plug-in mutual information (bits) of the joint distribution C / C.sum(); None when C is all zeros."""
    total = C_EE.sum()
    if total == 0:
        return None
    P_EE = C_EE / total
    outer_EE = np.outer(P_EE.sum(axis=1), P_EE.sum(axis=0))
    nz = P_EE > 0
    return max(0.0, float((P_EE[nz] * np.log2(P_EE[nz] / outer_EE[nz])).sum()))


def layer_mi_table(tt: TokenTrace, seed: int) -> tuple[pa.Table, dict]:
    """Per layer l >= 1: pairs (sum of A[l]), mi_bits (the plug-in mutual information of the pair
    distribution of A[l]) and mi_shuffled_bits (the same with the layer-l sets taken from the tokens
    permuted by np.random.default_rng(seed).permutation(T), one permutation for the trace: the bias of
    the estimator when the layers are independent). Summary: mi_bits_mean, mi_shuffled_bits_mean."""
    perm_T = np.random.default_rng(seed).permutation(tt.num_tokens)
    A_LEE = layer_transitions(tt)
    shuffled_LEE = _layer_transitions(tt.expert_TLK, tt.expert_TLK[perm_T], tt.num_experts)
    layer_M = np.arange(1, tt.num_layers, dtype=np.int64)
    mi = [mutual_information_bits(A_LEE[layer]) for layer in layer_M]
    shuffled = [mutual_information_bits(shuffled_LEE[layer]) for layer in layer_M]
    table = pa.table(
        {
            "trace": [tt.name] * len(layer_M),
            "layer": layer_M,
            "pairs": A_LEE[1:].sum(axis=(1, 2)).astype(np.int64),
            "mi_bits": mi,
            "mi_shuffled_bits": shuffled,
        },
        schema=LAYER_MI_SCHEMA,
    )

    def mean(values):
        defined = [v for v in values if v is not None]
        return float(np.mean(defined)) if defined else None

    return table, {"mi_bits_mean": mean(mi), "mi_shuffled_bits_mean": mean(shuffled)}


@nb.njit(cache=True, nogil=True)
def _top_k_hits(score_E, freq_E, member_E, chosen_E, pick_K):
    """How many of the top-K experts by score (ties: higher freq, then lower id) are members."""
    K = pick_K.shape[0]
    E = score_E.shape[0]
    hits = 0
    for k in range(K):
        best = -1
        for j in range(E):
            if chosen_E[j]:
                continue
            if (
                best < 0
                or score_E[j] > score_E[best]
                or (score_E[j] == score_E[best] and freq_E[j] > freq_E[best])
            ):
                best = j
        chosen_E[best] = True
        pick_K[k] = best
        if member_E[best]:
            hits += 1
    for k in range(K):
        chosen_E[pick_K[k]] = False
    return hits


@nb.njit(cache=True, nogil=True)
def _predictor_hits(expert_TLK, segment_T, num_experts):
    """(hits_LP, tokens_L): per layer and predictor (PREDICTORS order) the experts of S_{t,l} that the
    prediction contains, summed over the evaluated tokens (those with t-1 and t-2 their neighbours in
    the same request: segment_T),
    and their number. The online counts of token t are added after its prediction at that layer (a
    layer's predictions read only that layer's counts), so every prediction sees tokens < t only."""
    T, L, K = expert_TLK.shape
    E = num_experts
    freq_LE = np.zeros((L, E), np.int64)
    c1_LEE = np.zeros((L, E, E), np.int64)
    c2_LEE = np.zeros((L, E, E), np.int64)
    a_LEE = np.zeros((L, E, E), np.int64)
    hits_LP = np.zeros((L, 5), np.int64)
    tokens_L = np.zeros(L, np.int64)
    score_E = np.zeros(E, np.int64)
    member_E = np.zeros(E, np.bool_)
    chosen_E = np.zeros(E, np.bool_)
    pick_K = np.zeros(K, np.int64)
    for t in range(T):
        has1 = t >= 1 and segment_T[t - 1] == segment_T[t]
        has2 = t >= 2 and segment_T[t - 2] == segment_T[t]  # segments are contiguous: t-1 is in it too
        for layer in range(L):
            freq_E = freq_LE[layer]
            if has2:
                tokens_L[layer] += 1
                for k in range(K):
                    member_E[expert_TLK[t, layer, k]] = True
                # frequency
                hits_LP[layer, 0] += _top_k_hits(freq_E, freq_E, member_E, chosen_E, pick_K)
                # repeat
                for k in range(K):
                    if member_E[expert_TLK[t - 1, layer, k]]:
                        hits_LP[layer, 1] += 1
                # lag1, then lag1+lag2
                score_E[:] = 0
                for k in range(K):
                    score_E += c1_LEE[layer, expert_TLK[t - 1, layer, k]]
                hits_LP[layer, 2] += _top_k_hits(score_E, freq_E, member_E, chosen_E, pick_K)
                for k in range(K):
                    score_E += c2_LEE[layer, expert_TLK[t - 2, layer, k]]
                hits_LP[layer, 3] += _top_k_hits(score_E, freq_E, member_E, chosen_E, pick_K)
                # layer
                if layer >= 1:
                    score_E[:] = 0
                    for k in range(K):
                        score_E += a_LEE[layer, expert_TLK[t, layer - 1, k]]
                    hits_LP[layer, 4] += _top_k_hits(score_E, freq_E, member_E, chosen_E, pick_K)
                for k in range(K):
                    member_E[expert_TLK[t, layer, k]] = False
            # the online counts take in token t
            for b in range(K):
                j = expert_TLK[t, layer, b]
                freq_E[j] += 1
                for a in range(K):
                    if has1:
                        c1_LEE[layer, expert_TLK[t - 1, layer, a], j] += 1
                    if has2:
                        c2_LEE[layer, expert_TLK[t - 2, layer, a], j] += 1
                    if layer >= 1:
                        a_LEE[layer, expert_TLK[t, layer - 1, a], j] += 1
    return hits_LP, tokens_L


def predictor_table(tt: TokenTrace) -> tuple[pa.Table, dict]:
    """Recall of online predictors of S_{t,l} (each predicts K experts; recall = |prediction ∩
    S_{t,l}| / K averaged over the tokens with t-1 and t-2 in the same request; counts only from tokens
    before t, across requests; ties by the cumulative frequency at layer l, then lower expert id):
    frequency (top-K cumulative counts), repeat (S_{t-1,l}), lag1 (top-K of the lag-1 transition counts
    out of S_{t-1,l}), lag1+lag2 (plus the lag-2 counts out of S_{t-2,l}), layer (l >= 1: top-K of the
    layer transition counts out of S_{t,l-1}). Rows: trace, layer, predictor, tokens, recall, plus
    layer = -1 rows (over all layers, weighted by tokens). Summary: recall_<predictor> of the -1 rows."""
    K = tt.top_k
    hits_LP, tokens_L = _predictor_hits(
        np.ascontiguousarray(tt.expert_TLK, dtype=np.int64),
        np.ascontiguousarray(tt.segment_T, dtype=np.int64),
        tt.num_experts,
    )
    rows = {name: [] for name in PREDICTOR_SCHEMA.names}
    summary = {}

    def add(layer, predictor, tokens, hits):
        rows["trace"].append(tt.name)
        rows["layer"].append(layer)
        rows["predictor"].append(predictor)
        rows["tokens"].append(tokens)
        rows["recall"].append(hits / (K * tokens) if tokens else None)

    for layer in range(tt.num_layers):
        for p, predictor in enumerate(PREDICTORS):
            if predictor != "layer" or layer >= 1:
                add(layer, predictor, int(tokens_L[layer]), int(hits_LP[layer, p]))
    for p, predictor in enumerate(PREDICTORS):
        first = 1 if predictor == "layer" else 0
        tokens, hits = int(tokens_L[first:].sum()), int(hits_LP[first:, p].sum())
        add(-1, predictor, tokens, hits)
        summary[f"recall_{predictor}"] = rows["recall"][-1]
    return pa.table(rows, schema=PREDICTOR_SCHEMA), summary


def recurrence_table(tt: TokenTrace) -> pa.Table:
    """Second-order self-recurrence pooled over layers and experts: over every (t, l, e) with t-1 and
    t+1 in the request of t, by (in_t = e in S_{t,l}, in_t_minus_1 = e in S_{t-1,l}): cases, reused_next
    (e in S_{t+1,l}) and probability (reused_next / cases; None without cases)."""
    T, E = tt.num_tokens, tt.num_experts
    t_N = np.zeros(0, np.int64)
    if T >= 3:
        t_N = 1 + np.flatnonzero(tt.segment_T[:-2] == tt.segment_T[2:])
    cases_C = np.zeros(4, np.int64)  # code = 2 * in_t + in_t_minus_1
    reused_C = np.zeros(4, np.int64)
    member_TE = np.zeros((T, E), bool)
    rows_T = np.arange(T)[:, None]
    for layer in range(tt.num_layers):
        member_TE[:] = False
        member_TE[rows_T, tt.expert_TLK[:, layer, :]] = True
        code_NE = 2 * member_TE[t_N].astype(np.int64) + member_TE[t_N - 1]
        cases_C += np.bincount(code_NE.reshape(-1), minlength=4)
        reused_C += np.bincount(code_NE[member_TE[t_N + 1]], minlength=4)
    order = [(True, True), (True, False), (False, True), (False, False)]
    codes = [2 * a + b for a, b in order]
    return pa.table(
        {
            "trace": [tt.name] * 4,
            "in_t": [a for a, _ in order],
            "in_t_minus_1": [b for _, b in order],
            "cases": [int(cases_C[c]) for c in codes],
            "reused_next": [int(reused_C[c]) for c in codes],
            "probability": [float(reused_C[c] / cases_C[c]) if cases_C[c] else None for c in codes],
        },
        schema=RECURRENCE_SCHEMA,
    )
