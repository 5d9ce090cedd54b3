"""Read the DeepSeek ESFT routing traces (`.npz`) and convert them to the canonical trace table.

An ESFT file holds three arrays (see shared/data/traces/deepseek-v2-lite-esft/README.md):

- `expert_ids`   integer [N, L, K]: the top-K expert ids per token and MoE layer, in router order
- `gate_weights` float   [N, L, K]: the matching normalised gate weights
- `seq_offsets`  integer [S+1]:     sequence s is tokens seq_offsets[s]:seq_offsets[s+1]

Every sequence becomes one request (`<name>/seq-0007`); the conversion is vectorised numpy.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from moecache.errors import MoecacheError
from moecache.trace.schema import TraceMeta, empty_cache_columns, schema_with_meta

REQUIRED_KEYS = ("expert_ids", "gate_weights", "seq_offsets")


@dataclass(frozen=True)
class EsftArrays:
    """The validated contents of one ESFT `.npz` file."""

    expert_ids: np.ndarray  # int [N, L, K]
    gate_weights: np.ndarray  # float [N, L, K]
    seq_offsets: np.ndarray  # int64 [S+1], 0 .. N, non-decreasing

    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1


def load_esft_npz(path: str | Path, *, num_layers: int, num_experts: int, top_k: int) -> EsftArrays:
    """Read and validate `path`; any problem is a one-line MoecacheError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise MoecacheError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise MoecacheError(f"{path}: not a .npz file (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in REQUIRED_KEYS if k not in npz.files]
            if missing:
                raise MoecacheError(f"{path}: missing array(s) {missing}; found {sorted(npz.files)}")
            arrays = {k: npz[k] for k in REQUIRED_KEYS}
    except MoecacheError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise MoecacheError(f"{path}: not a readable .npz file ({' '.join(str(exc).split())})") from exc
    ids, weights, offsets = arrays["expert_ids"], arrays["gate_weights"], arrays["seq_offsets"]
    _check_arrays(
        str(path), ids, weights, offsets, num_layers=num_layers, num_experts=num_experts, top_k=top_k
    )
    return EsftArrays(ids, weights, offsets.astype(np.int64))


def _check_arrays(
    where: str,
    ids: np.ndarray,
    weights: np.ndarray,
    offsets: np.ndarray,
    *,
    num_layers: int,
    num_experts: int,
    top_k: int,
) -> None:
    want = f"[N, {num_layers}, {top_k}] (num_layers, top_k)"
    if ids.ndim != 3 or ids.shape[1:] != (num_layers, top_k):
        raise MoecacheError(f"{where}: 'expert_ids' has shape {list(ids.shape)}, expected {want}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise MoecacheError(f"{where}: 'expert_ids' has dtype {ids.dtype}, expected an integer type")
    if weights.shape != ids.shape:
        raise MoecacheError(
            f"{where}: 'gate_weights' has shape {list(weights.shape)}, expected {list(ids.shape)} like 'expert_ids'"
        )
    if not np.issubdtype(weights.dtype, np.floating):
        raise MoecacheError(f"{where}: 'gate_weights' has dtype {weights.dtype}, expected a float type")
    if offsets.ndim != 1 or len(offsets) < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise MoecacheError(
            f"{where}: 'seq_offsets' has shape {list(offsets.shape)} and dtype {offsets.dtype}, "
            "expected a 1-D integer array [n_seq+1] with n_seq >= 1"
        )
    n = ids.shape[0]
    if n == 0:
        raise MoecacheError(f"{where}: 'expert_ids' holds no tokens")
    if offsets[0] != 0:
        raise MoecacheError(f"{where}: 'seq_offsets' must start at 0, starts at {offsets[0]}")
    if np.any(np.diff(offsets) < 0):
        at = int(np.argmax(np.diff(offsets) < 0))
        raise MoecacheError(
            f"{where}: 'seq_offsets' must be non-decreasing; seq_offsets[{at + 1}]={offsets[at + 1]} "
            f"< seq_offsets[{at}]={offsets[at]}"
        )
    if offsets[-1] != n:
        raise MoecacheError(
            f"{where}: 'seq_offsets' must end at N={n} (rows of 'expert_ids'), ends at {offsets[-1]}"
        )
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        raise MoecacheError(
            f"{where}: 'expert_ids' range {lo}..{hi}, outside 0..{num_experts - 1} (num_experts)"
        )
    ordered = np.sort(ids, axis=2)
    dup = np.any(ordered[:, :, 1:] == ordered[:, :, :-1], axis=2)
    if dup.any():
        token, layer = (int(i) for i in np.argwhere(dup)[0])
        raise MoecacheError(
            f"{where}: 'expert_ids' repeats an expert within one token: token {token}, layer {layer} "
            f"has {ids[token, layer].tolist()} ({int(dup.sum())} such token-layers)"
        )
    if not np.all(np.isfinite(weights)):
        raise MoecacheError(f"{where}: 'gate_weights' holds NaN or infinite values")


def esft_to_table(
    arrays: EsftArrays,
    *,
    name: str,
    run_id: str,
    tokens_per_step: int,
    meta: TraceMeta,
) -> pa.Table:
    """The canonical trace table: one row per (sequence, token, layer).

    Rows are ordered by request, step_index, layer_id, token_index. tokens_per_step 1: each token is
    its own "decode" step; 0: a whole sequence is one "prefill" step; N > 1: "prefill" steps of N tokens.
    step_index counts from 0 within each request.
    """
    if tokens_per_step < 0:
        raise MoecacheError(f"trace_import.tokens_per_step must be >= 0, got {tokens_per_step}")
    ids, offsets = arrays.expert_ids, arrays.seq_offsets
    n, num_layers, k = ids.shape
    seq = np.repeat(np.arange(arrays.num_sequences), np.diff(offsets))  # sequence of every token
    pos = np.arange(n) - offsets[seq]  # position within its sequence
    step = pos // tokens_per_step if tokens_per_step > 0 else np.zeros(n, dtype=np.int64)

    # A row is (token t, layer l) with flat index t * L + l; order by (seq, step, layer, token).
    layer_of_row = np.tile(np.arange(num_layers), n)
    token_of_row = np.repeat(np.arange(n), num_layers)
    order = np.lexsort((token_of_row, layer_of_row, step[token_of_row], seq[token_of_row]))
    rows = len(order)
    tok = token_of_row[order]

    width = max(4, len(str(arrays.num_sequences - 1)))
    names = pa.array([f"{name}/seq-{s:0{width}d}" for s in range(arrays.num_sequences)], pa.string())
    list_offsets = pa.array(np.arange(0, rows * k + 1, k, dtype=np.int32))
    expert_values = pa.array(ids.reshape(rows, k)[order].reshape(-1).astype(np.int16))
    weight_values = pa.array(arrays.gate_weights.reshape(rows, k)[order].reshape(-1).astype(np.float32))
    phase = "decode" if tokens_per_step == 1 else "prefill"
    columns = {
        "run_id": _repeat(run_id, rows),
        "request_id": names.take(pa.array(seq[tok])),
        "step_index": pa.array(step[tok].astype(np.int32)),
        "token_index": pa.array(pos[tok].astype(np.int32)),
        "phase": _repeat(phase, rows),
        "layer_id": pa.array(layer_of_row[order].astype(np.int16)),
        "expert_ids": pa.ListArray.from_arrays(list_offsets, expert_values),
        "router_weights": pa.ListArray.from_arrays(list_offsets, weight_values),
        **empty_cache_columns(rows),
    }
    schema = schema_with_meta(meta)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def _repeat(value: str, rows: int) -> pa.Array:
    return pa.array([value], pa.string()).take(pa.array(np.zeros(rows, dtype=np.int32)))
