"""Read the artifacts' Parquet and JSON files and select the rows a figure or a table needs.

The report depends only on the file formats of the analysis, sweep and decision artifacts (columns named in
REQUIRED), never on the code that writes them. A missing file reads as None (its section is skipped); a file
that lacks a required column is an error naming the file and the columns.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moecache.errors import MoecacheError
from moecache.sim.sweep import base_rows

# The columns the report reads from each file (other columns are ignored).
REQUIRED: dict[str, tuple[str, ...]] = {
    "sweep.parquet": (
        "trace",
        "policy",
        "params",
        "label",
        "mode",
        "capacity",
        "hit_rate",
        "est_ms_per_token",
    ),
    "targets.parquet": ("trace", "label", "mode", "target_hit_rate", "capacity"),
    "per_layer.parquet": ("trace", "label", "mode", "capacity", "layer", "hit_rate"),
    "frequency.parquet": ("trace", "layer", "expert", "count"),
    "reuse.parquet": ("trace", "distance", "count"),
    "runs.parquet": ("trace", "run_length", "count"),
    "layer_transitions.parquet": ("trace", "layer", "from_expert", "to_expert", "count"),
    "layer_mi.parquet": ("trace", "layer", "mi_bits", "mi_shuffled_bits"),
    "window_drift.parquet": ("trace", "token_start", "js_vs_first", "js_vs_first_shuffled"),
    "convergence.parquet": ("trace", "tokens_seen", "spearman"),
    "prefetch_lead.parquet": ("trace", "lead_layers", "recall", "lead_us"),
    "extensions.parquet": (
        "policy",
        "label",
        "chosen_on",
        "split",
        "trace",
        "capacity",
        "rel_diff",
        "ci_lo",
        "ci_hi",
        "verdict",
        "passes_limits",
    ),
    "verdicts.parquet": (
        "trace",
        "workload",
        "capacity",
        "label",
        "role",
        "rel_diff",
        "ci_lo",
        "ci_hi",
        "verdict",
        "hit_rate",
        "baseline_hit_rate",
        "bytes_per_token",
        "reasons",
        "in_useful_range",
    ),
}


def _present(folder: Path | None, name: str) -> Path | None:
    """folder/name, or None when the folder is None or the file is absent."""
    if folder is None or not (Path(folder) / name).is_file():
        return None
    return Path(folder) / name


def read_parquet(folder: Path | None, name: str) -> pa.Table | None:
    """The table in folder/name, or None when the folder is None or the file is absent."""
    path = _present(folder, name)
    if path is None:
        return None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise MoecacheError(f"{path}: cannot read as Parquet ({exc})") from exc
    missing = [c for c in REQUIRED.get(name, ()) if c not in table.column_names]
    if missing:
        raise MoecacheError(f"{path}: missing column(s) {missing}; has {table.column_names}")
    return table


def read_json(folder: Path | None, name: str) -> dict | None:
    """The JSON object in folder/name, or None when the folder is None or the file is absent."""
    path = _present(folder, name)
    if path is None:
        return None
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MoecacheError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise MoecacheError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def select(table: pa.Table | None, **equals) -> pa.Table | None:
    """The rows of table whose columns equal the given values (None stays None)."""
    if table is None:
        return None
    for column, value in equals.items():
        mask = pc.fill_null(pc.equal(table[column], value), False)
        table = table.filter(mask)
    return table


def base_scales(table: pa.Table) -> pa.Table:
    """The rows at the base cost scales (all three *_scale == 1.0) where the table has those columns."""
    return base_rows(table)


def preferred_mode(table: pa.Table | None) -> str:
    """ "timed" when the table has timed rows, else "instant"."""
    if table is not None and table.num_rows and "timed" in set(table["mode"].to_pylist()):
        return "timed"
    return "instant"


def curve_rows(sweep: pa.Table | None, trace: str) -> tuple[pa.Table | None, str]:
    """The sweep rows of one trace at base scales in the preferred mode (timed if any), and that mode."""
    rows = select(sweep, trace=trace)
    if rows is None:
        return None, "timed"
    rows = base_scales(rows)
    mode = preferred_mode(rows)
    return select(rows, mode=mode), mode


def floats(table: pa.Table, column: str) -> np.ndarray:
    """A column as float64 with nulls as NaN."""
    return np.array([np.nan if v is None else float(v) for v in table[column].to_pylist()], dtype=np.float64)


def ints(table: pa.Table, column: str) -> np.ndarray:
    """A column of non-null integers as int64."""
    values = table[column].to_pylist()
    if any(v is None for v in values):
        raise MoecacheError(f"column {column!r}: null where an integer is required")
    return np.array(values, dtype=np.int64)


def labels_in_order(table: pa.Table | None) -> list[str]:
    """The distinct labels of a table, sorted."""
    if table is None or table.num_rows == 0:
        return []
    return sorted({str(v) for v in table["label"].to_pylist() if v is not None})


def trace_names(*tables: pa.Table | None, summary: dict | None = None) -> list[str]:
    """Every trace named in the tables (and the analysis summary), sorted."""
    names: set[str] = set()
    for table in tables:
        if table is not None and "trace" in table.column_names:
            names.update(str(v) for v in table["trace"].to_pylist() if v is not None)
    if summary:
        names.update(str(k) for k in summary)
    return sorted(names)


def slug(name: str) -> str:
    """A file-name-safe form of a trace name ("tiny/multi_request/seed0" -> "tiny_multi_request_seed0")."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return s or "trace"


def unique_slugs(names: list[str]) -> dict[str, str]:
    """A distinct slug per name (a suffix -2, -3, ... where two names sanitise to the same slug)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        base = slug(name)
        candidate, n = base, 1
        while candidate in used:
            n += 1
            candidate = f"{base}-{n}"
        used.add(candidate)
        out[name] = candidate
    return out
