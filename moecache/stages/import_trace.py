"""`moecache import-trace`: convert an external routing trace into a canonical trace artifact.

Formats (`trace_import.format`):

- `esft_npz`: the DeepSeek ESFT routing traces (moecache/trace/esft_import.py);
- `parquet`: an existing canonical trace (docs/trace-format.md), validated, sorted into canonical row
  order and re-published (duplicated rows and nulls are refused, as `read_trace` refuses them).

The artifact (`outputs/import_trace/<id>/`) holds `trace.parquet`, `run_metadata.json` and, when the
source ships one, its licence as `LICENSE-source`. Its id covers the resolved `trace_import` group and
the sha256 of the input file's bytes, so a changed input gives a new artifact. `trace_import.reshape`
(null by default) maps the imported trace onto another routing shape, a labelled approximation
(moecache/trace/reshape.py; docs/trace-format.md, "Reshaped traces: an approximation"). The written
`trace.parquet` is read back through `read_trace` before the artifact is published, so import-trace
never publishes a trace that a later stage would refuse.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from moecache.artifacts import Artifact, artifact_id, write_json_atomic
from moecache.config import CONF_DIR, to_container
from moecache.errors import MoecacheError
from moecache.stages.base import StageResult, prepare, reusable, store_for
from moecache.trace.esft_import import esft_to_table, load_esft_npz
from moecache.trace.reshape import RESHAPE_VERSION, reshape_table, target_from_option
from moecache.trace.schema import SCHEMA, TraceMeta, read_trace, schema_with_meta, validate_table
from moecache.trace.validity import canonical_order, check_row_order

STAGE = "import_trace"
SCHEMA_VERSION = 1
TRACE_FILE = "trace.parquet"
RUN_METADATA = "run_metadata.json"
LICENSE_FILE = "LICENSE-source"
FORMATS = ("esft_npz", "parquet")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run(cfg: DictConfig) -> StageResult:
    missing = [k for k in cfg.trace_import if OmegaConf.is_missing(cfg.trace_import, k)]
    if missing:
        raise MoecacheError(
            f"trace_import.{missing[0]} is mandatory: give it as trace_import.{missing[0]}=..."
        )
    prepare(cfg, STAGE)
    group = to_container(cfg.trace_import)
    fmt = group.get("format")
    if fmt not in FORMATS:
        raise MoecacheError(f"trace_import.format={fmt!r}: expected one of {list(FORMATS)}")
    for key in ("path", "name", "run_id"):
        if not group.get(key):
            raise MoecacheError(f"trace_import.{key} must be set (got {group.get(key)!r})")
    path = Path(str(group["path"]))
    if not path.is_file():
        raise MoecacheError(
            f"{path}: no such file (trace_import.path; a relative path resolves against {Path.cwd()})"
        )
    digest = file_sha256(path)
    target = None if group.get("reshape") is None else target_from_option(group["reshape"], CONF_DIR)
    config = {**group, "sha256": digest}
    if target is None:
        config.pop("reshape", None)  # an import without reshape: the same config as before the option
    else:  # the resolved shape and the rule's version, so either changing gives a new artifact
        config["reshape"] = {**asdict(target), "version": RESHAPE_VERSION}
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, [])
    if existing is not None:
        return StageResult(existing, reused=True, summary=Artifact(existing).manifest.get("summary", {}))

    source = {
        "format": fmt,
        "file": path.name,
        "path": str(group["path"]),
        "sha256": digest,
        "tokens_per_step": group.get("tokens_per_step"),
        "licence": group.get("licence"),
    }
    run_meta = {
        "run_id": group["run_id"],
        "name": group["name"],
        "workload": group.get("workload"),
        "importer": "moecache import-trace",
        "source": source,
    }
    table, meta = _esft(path, group, run_meta) if fmt == "esft_npz" else _parquet(path, group, run_meta)
    if target is not None:  # a labelled approximation onto another shape (moecache/trace/reshape.py)
        table, meta = reshape_table(table, meta, target, str(path))
    summary = trace_summary(table, meta)
    licence = _licence_path(path, group.get("licence_file"))

    with store_for(cfg).create(
        STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=[], seed=None, extra={"summary": summary}
    ) as tmp:
        pq.write_table(table, tmp / TRACE_FILE)
        read_trace(tmp / TRACE_FILE)  # publish only what every stage accepts
        write_json_atomic(
            tmp / RUN_METADATA, {**meta.run, "summary": summary, "trace_meta": _meta_dict(meta)}
        )
        if licence is not None:
            shutil.copyfile(licence, tmp / LICENSE_FILE)
    final = store_for(cfg).root / STAGE / artifact_id(STAGE, SCHEMA_VERSION, config, [])
    return StageResult(final, reused=False, summary=summary)


def _esft(path: Path, group: dict, run_meta: dict) -> tuple[pa.Table, TraceMeta]:
    numbers = {k: _int(group, k) for k in ("num_layers", "num_experts", "top_k", "expert_bytes")}
    arrays = load_esft_npz(
        path, num_layers=numbers["num_layers"], num_experts=numbers["num_experts"], top_k=numbers["top_k"]
    )
    run_meta = {**run_meta, "num_sequences": arrays.num_sequences}
    meta = TraceMeta(
        **numbers, model=str(group.get("model", "unknown")), source=f"esft_npz:{path.name}", run=run_meta
    )
    table = esft_to_table(
        arrays,
        name=group["name"],
        run_id=group["run_id"],
        tokens_per_step=_int(group, "tokens_per_step"),
        meta=meta,
    )
    validate_table(table, meta, str(path))
    return table, meta


def _parquet(path: Path, group: dict, run_meta: dict) -> tuple[pa.Table, TraceMeta]:
    """A canonical trace, validated, sorted into canonical row order, conformed to SCHEMA's column
    types, with import notes in `run`. Sorting is a conversion, not a change of the data (every
    stage replays rows in that order); a duplicated row is refused, naming both rows of the file."""
    table, meta = read_trace(path, require_order=False)
    table = _canonical(table, str(path))
    meta.run = {**meta.run, "import": run_meta}
    columns, fields = [], []
    for f in SCHEMA:
        if f.name in table.column_names:
            try:
                columns.append(table[f.name].cast(f.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise MoecacheError(f"{path}: column '{f.name}' cannot be cast to {f.type} ({exc})") from exc
        elif f.nullable:
            columns.append(pa.nulls(table.num_rows, f.type))
        elif f.name == "run_id":
            columns.append(pa.array([str(group["run_id"])] * table.num_rows, pa.string()))
        else:
            continue  # router_weights is optional on input (docs/trace-format.md)
        fields.append(f)
    extra = [c for c in table.column_names if c not in SCHEMA.names]
    columns += [table[c] for c in extra]
    fields += [table.schema.field(c) for c in extra]
    schema = pa.schema(fields, metadata=schema_with_meta(meta).metadata)
    return pa.Table.from_arrays(columns, schema=schema), meta


def _canonical(table: pa.Table, where: str) -> pa.Table:
    """`table` in canonical row order (requests in order of their first row). Duplicated rows are
    refused with their row numbers in the file: after the stable sort they are neighbours."""
    order_N = canonical_order(table)
    if np.array_equal(order_N, np.arange(table.num_rows)):
        check_row_order(table, where)
        return table
    table = table.take(pa.array(order_N))
    check_row_order(table, where, row_N=order_N)
    return table


def trace_summary(table: pa.Table, meta: TraceMeta) -> dict:
    """Requests, tokens, rows, expert accesses and the model numbers of a trace table."""
    tokens = table.group_by(["request_id", "token_index"]).aggregate([]).num_rows if table.num_rows else 0
    accesses = pc.sum(pc.list_value_length(table["expert_ids"])).as_py() or 0
    return {
        "requests": pc.count_distinct(table["request_id"]).as_py(),
        "tokens": tokens,
        "rows": table.num_rows,
        "accesses": accesses,
        "layers": meta.num_layers,
        "experts": meta.num_experts,
        "top_k": meta.top_k,
    }


def _licence_path(path: Path, licence_file: str | None) -> Path | None:
    if not licence_file:
        return None
    candidate = path.parent / licence_file
    return candidate if candidate.is_file() else None


def _int(group: dict, key: str) -> int:
    value = group.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MoecacheError(f"trace_import.{key} must be an integer, got {value!r}")
    return value


def _meta_dict(meta: TraceMeta) -> dict:
    """The trace metadata without `run` (which run_metadata.json holds at its top level)."""
    return {k: v for k, v in json.loads(meta.to_json()).items() if k != "run"}
