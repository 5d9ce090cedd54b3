"""Hand-built TokenTraces for the analysis tests."""

from __future__ import annotations

import numpy as np

from moecache.analysis.tokens import TokenTrace


def token_trace(
    expert_TLK, request_T, num_experts: int, weight_TLK=None, name: str = "t", lens_TL=None
) -> TokenTrace:
    """A TokenTrace of expert ids [T, L, K] and request indices [T] (requests contiguous, in order);
    weight_TLK None: no router weights (NaN); lens_TL: logit-lens tokens [T, L] (-1: none; None: no
    lens at all)."""
    expert_TLK = np.asarray(expert_TLK, np.int16)
    T, L, K = expert_TLK.shape
    request_T = np.asarray(request_T, np.int32)
    n_requests = int(request_T.max()) + 1
    position_T = np.concatenate([np.arange(np.sum(request_T == r)) for r in range(n_requests)])
    weights = np.full((T, L, K), np.nan) if weight_TLK is None else np.asarray(weight_TLK).reshape(T, L, K)
    return TokenTrace(
        num_layers=L,
        num_experts=num_experts,
        top_k=K,
        expert_bytes=1,
        request_ids=tuple(f"r{r}" for r in range(n_requests)),
        expert_TLK=expert_TLK,
        weight_TLK=weights.astype(np.float32),
        request_T=request_T,
        position_T=position_T.astype(np.int32),
        decode_T=np.ones(T, bool),
        name=name,
        lens_TL=None if lens_TL is None else np.asarray(lens_TL, np.int32).reshape(T, L),
    )


def from_requests(requests, num_experts: int, weights=None) -> TokenTrace:
    """requests: [(request_id, tokens)], a token = one expert list per layer (router order); weights:
    one weight per selection in the same nesting (None: no router weights)."""
    tokens = [tok for _, toks in requests for tok in toks]
    request_T = [i for i, (_, toks) in enumerate(requests) for _ in toks]
    tt = token_trace(tokens, request_T, num_experts, weights)
    return TokenTrace(**{**tt.__dict__, "request_ids": tuple(r for r, _ in requests)})
