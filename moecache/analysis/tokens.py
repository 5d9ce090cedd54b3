"""A canonical trace as dense per-token arrays, the input of the sequence analyses.

Legend: T tokens (every routed token of the trace, request by request, in token order), L MoE layers,
K experts chosen per token and layer (top-k), E experts per layer.

`lens_TL` holds the trace's logit-lens tokens (`lens_token`, docs/trace-format.md): -1 where a row has
none (not sampled, or a trace without the column).

Only complete tokens are here (one row for each MoE layer, top_k experts in each; `from_table`): a
valid trace may lack some layers of a few tokens, and token-level statistics need every layer of a
token. `tokens_left_out` counts the others; `segment_T` marks which kept tokens are neighbours (the
statistics over consecutive tokens, t and t + lag, use it instead of the request).

The simulator's TraceArrays keep one access per distinct expert of a layer step; the analyses need the
token-level routing (which token chose what, with which router weight), so they read the trace again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moecache.errors import MoecacheError
from moecache.trace.schema import LENS_COLUMN, TraceMeta, read_trace


@dataclass(frozen=True)
class TokenTrace:
    num_layers: int  # L
    num_experts: int  # E
    top_k: int  # K
    expert_bytes: int
    request_ids: tuple[str, ...]  # in order of first appearance
    expert_TLK: np.ndarray  # int16, expert ids in router order
    weight_TLK: np.ndarray  # float32, their router weights
    request_T: np.ndarray  # int32, index into request_ids
    position_T: np.ndarray  # int32, token_index within its request
    decode_T: np.ndarray  # bool, generated (decode) rather than prompt (prefill) token
    name: str = "trace"
    workload: str = "unknown"
    lens_TL: np.ndarray | None = None  # int32, logit-lens token id; -1: none. None given: all -1
    # int32: tokens t and t + 1 are neighbours (consecutive in one request, no token left out between
    # them) iff segment_T[t] == segment_T[t + 1]. None given: request_T (every token kept)
    segment_T: np.ndarray | None = None
    tokens_left_out: int = 0  # the trace's incomplete tokens (see from_table), not in these arrays
    requests_left_out: int = 0  # requests without a complete token

    def __post_init__(self):
        T, L = self.expert_TLK.shape[:2]
        if self.segment_T is None:
            object.__setattr__(self, "segment_T", np.asarray(self.request_T, np.int32))
        elif np.shape(self.segment_T) != (T,):
            raise MoecacheError(
                f"trace {self.name}: segment_T has shape {np.shape(self.segment_T)}, expected {(T,)}"
            )
        if self.lens_TL is None:
            object.__setattr__(self, "lens_TL", np.full((T, L), -1, np.int32))
        else:
            lens_TL = np.asarray(self.lens_TL, np.int32)
            if lens_TL.shape != (T, L):
                raise MoecacheError(
                    f"trace {self.name}: lens_TL has shape {lens_TL.shape}, expected {(T, L)}"
                )
            object.__setattr__(self, "lens_TL", lens_TL)

    @property
    def has_lens(self) -> bool:
        """Whether any row has a logit-lens token."""
        return bool((self.lens_TL >= 0).any())

    @property
    def num_tokens(self) -> int:
        return int(self.expert_TLK.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def request_bounds(self) -> np.ndarray:
        """int64 [R+1]: request r is tokens bounds[r]:bounds[r+1]."""
        return _bounds(self.request_T, self.num_requests)

    def segment_bounds(self) -> np.ndarray:
        """int64 [G+1]: segment g (a run of neighbouring tokens, see segment_T) is tokens
        bounds[g]:bounds[g+1]."""
        return _bounds(self.segment_T, int(self.segment_T.max()) + 1 if self.num_tokens else 0)


def _bounds(group_T: np.ndarray, groups: int) -> np.ndarray:
    """int64 [groups+1]: the token range of each group of a contiguous, ascending numbering."""
    bounds = np.zeros(groups + 1, np.int64)
    np.cumsum(np.bincount(group_T, minlength=groups), out=bounds[1:])
    return bounds


def from_table(
    table: pa.Table, meta: TraceMeta, name: str = "trace", workload: str = "unknown"
) -> TokenTrace:
    """The TokenTrace of a validated canonical trace table, made of its complete tokens: those with
    exactly one row for each of the L MoE layers, each row with exactly top_k experts (what a model's
    router produces). A valid trace may hold others (a real export that lacks a few layers of some
    tokens, a row with fewer experts): they are left out and counted in `tokens_left_out`, and
    `segment_T` keeps the tokens on either side of one from counting as neighbours."""
    if table.num_rows == 0:
        raise MoecacheError(f"trace {name}: no rows")
    L, K = meta.num_layers, meta.top_k
    values, request_R = _requests_by_first_row(table["request_id"])
    token_R = table["token_index"].to_numpy().astype(np.int64)
    layer_R = table["layer_id"].to_numpy().astype(np.int64)
    order = np.lexsort((layer_R, token_R, request_R))  # rows by request, token, layer
    request_O, token_O, layer_O = request_R[order], token_R[order], layer_R[order]
    experts = table["expert_ids"].combine_chunks()
    offsets_R = experts.offsets.to_numpy().astype(np.int64)
    length_O = np.diff(offsets_R)[order]
    new_token_O = np.ones(order.size, bool)
    new_token_O[1:] = (request_O[1:] != request_O[:-1]) | (token_O[1:] != token_O[:-1])
    token_of_O = np.cumsum(new_token_O) - 1  # every row's token, 0 .. all tokens - 1
    first_O = np.flatnonzero(new_token_O)  # each token's first row
    # a complete token: L rows, no layer twice (so layers 0 .. L-1, ascending), K experts in each row
    irregular_O = length_O != K
    irregular_O[1:] |= ~new_token_O[1:] & (layer_O[1:] == layer_O[:-1])
    complete_A = (np.diff(np.append(first_O, order.size)) == L) & ~np.logical_or.reduceat(
        irregular_O, first_O
    )  # A: every token of the trace, complete or not
    keep_O = complete_A[token_of_O]
    rows = order[keep_O]  # the kept rows, token by token, layers ascending
    T = rows.size // L
    if T == 0:
        raise MoecacheError(
            f"trace {name}: no complete token (one row for each of the {L} MoE layers, {K} experts in "
            f"each); {complete_A.size} token(s) all left out"
        )
    request_A = request_O[first_O]
    segment_A = np.cumsum(np.concatenate([[True], (request_A[1:] != request_A[:-1]) | ~complete_A[:-1]]))
    kept_requests, request_T = np.unique(request_A[complete_A], return_inverse=True)
    experts_TLK = experts.values.to_numpy()[offsets_R[rows][:, None] + np.arange(K)].reshape(T, L, K)
    if "router_weights" in table.column_names:
        weights = table["router_weights"].combine_chunks()
        w_offsets = weights.offsets.to_numpy().astype(np.int64)
        weight_TLK = weights.values.to_numpy(zero_copy_only=False)[w_offsets[rows][:, None] + np.arange(K)]
    else:
        weight_TLK = np.full(rows.size * K, np.nan, np.float32)
    phase_T = table["phase"].to_numpy(zero_copy_only=False)[rows[::L]]
    lens_TL = None
    if LENS_COLUMN in table.column_names and table[LENS_COLUMN].null_count < table.num_rows:
        lens = table[LENS_COLUMN].combine_chunks().cast(pa.int64()).fill_null(-1)
        lens_TL = lens.to_numpy()[rows].astype(np.int32).reshape(T, L)
    return TokenTrace(
        num_layers=L,
        num_experts=meta.num_experts,
        top_k=K,
        expert_bytes=meta.expert_bytes,
        request_ids=tuple(values[int(r)] for r in kept_requests),
        expert_TLK=experts_TLK.astype(np.int16),
        weight_TLK=np.asarray(weight_TLK, np.float32).reshape(T, L, K),
        request_T=request_T.astype(np.int32),
        position_T=token_O[first_O][complete_A].astype(np.int32),
        decode_T=np.asarray(phase_T == "decode"),
        name=name,
        workload=workload,
        lens_TL=lens_TL,
        segment_T=np.unique(segment_A[complete_A], return_inverse=True)[1].astype(np.int32),
        tokens_left_out=int(complete_A.size - T),
        requests_left_out=int(np.unique(request_A).size - kept_requests.size),
    )


def _requests_by_first_row(column: pa.ChunkedArray) -> tuple[list, np.ndarray]:
    """(request ids in order of first appearance, int64 [N] each row's index into them)."""
    requests = pc.dictionary_encode(column).combine_chunks()
    codes = requests.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    values = requests.dictionary.to_pylist()
    first_row = np.full(len(values), codes.size, np.int64)
    np.minimum.at(first_row, codes, np.arange(codes.size))
    by_first = np.argsort(first_row, kind="stable")
    rank = np.empty(len(values), np.int64)
    rank[by_first] = np.arange(len(values))
    return [values[int(c)] for c in by_first], rank[codes]


def load_token_trace(path: str | Path, name: str | None = None, workload: str = "unknown") -> TokenTrace:
    cols = ["request_id", "step_index", "token_index", "layer_id", "phase", "expert_ids"]
    try:
        present = set(pq.read_schema(path).names)
    except (pa.ArrowInvalid, OSError):
        present = set()  # read_trace names the problem
    cols += [c for c in ("router_weights", LENS_COLUMN) if c in present]  # optional columns
    table, meta = read_trace(path, columns=cols)
    return from_table(table, meta, name=name or Path(path).stem, workload=workload)
