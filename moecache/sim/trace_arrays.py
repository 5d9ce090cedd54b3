"""A canonical trace as flat integer arrays, the simulator's only input.

Legend: S layer steps (one per request, forward step and MoE layer), A accesses (one per distinct
expert of a layer step), K expert keys (key = layer_id * num_experts + expert_id).

Access order is (request, step, layer, then router order): within a layer step the distinct experts
appear in the order their first selection appears (token by token, each token in router order).
`uses_A` counts the step's tokens that selected the expert (1 for every access of a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moecache.errors import MoecacheError
from moecache.trace.schema import TraceMeta, read_trace

PREFILL, DECODE = 0, 1


@dataclass(frozen=True)
class TraceArrays:
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    request_ids: tuple[str, ...]
    # per layer step
    layer_S: np.ndarray  # int32
    request_S: np.ndarray  # int32, index into request_ids
    step_S: np.ndarray  # int32, forward-step index within its request
    tokens_S: np.ndarray  # int32, tokens routed by the step
    phase_S: np.ndarray  # int8, PREFILL or DECODE
    clock_S: np.ndarray  # int64, tokens of the whole trace processed before this step's forward step
    start_S: np.ndarray  # int64 [S+1], offsets into the access arrays
    # per access
    key_A: np.ndarray  # int32
    uses_A: np.ndarray  # int32
    name: str = "trace"
    workload: str = "unknown"

    @property
    def num_keys(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_steps(self) -> int:
        return int(self.layer_S.shape[0])

    @property
    def num_accesses(self) -> int:
        return int(self.key_A.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens routed through the model (each counted once, not once per layer)."""
        first = self.layer_S == self.layer_S.min() if self.num_steps else self.layer_S
        return int(self.tokens_S[first].sum()) if self.num_steps else 0

    def subset_requests(self, requests: np.ndarray) -> TraceArrays:
        """The trace restricted to the given request indices (in their original order)."""
        keep_S = np.isin(self.request_S, requests)
        idx_S = np.flatnonzero(keep_S)
        counts = np.diff(self.start_S)[idx_S]
        starts = self.start_S[idx_S]
        take_A = (
            np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
            if len(idx_S)
            else np.zeros(0, np.int64)
        )
        new_start = np.zeros(len(idx_S) + 1, np.int64)
        np.cumsum(counts, out=new_start[1:])
        kept = sorted(set(self.request_S[idx_S].tolist()))
        remap = {old: new for new, old in enumerate(kept)}
        tokens = self.tokens_S[idx_S]
        return TraceArrays(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            expert_bytes=self.expert_bytes,
            request_ids=tuple(self.request_ids[r] for r in kept),
            layer_S=self.layer_S[idx_S],
            request_S=np.array([remap[r] for r in self.request_S[idx_S].tolist()], np.int32),
            step_S=self.step_S[idx_S],
            tokens_S=tokens,
            phase_S=self.phase_S[idx_S],
            clock_S=_clock(self.layer_S[idx_S], tokens, self.request_S[idx_S], self.step_S[idx_S]),
            start_S=new_start,
            key_A=self.key_A[take_A],
            uses_A=self.uses_A[take_A],
            name=self.name,
            workload=self.workload,
        )


def _clock(layer_S, tokens_S, request_S, step_S) -> np.ndarray:
    """Tokens processed before each step's forward step (all layers of one forward share it)."""
    s = len(layer_S)
    if s == 0:
        return np.zeros(0, np.int64)
    new_fwd = np.ones(s, bool)
    new_fwd[1:] = (request_S[1:] != request_S[:-1]) | (step_S[1:] != step_S[:-1])
    fwd_id = np.cumsum(new_fwd) - 1
    fwd_tokens = tokens_S[new_fwd].astype(np.int64)
    fwd_clock = np.zeros(len(fwd_tokens), np.int64)
    np.cumsum(fwd_tokens[:-1], out=fwd_clock[1:])
    return fwd_clock[fwd_id]


def from_table(
    table: pa.Table, meta: TraceMeta, name: str = "trace", workload: str = "unknown"
) -> TraceArrays:
    """Flatten a validated canonical trace table (rows in canonical order) into TraceArrays."""
    n = table.num_rows
    if n == 0:
        raise MoecacheError(f"trace {name}: no rows")
    req_codes = pc.dictionary_encode(table["request_id"]).combine_chunks()
    request_R = req_codes.indices.to_numpy().astype(np.int32)
    request_ids = tuple(req_codes.dictionary.to_pylist())
    step_R = table["step_index"].to_numpy().astype(np.int32)
    layer_R = table["layer_id"].to_numpy().astype(np.int32)
    phase_R = (pc.equal(table["phase"], "decode").to_numpy(zero_copy_only=False)).astype(np.int8)
    experts = table["expert_ids"].combine_chunks()
    offsets = experts.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    expert_X = pc.list_flatten(experts).to_numpy().astype(np.int32)
    key_X = np.repeat(layer_R, np.diff(offsets)) * meta.num_experts + expert_X

    new_S = np.ones(n, bool)
    new_S[1:] = (
        (request_R[1:] != request_R[:-1]) | (step_R[1:] != step_R[:-1]) | (layer_R[1:] != layer_R[:-1])
    )
    first_R = np.flatnonzero(new_S)
    step_of_R = np.cumsum(new_S) - 1
    tokens_S = np.diff(np.append(first_R, n)).astype(np.int32)
    s = len(first_R)
    if np.any(np.diff(request_R[first_R]) < 0):
        raise MoecacheError(
            f"trace {name}: rows of one request are not contiguous (expected canonical row order)"
        )

    if np.all(tokens_S == 1):  # one token per step: the router's experts are already distinct
        key_A, uses_A = key_X, np.ones(len(key_X), np.int32)
        start_S = np.append(offsets[first_R], offsets[-1]).astype(np.int64)
    else:
        step_X = np.repeat(step_of_R, np.diff(offsets))
        composite = step_X.astype(np.int64) * meta.num_layers * meta.num_experts + key_X
        uniq, first_idx, counts = np.unique(composite, return_index=True, return_counts=True)
        order = np.argsort(first_idx, kind="stable")
        key_A = (uniq[order] % (meta.num_layers * meta.num_experts)).astype(np.int32)
        uses_A = counts[order].astype(np.int32)
        step_A = (uniq[order] // (meta.num_layers * meta.num_experts)).astype(np.int64)
        start_S = np.searchsorted(step_A, np.arange(s + 1)).astype(np.int64)

    layer_S = layer_R[first_R]
    request_S = request_R[first_R]
    stepidx_S = step_R[first_R]
    return TraceArrays(
        num_layers=meta.num_layers,
        num_experts=meta.num_experts,
        top_k=meta.top_k,
        expert_bytes=meta.expert_bytes,
        request_ids=request_ids,
        layer_S=layer_S,
        request_S=request_S,
        step_S=stepidx_S,
        tokens_S=tokens_S,
        phase_S=phase_R[first_R],
        clock_S=_clock(layer_S, tokens_S, request_S, stepidx_S),
        start_S=start_S,
        key_A=np.ascontiguousarray(key_A, np.int32),
        uses_A=np.ascontiguousarray(uses_A, np.int32),
        name=name,
        workload=workload,
    )


def load_trace(path: str | Path, name: str | None = None, workload: str = "unknown") -> TraceArrays:
    cols = ["request_id", "step_index", "token_index", "layer_id", "phase", "expert_ids"]
    table, meta = read_trace(path, columns=cols)
    return from_table(table, meta, name=name or Path(path).stem, workload=workload)
