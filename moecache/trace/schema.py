"""The canonical routing-trace format: one Parquet row per (request, token, MoE layer).

See docs/trace-format.md for the meaning of every column and the metadata keys. Any Parquet file
with these columns and the `moecache.trace` metadata is a valid input to every later stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moecache.errors import MoecacheError
from moecache.trace import validity

FORMAT_VERSION = 1
METADATA_KEY = b"moecache.trace"
PHASES = ("prefill", "decode")

# Keys in the cache columns (`resident_experts`, `admitted`, `evicted`) are global expert keys:
# key = layer_id * num_experts + expert_id.
SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("step_index", pa.int32(), nullable=False),
        pa.field("token_index", pa.int32(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("layer_id", pa.int16(), nullable=False),
        pa.field("expert_ids", pa.list_(pa.int16()), nullable=False),
        pa.field("router_weights", pa.list_(pa.float32()), nullable=False),
        pa.field("resident_experts", pa.list_(pa.int32())),
        pa.field("cache_hit", pa.list_(pa.bool_())),
        pa.field("admitted", pa.list_(pa.int32())),
        pa.field("evicted", pa.list_(pa.int32())),
        pa.field("copy_enqueued_ns", pa.int64()),
        pa.field("copy_ready_ns", pa.int64()),
        pa.field("copy_bytes", pa.int64()),
        pa.field("copy_duration_ns", pa.int64()),
        pa.field("cpu_duration_ns", pa.int64()),
        pa.field("cuda_duration_ns", pa.int64()),
        # Logit lens: top-1 token of the residual stream entering the row's decoder layer, through the
        # final norm and LM head; null where the token was not sampled (logging.logit_lens.rate).
        pa.field("lens_token", pa.int32()),
    ]
)
REQUIRED_COLUMNS = ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids")
LENS_COLUMN = "lens_token"
# The optional columns that validity rules check where they are present (`validate_table`).
CHECKED_COLUMNS = ("router_weights", LENS_COLUMN)
# Every nullable column is optional on input: a trace without it reads as if it were all null.
NULLABLE_COLUMNS = tuple(f.name for f in SCHEMA if f.nullable)
CACHE_COLUMNS = tuple(name for name in NULLABLE_COLUMNS if name != LENS_COLUMN)


@dataclass
class TraceMeta:
    """What a stage needs to know about a trace besides its rows."""

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    model: str = "unknown"
    source: str = "unknown"
    run: dict = field(default_factory=dict)  # run metadata: versions, machine, seed, workload, ...

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> TraceMeta:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MoecacheError(f"{where}: metadata '{METADATA_KEY.decode()}' is not JSON ({exc})") from exc
        for key, low in (("num_layers", 1), ("num_experts", 1), ("top_k", 1), ("expert_bytes", 0)):
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                what = "a positive" if low else "a non-negative"
                raise MoecacheError(
                    f"{where}: trace metadata key '{key}' must be {what} integer, got {value!r}"
                )
        for key, kind, name in (
            ("model", str, "a string"),
            ("source", str, "a string"),
            ("run", dict, "an object"),
        ):
            if key in raw and not isinstance(raw[key], kind):
                raise MoecacheError(f"{where}: trace metadata key '{key}' must be {name}, got {raw[key]!r}")
        version = raw.get("format_version", FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool):
            raise MoecacheError(
                f"{where}: trace metadata key 'format_version' must be an integer, got {version!r}"
            )
        if version > FORMAT_VERSION:
            raise MoecacheError(
                f"{where}: trace format_version {raw['format_version']} is newer than this moecache ({FORMAT_VERSION})"
            )
        known = {
            k: raw[k]
            for k in ("num_layers", "num_experts", "top_k", "expert_bytes", "model", "source", "run")
            if k in raw
        }
        return cls(**known)


def schema_with_meta(meta: TraceMeta) -> pa.Schema:
    return SCHEMA.with_metadata({METADATA_KEY: meta.to_json().encode()})


def empty_cache_columns(num_rows: int) -> dict[str, pa.Array]:
    """Every nullable column (the cache columns and `lens_token`) all null, for traces recorded or
    imported while no cache runs and without logit-lens samples."""
    return {name: pa.nulls(num_rows, SCHEMA.field(name).type) for name in NULLABLE_COLUMNS}


def read_trace(
    path: str | Path,
    meta_override: dict | None = None,
    columns: list[str] | None = None,
    dictionary_strings: bool = False,
    use_threads: bool = True,
    require_order: bool = True,
) -> tuple[pa.Table, TraceMeta]:
    """Read and validate a canonical trace (validate_table); every failure names the file and what
    is wrong. `dictionary_strings`: read the string columns (run_id, request_id, phase) as dictionary
    arrays, which skips decoding one string per row (the simulator only needs their codes).
    `use_threads`: decode columns on pyarrow's thread pool. `require_order=False` only for a
    converter that sorts the rows itself and then validates the result (import-trace)."""
    path = Path(path)
    if not path.is_file():
        raise MoecacheError(f"{path}: no such trace file")
    try:
        present = pq.read_schema(path).names
        absent = [c for c in REQUIRED_COLUMNS if c not in present]
        if absent:
            raise MoecacheError(f"{path}: missing trace column(s) {absent}; found {present}")
        # Every column a rule checks is read, whichever of them the caller uses: a trace gets one verdict
        # from every stage (docs/trace-format.md, "Validity"), and the checked ones are dropped after.
        wanted = None
        if columns is not None:
            wanted = list(
                dict.fromkeys([*columns, *REQUIRED_COLUMNS, *(c for c in CHECKED_COLUMNS if c in present)])
            )
        strings = [f.name for f in SCHEMA if f.type == pa.string() and f.name in present]
        pf = pq.ParquetFile(path, read_dictionary=strings if dictionary_strings else None)
        table = pf.read(columns=wanted, use_threads=use_threads)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, KeyError) as exc:
        raise MoecacheError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())})") from exc
    raw_meta = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
    try:
        meta_dict = json.loads(raw_meta) if raw_meta else {}
    except json.JSONDecodeError as exc:
        raise MoecacheError(f"{path}: metadata '{METADATA_KEY.decode()}' is not JSON ({exc})") from exc
    if not isinstance(meta_dict, dict):
        raise MoecacheError(f"{path}: metadata '{METADATA_KEY.decode()}' must be a JSON object")
    meta_dict.update(meta_override or {})
    if not {"num_layers", "num_experts", "top_k", "expert_bytes"} <= meta_dict.keys():
        raise MoecacheError(
            f"{path}: not a moecache trace: metadata '{METADATA_KEY.decode()}' must give num_layers, "
            f"num_experts, top_k and expert_bytes (found {sorted(meta_dict)})"
        )
    meta = TraceMeta.from_json(json.dumps(meta_dict), str(path))
    validate_table(table, meta, str(path), require_order=require_order)
    if columns is not None and table.column_names != list(columns):
        table = table.select([c for c in columns if c in table.column_names])
    return table, meta


def validate_table(table: pa.Table, meta: TraceMeta, where: str, require_order: bool = True) -> None:
    """Every rule of a valid trace (docs/trace-format.md, "Validity"), on a whole table or on the
    column subset a stage reads (it must hold the required columns; string columns may be
    dictionary-encoded). `require_order=False` leaves out the row-order and duplicate check (for
    import-trace, which sorts first and checks after)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise MoecacheError(f"{where}: missing trace column(s) {missing}; found {table.column_names}")
    for name in REQUIRED_COLUMNS:
        want = SCHEMA.field(name).type
        got = table.schema.field(name).type
        if not (
            got == want
            or (pa.types.is_integer(want) and pa.types.is_integer(got))
            or (_is_list(got) and pa.types.is_integer(got.value_type))
            or (pa.types.is_dictionary(got) and got.value_type == want)
        ):
            raise MoecacheError(f"{where}: column '{name}' has type {got}, expected {want}")
    if "router_weights" in table.column_names:
        got = table.schema.field("router_weights").type
        if not (
            _is_list(got) and (pa.types.is_floating(got.value_type) or pa.types.is_integer(got.value_type))
        ):
            raise MoecacheError(
                f"{where}: column 'router_weights' has type {got}, expected a list of numbers"
            )
    if table.num_rows == 0:
        raise MoecacheError(f"{where}: the trace has no rows")
    validity.check_no_nulls(table, REQUIRED_COLUMNS, where)
    _check_ranges(table, meta, where)
    if not _holds_only(table["phase"], set(PHASES)):
        raise MoecacheError(f"{where}: column 'phase' holds values other than {PHASES}")
    if LENS_COLUMN in table.column_names:  # optional: older traces do not have it
        lens_type = table.schema.field(LENS_COLUMN).type
        if not (pa.types.is_integer(lens_type) or pa.types.is_null(lens_type)):
            raise MoecacheError(f"{where}: column '{LENS_COLUMN}' has type {lens_type}, expected int32")
        lens_min = pc.min(table[LENS_COLUMN]).as_py() if not pa.types.is_null(lens_type) else None
        if lens_min is not None and lens_min < 0:
            raise MoecacheError(f"{where}: column '{LENS_COLUMN}' holds a negative token id ({lens_min})")
    if "router_weights" in table.column_names:  # optional on input; where present, one per expert
        validity.check_weights_match(table, where)
    validity.check_distinct_experts(table, where)
    if require_order:
        validity.check_row_order(table, where)


INT32_MAX = 2**31 - 1


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _check_ranges(table: pa.Table, meta: TraceMeta, where: str) -> None:
    """Integer columns within what the format and the model allow (the columns hold no null here)."""
    for name in ("step_index", "token_index"):
        low, high = (v.as_py() for v in pc.min_max(table[name]).values())
        if low < 0 or high > INT32_MAX:
            row = validity.first_outside(table[name], 0, INT32_MAX)
            raise MoecacheError(
                f"{where}: column '{name}' is {table[name][row].as_py()} at row {row}, outside 0..{INT32_MAX}"
            )
    layer_min, layer_max = (v.as_py() for v in pc.min_max(table["layer_id"]).values())
    if layer_min < 0 or layer_max >= meta.num_layers:
        row = validity.first_outside(table["layer_id"], 0, meta.num_layers - 1)
        raise MoecacheError(
            f"{where}: column 'layer_id' is {table['layer_id'][row].as_py()} at row {row}, outside "
            f"0..{meta.num_layers - 1} (num_layers); layer_id ranges {layer_min}..{layer_max}"
        )
    lengths = pc.list_value_length(table["expert_ids"])
    len_min, len_max = (v.as_py() for v in pc.min_max(lengths).values())
    if len_min < 1 or len_max > meta.top_k:
        row = validity.first_outside(lengths, 1, meta.top_k)
        raise MoecacheError(
            f"{where}: column 'expert_ids' holds {table['expert_ids'][row].as_py()} at row {row}: "
            f"{lengths[row].as_py()} experts, expected 1..{meta.top_k} (top_k); expert_ids lists hold "
            f"{len_min}..{len_max} experts"
        )
    flat = pc.list_flatten(table["expert_ids"])
    e_min, e_max = (v.as_py() for v in pc.min_max(flat).values())
    if e_min < 0 or e_max >= meta.num_experts:
        row = validity.row_of_item(table["expert_ids"], validity.first_outside(flat, 0, meta.num_experts - 1))
        raise MoecacheError(
            f"{where}: column 'expert_ids' holds {table['expert_ids'][row].as_py()} at row {row}, an "
            f"expert outside 0..{meta.num_experts - 1} (num_experts); expert_ids range {e_min}..{e_max}"
        )


def _holds_only(column: pa.ChunkedArray, allowed: set) -> bool:
    """Whether every value of a string column, plain or dictionary-encoded, is in `allowed` (for a
    dictionary, only the entries that some row uses count)."""
    if not pa.types.is_dictionary(column.type):
        return set(pc.unique(column).to_pylist()) <= allowed
    for chunk in column.chunks:
        if not set(chunk.dictionary.to_pylist()) <= allowed:
            used = chunk.dictionary.take(pc.unique(chunk.indices))
            if not set(used.to_pylist()) <= allowed:
                return False
    return True
