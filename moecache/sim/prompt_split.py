"""Replay a teacher-forced trace as prompt + generation: each request's first tokens as ONE prefill step.

The DeepSeek-V2-Lite ESFT traces (shared/data/traces/deepseek-v2-lite-esft) are whole sequences forced
through the model with no generated token, imported one token per step. `prompt_as_prefill(trace, f)`
merges each request's first ceil(f x its tokens) forward steps into one prefill forward step (per
layer: the distinct experts of those tokens in order of first selection, their uses summed: exactly
the layer step a prefill of those tokens routes) and keeps the remaining tokens as one-token decode
steps. It is an approximation of a served request: the "generated" tokens are the sequence's own text,
not the model's continuation, and the prompt is the start of a training sample, not a user's prompt.

Legend: V layer steps, A accesses, G global keys, L layers.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.trace_arrays import DECODE, PREFILL, TraceArrays, _clock


@nb.njit(cache=True, nogil=True)
def _merge(
    first_R, tokens_R, prompt_R, L, start_V, key_A, uses_A, num_keys, out_start_V, out_key_A, out_uses_A
):
    """Fill the output accesses; returns (layer steps, accesses) written. Request r's layer steps are
    first_R[r] ..., tokens_R[r] forward steps of L layer steps each, the first prompt_R[r] merged."""
    stamp_G = np.full(num_keys, -1, np.int64)
    at_G = np.zeros(num_keys, np.int64)
    s = 0
    a = 0
    for r in range(first_R.shape[0]):
        v0 = first_R[r]
        p = prompt_R[r]
        if p > 0:
            for layer in range(L):
                out_start_V[s] = a
                for f in range(p):
                    v = v0 + f * L + layer
                    for i in range(start_V[v], start_V[v + 1]):
                        k = key_A[i]
                        if stamp_G[k] != s:
                            stamp_G[k] = s
                            at_G[k] = a
                            out_key_A[a] = k
                            out_uses_A[a] = uses_A[i]
                            a += 1
                        else:
                            out_uses_A[at_G[k]] += uses_A[i]
                s += 1
        for f in range(p, tokens_R[r]):
            for layer in range(L):
                v = v0 + f * L + layer
                out_start_V[s] = a
                for i in range(start_V[v], start_V[v + 1]):
                    out_key_A[a] = key_A[i]
                    out_uses_A[a] = uses_A[i]
                    a += 1
                s += 1
    out_start_V[s] = a
    return s, a


def prompt_as_prefill(trace: TraceArrays, fraction: float) -> TraceArrays:
    """`trace` (one token per forward step, every forward step visiting all layers in order) with each
    request's first ceil(fraction x tokens) tokens as one prefill step (module docstring); fraction 0
    keeps every token a decode step."""
    if not 0 <= fraction < 1:
        raise MoecacheError(f"prompt_as_prefill: fraction={fraction}: must be in [0, 1)")
    L = trace.num_layers
    if trace.num_steps and not (trace.tokens_V == 1).all():
        raise MoecacheError(f"prompt_as_prefill: trace {trace.name} has steps of more than one token")
    num_requests = len(trace.request_ids)
    visits_R = np.bincount(trace.request_V, minlength=num_requests)
    if (visits_R % L).any() or not (trace.layer_V == np.arange(trace.num_steps) % L).all():
        raise MoecacheError(
            f"prompt_as_prefill: trace {trace.name}: a forward step does not visit every layer"
        )
    tokens_R = visits_R // L
    first_R = np.concatenate([[0], np.cumsum(visits_R)[:-1]]).astype(np.int64)
    prompt_R = np.array([math.ceil(fraction * t) for t in tokens_R.tolist()], np.int64)
    steps_R = tokens_R - prompt_R + (prompt_R > 0)
    V = int((steps_R * L).sum())
    out_start_V = np.zeros(V + 1, np.int64)
    out_key_A = np.zeros(trace.num_accesses, np.int32)
    out_uses_A = np.zeros(trace.num_accesses, np.int32)
    s, a = _merge(
        first_R, tokens_R.astype(np.int64), prompt_R, L, trace.start_V, trace.key_A, trace.uses_A,
        trace.num_keys, out_start_V, out_key_A, out_uses_A,
    )  # fmt: skip
    assert s == V
    request_V = np.repeat(np.arange(num_requests, dtype=np.int32), steps_R * L)
    step_V = np.concatenate([np.repeat(np.arange(n, dtype=np.int32), L) for n in steps_R.tolist()])
    prefill_V = np.concatenate(
        [
            np.repeat(np.arange(n) == 0, L) & (p > 0)
            for n, p in zip(steps_R.tolist(), prompt_R.tolist(), strict=True)
        ]
    )
    tokens_V = np.where(prefill_V, np.repeat(prompt_R, steps_R * L), 1).astype(np.int32)
    return TraceArrays(
        num_layers=L,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        expert_bytes=trace.expert_bytes,
        request_ids=trace.request_ids,
        layer_V=np.tile(np.arange(L, dtype=np.int32), V // L),
        request_V=request_V,
        step_V=step_V,
        tokens_V=tokens_V,
        phase_V=np.where(prefill_V, PREFILL, DECODE).astype(np.int8),
        clock_V=_clock(tokens_V, request_V, step_V),
        start_V=out_start_V,
        key_A=out_key_A[:a].copy(),
        uses_A=out_uses_A[:a].copy(),
        name=f"{trace.name}@prompt{fraction:g}",
        workload=trace.workload,
    )
