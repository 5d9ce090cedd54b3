"""A canonical trace as dense per-token arrays, the input of the sequence analyses.

Legend: T tokens (every routed token of the trace, request by request, in token order), L MoE layers,
K experts chosen per token and layer (top-k), E experts per layer.

`lens_TL` holds the trace's logit-lens tokens (`lens_token`, docs/trace-format.md): -1 where a row has
none (not sampled, or a trace without the column).

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

    def __post_init__(self):
        T, L = self.expert_TLK.shape[:2]
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
        counts = np.bincount(self.request_T, minlength=self.num_requests)
        bounds = np.zeros(self.num_requests + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        return bounds


def from_table(
    table: pa.Table, meta: TraceMeta, name: str = "trace", workload: str = "unknown"
) -> TokenTrace:
    """The TokenTrace of a validated canonical trace table. Every token must have one row per MoE
    layer and exactly top_k experts per row (what a model's router produces); otherwise the error
    names the trace and the first offending request/token."""
    if table.num_rows == 0:
        raise MoecacheError(f"trace {name}: no rows")
    L, K = meta.num_layers, meta.top_k
    requests = pc.dictionary_encode(table["request_id"]).combine_chunks()
    codes = requests.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    values = requests.dictionary.to_pylist()
    # requests numbered in order of first appearance
    first_row = np.full(len(values), table.num_rows, np.int64)
    np.minimum.at(first_row, codes, np.arange(table.num_rows))
    rank = np.empty(len(values), np.int64)
    rank[np.argsort(first_row, kind="stable")] = np.arange(len(values))
    request_R = rank[codes]
    token_R = table["token_index"].to_numpy().astype(np.int64)
    layer_R = table["layer_id"].to_numpy().astype(np.int64)
    order = np.lexsort((layer_R, token_R, request_R))
    request_R, token_R, layer_R = request_R[order], token_R[order], layer_R[order]
    experts = table["expert_ids"].combine_chunks()
    lengths = np.diff(experts.offsets.to_numpy())
    bad = np.flatnonzero(lengths[order] != K)
    if bad.size or table.num_rows % L:
        r = int(order[bad[0]]) if bad.size else 0
        raise MoecacheError(
            f"trace {name}: every row needs top_k={K} experts and every token {L} layers; "
            f"row {r} (request {values[codes[r]]!r}, token {int(table['token_index'][r].as_py())}) "
            f"has {int(lengths[r])} experts / the trace has {table.num_rows} rows"
        )
    T = table.num_rows // L
    layer_TL = layer_R.reshape(T, L)
    token_TL = token_R.reshape(T, L)
    request_TL = request_R.reshape(T, L)
    ok = (
        (layer_TL == np.arange(L)).all(axis=1)
        & (token_TL == token_TL[:, :1]).all(axis=1)
        & (request_TL == request_TL[:, :1]).all(axis=1)
    )
    if not ok.all():
        t = int(np.flatnonzero(~ok)[0])
        raise MoecacheError(
            f"trace {name}: request {values[int(np.flatnonzero(rank == request_TL[t, 0])[0])]!r} token "
            f"{int(token_TL[t, 0])} does not have exactly one row for each of the {L} MoE layers"
        )
    flat = experts.values.to_numpy().astype(np.int16).reshape(-1, K)
    if "router_weights" in table.column_names:
        weights = table["router_weights"].combine_chunks().values.to_numpy().astype(np.float32).reshape(-1, K)
    else:
        weights = np.full(flat.shape, np.nan, np.float32)
    phase = table["phase"].to_numpy(zero_copy_only=False)[order].reshape(T, L)[:, 0]
    lens_TL = None
    if LENS_COLUMN in table.column_names and table[LENS_COLUMN].null_count < table.num_rows:
        lens = table[LENS_COLUMN].combine_chunks().cast(pa.int64()).fill_null(-1)
        lens_TL = lens.to_numpy()[order].astype(np.int32).reshape(T, L)
    return TokenTrace(
        num_layers=L,
        num_experts=meta.num_experts,
        top_k=K,
        expert_bytes=meta.expert_bytes,
        request_ids=tuple(values[int(c)] for c in np.argsort(rank)),
        expert_TLK=flat[order].reshape(T, L, K),
        weight_TLK=weights[order].reshape(T, L, K),
        request_T=request_TL[:, 0].astype(np.int32),
        position_T=token_TL[:, 0].astype(np.int32),
        decode_T=np.asarray(phase == "decode"),
        name=name,
        workload=workload,
        lens_TL=lens_TL,
    )


def load_token_trace(path: str | Path, name: str | None = None, workload: str = "unknown") -> TokenTrace:
    cols = ["request_id", "step_index", "token_index", "layer_id", "phase", "expert_ids"]
    try:
        present = set(pq.read_schema(path).names)
    except (pa.ArrowInvalid, OSError):
        present = set()  # read_trace names the problem
    cols += [c for c in ("router_weights", LENS_COLUMN) if c in present]  # optional columns
    table, meta = read_trace(path, columns=cols)
    return from_table(table, meta, name=name or Path(path).stem, workload=workload)
