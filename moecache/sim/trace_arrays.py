"""A canonical trace as flat integer arrays, the simulator's only input.

Legend: V layer visits (one per request, forward step and MoE layer), A accesses (one per distinct
expert of a layer visit), G global expert keys (key = layer_id * num_experts + expert_id).

Access order is (request, step, layer, then router order): within a layer step the distinct experts
appear in the order their first selection appears (token by token, each token in router order).
`uses_A` counts the step's tokens that selected the expert (1 for every access of a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moecache.arrow_numpy import numpy_view
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
    layer_V: np.ndarray  # int32
    request_V: np.ndarray  # int32, index into request_ids
    step_V: np.ndarray  # int32, forward-step index within its request
    tokens_V: np.ndarray  # int32, tokens routed by the step
    phase_V: np.ndarray  # int8, PREFILL or DECODE
    clock_V: np.ndarray  # int64, tokens of the whole trace processed before this step's forward step
    start_V: np.ndarray  # int64 [V+1], offsets into the access arrays
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
        return int(self.layer_V.shape[0])

    @property
    def num_accesses(self) -> int:
        return int(self.key_A.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens routed through the model (each counted once, not once per layer; a forward step
        counts the most tokens any of its visits routed, see cost_model.forward_tokens)."""
        from moecache.sim.cost_model import forward_index, forward_tokens

        return int(forward_tokens(self, forward_index(self)[1]).sum()) if self.num_steps else 0

    def subset_requests(self, requests: np.ndarray) -> TraceArrays:
        """The trace restricted to the given request indices (in their original order)."""
        keep_V = np.isin(self.request_V, requests)
        idx_V = np.flatnonzero(keep_V)
        counts = np.diff(self.start_V)[idx_V]
        starts = self.start_V[idx_V]
        take_A = (
            np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
            if len(idx_V)
            else np.zeros(0, np.int64)
        )
        new_start = np.zeros(len(idx_V) + 1, np.int64)
        np.cumsum(counts, out=new_start[1:])
        kept = sorted(set(self.request_V[idx_V].tolist()))
        remap = {old: new for new, old in enumerate(kept)}
        tokens = self.tokens_V[idx_V]
        return TraceArrays(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            expert_bytes=self.expert_bytes,
            request_ids=tuple(self.request_ids[r] for r in kept),
            layer_V=self.layer_V[idx_V],
            request_V=np.array([remap[r] for r in self.request_V[idx_V].tolist()], np.int32),
            step_V=self.step_V[idx_V],
            tokens_V=tokens,
            phase_V=self.phase_V[idx_V],
            clock_V=_clock(tokens, self.request_V[idx_V], self.step_V[idx_V]),
            start_V=new_start,
            key_A=self.key_A[take_A],
            uses_A=self.uses_A[take_A],
            name=self.name,
            workload=self.workload,
        )


# Large outputs are allocated by NumPy and filled by the compiled loops: NumPy asks the kernel for huge
# pages (madvise) where it offers them, so filling 1 GB of arrays faults ~500 pages instead of ~250,000,
# and on a virtual machine a page fault can cost 10 us.


def _clock(tokens_V, request_V, step_V) -> np.ndarray:
    """Tokens processed before each visit's forward step (all layers of one forward share it; a
    forward step is a run of visits with equal (request, step index); its tokens are the most any of
    its visits routed, so a token that an exported trace lacks at some layers still counts once)."""
    clock_V = np.empty(tokens_V.shape[0], np.int64)
    _fill_clock(tokens_V, request_V, step_V, clock_V)
    return clock_V


@nb.njit(cache=True, nogil=True)
def _fill_clock(tokens_V, request_V, step_V, clock_V):
    clock = 0
    forward_tokens = 0
    for s in range(tokens_V.shape[0]):
        if s == 0 or request_V[s] != request_V[s - 1] or step_V[s] != step_V[s - 1]:
            clock += forward_tokens
            forward_tokens = 0
        forward_tokens = max(forward_tokens, tokens_V[s])
        clock_V[s] = clock


def _fit(buffer: np.ndarray, n: int) -> np.ndarray:
    """buffer[:n], copied when that is less than half of it (prefill steps: many rows, few
    accesses), so that the buffer can be freed."""
    return buffer[:n].copy() if 2 * n < buffer.shape[0] else buffer[:n]


def _flatten(
    request_R, step_R, layer_R, phase_R, offsets_R, expert_X, is_decode, num_requests, num_experts, num_keys
):
    """One pass over the rows (canonical order; request_R and phase_R: dictionary codes, is_decode:
    per phase code). A layer step is a run of rows with equal (request, step, layer); its accesses
    are its distinct keys in order of first selection, with their uses. Requests are numbered in
    order of first appearance. Returns (contiguous, layer_V, request_V, step_V, tokens_V, phase_V,
    start_V, key_A, uses_A, request code of each request number); contiguous is False, and the rest
    incomplete, when the rows of one request are not contiguous."""
    n, x = request_R.shape[0], expert_X.shape[0]  # at least as many as the steps, the accesses
    layer_V, request_V, step_V = np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int32)
    tokens_V, phase_V, start_V = np.zeros(n, np.int32), np.empty(n, np.int8), np.empty(n + 1, np.int64)
    key_A, uses_A = np.empty(x, np.int32), np.empty(x, np.int32)
    contiguous, s, a, code_of_request = _fill_flat(
        request_R, step_R, layer_R, phase_R, offsets_R, expert_X, is_decode, num_requests, num_experts,
        num_keys, layer_V, request_V, step_V, tokens_V, phase_V, start_V, key_A, uses_A,
    )  # fmt: skip
    return (
        contiguous, _fit(layer_V, s), _fit(request_V, s), _fit(step_V, s), _fit(tokens_V, s),
        _fit(phase_V, s), _fit(start_V, s + 1), _fit(key_A, a), _fit(uses_A, a), code_of_request,
    )  # fmt: skip


@nb.njit(cache=True, nogil=True)
def _fill_flat(
    request_R, step_R, layer_R, phase_R, offsets_R, expert_X, is_decode, num_requests, num_experts, num_keys,
    layer_V, request_V, step_V, tokens_V, phase_V, start_V, key_A, uses_A,
):  # fmt: skip
    """_flatten's pass, into its arrays (tokens_V zeroed). Returns (contiguous, steps, accesses,
    request code of each request number)."""
    n = request_R.shape[0]
    code_of_request = np.empty(num_requests, np.int64)
    request_of_code = np.full(num_requests, -1, np.int64)
    step_G = np.full(num_keys, -1, np.int64)  # latest step of each key
    access_G = np.empty(num_keys, np.int64)  # its access in that step
    s = -1
    a = 0
    requests = 0
    contiguous = True
    for r in range(n):
        code = request_R[r]
        new_request = r == 0 or code != request_R[r - 1]
        if new_request or step_R[r] != step_R[r - 1] or layer_R[r] != layer_R[r - 1]:
            if new_request:
                if request_of_code[code] >= 0:
                    contiguous = False
                    break
                request_of_code[code] = requests
                code_of_request[requests] = code
                requests += 1
            s += 1
            layer_V[s] = layer_R[r]
            request_V[s] = request_of_code[code]
            step_V[s] = step_R[r]
            phase_V[s] = is_decode[phase_R[r]]
            start_V[s] = a
        tokens_V[s] += 1
        base = layer_R[r] * num_experts
        for i in range(offsets_R[r], offsets_R[r + 1]):
            k = base + expert_X[i]
            if step_G[k] != s:
                step_G[k] = s
                access_G[k] = a
                key_A[a] = k
                uses_A[a] = 1
                a += 1
            else:
                uses_A[access_G[k]] += 1
    s += 1
    start_V[s] = a
    return contiguous, s, a, code_of_request[:requests]


def _dictionary_codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """(code of every row, the dictionary) of a string or dictionary column."""
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    array = column.combine_chunks()  # one dictionary for all chunks
    return numpy_view(array.indices), array.dictionary.to_pylist()


def from_table(
    table: pa.Table, meta: TraceMeta, name: str = "trace", workload: str = "unknown"
) -> TraceArrays:
    """Flatten a validated canonical trace table (rows in canonical order) into TraceArrays. String
    columns may be plain or dictionary-encoded (`read_trace(..., dictionary_strings=True)`)."""
    if table.num_rows == 0:
        raise MoecacheError(f"trace {name}: no rows")
    request_R, request_values = _dictionary_codes(table["request_id"])
    phase_R, phase_values = _dictionary_codes(table["phase"])
    experts = table["expert_ids"].combine_chunks()
    contiguous, layer_V, request_V, step_V, tokens_V, phase_V, start_V, key_A, uses_A, request_codes = (
        _flatten(
            request_R,
            numpy_view(table["step_index"]),  # any integer type: _flatten is compiled per type, which
            numpy_view(table["layer_id"]),  # spares a converted copy of every per-row column
            phase_R,
            numpy_view(experts.offsets),
            numpy_view(experts.values),  # the lists' values, indexed by the offsets
            np.array([v == "decode" for v in phase_values], np.int8),
            len(request_values),
            meta.num_experts,
            meta.num_layers * meta.num_experts,
        )
    )
    if not contiguous:
        raise MoecacheError(
            f"trace {name}: rows of one request are not contiguous (expected canonical row order)"
        )
    return TraceArrays(
        num_layers=meta.num_layers,
        num_experts=meta.num_experts,
        top_k=meta.top_k,
        expert_bytes=meta.expert_bytes,
        request_ids=tuple(request_values[c] for c in request_codes),
        layer_V=layer_V,
        request_V=request_V,
        step_V=step_V,
        tokens_V=tokens_V,
        phase_V=phase_V,
        clock_V=_clock(tokens_V, request_V, step_V),
        start_V=start_V,
        key_A=key_A,
        uses_A=uses_A,
        name=name,
        workload=workload,
    )


def load_trace(path: str | Path, name: str | None = None, workload: str = "unknown") -> TraceArrays:
    cols = ["request_id", "step_index", "token_index", "layer_id", "phase", "expert_ids"]
    # One thread: one column (expert_ids) is most of the work, and the simulator runs one replay
    # per core (sweep), so pool threads only compete with it (and leave the data in another cache).
    table, meta = read_trace(path, columns=cols, dictionary_strings=True, use_threads=False)
    return from_table(table, meta, name=name or Path(path).stem, workload=workload)
