"""The opt-in, asynchronous routing logger.

The inference path calls `RoutingLogger.log(layer_id, expert_ids_TK, weights_TK)` from a router hook.
That call only appends one compact record (the step context, the layer and references to the two
small tensors the router returned) to a bounded buffer: no copy, no device sync, no I/O. A background
thread copies batches of records to the host (one device-to-host copy per batch on CUDA), expands
them into one row per (token, layer) and writes Parquet row groups and/or JSON Lines.

With the logit lens on (moecache/trace/lens.py), a record also carries the lens tokens of the step's
sampled rows: their row indices (host) and a small int tensor of token ids that the router hook's
thread computed (still on the device, no sync); the writer copies them with the routing and writes
them to the `lens_token` column (null for the rows not sampled).

A full buffer is never a silent drop: `on_overflow="raise"` raises `RoutingLogOverflow` in the
inference path; `on_overflow="block"` applies back-pressure (the inference path waits for the writer)
and the number of such waits and the time spent are counted in `stats`. `close()` writes every
record, or raises if any was lost.

Legend: T tokens routed in one forward step, K top-k.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moecache.errors import MoecacheError
from moecache.trace.schema import CACHE_COLUMNS, LENS_COLUMN, SCHEMA, TraceMeta, schema_with_meta

FORMATS = ("parquet", "jsonl")
OVERFLOW_MODES = ("raise", "block")
PARQUET_NAME = "trace.parquet"
JSONL_NAME = "trace.jsonl"


class RoutingLogOverflow(MoecacheError):
    """The bounded record buffer was full and `on_overflow` is `raise`."""


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    formats: tuple[str, ...] = FORMATS
    queue_size: int = 4096
    on_overflow: str = "raise"
    row_group_rows: int = 65536

    def __post_init__(self):
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise MoecacheError(f"logging.formats={list(self.formats)}: each must be one of {list(FORMATS)}")
        if self.on_overflow not in OVERFLOW_MODES:
            raise MoecacheError(
                f"logging.on_overflow={self.on_overflow!r}: expected one of {list(OVERFLOW_MODES)}"
            )
        if self.queue_size < 1:
            raise MoecacheError(f"logging.queue_size={self.queue_size}: must be at least 1")
        if self.row_group_rows < 1:
            raise MoecacheError(f"logging.row_group_rows={self.row_group_rows}: must be at least 1")

    @classmethod
    def from_cfg(cls, cfg) -> LoggerConfig:
        return cls(
            formats=tuple(cfg.formats),
            queue_size=int(cfg.queue_size),
            on_overflow=str(cfg.on_overflow),
            row_group_rows=int(cfg.row_group_rows),
        )


@dataclass(frozen=True)
class StepContext:
    """Where the next routing decisions belong: set once per forward step by the caller."""

    request_id: str
    step_index: int
    phase: str  # "prefill" | "decode"
    first_token_index: int  # token_index of the step's first token within the request


@dataclass
class LoggerStats:
    records_in: int = 0
    records_written: int = 0
    rows_written: int = 0
    overflow_events: int = 0  # times the buffer was full
    blocked_seconds: float = 0.0  # inference-path time spent waiting on a full buffer (block mode)


@dataclass(slots=True)
class _Record:
    ctx: StepContext
    layer_id: int
    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    lens_rows_N: np.ndarray | None = None  # int64 rows (0..T-1) of the step that the lens sampled
    lens_tokens_N: torch.Tensor | None = None  # their lens token ids, same order
    # The runtime's visit (moecache/runtime/manager.py VisitResult): anything with
    # `cache_fields(num_experts) -> list[dict]`, one dict of cache columns per row; None: no cache ran.
    cache: object | None = None


WAKE_INTERVAL_S = 0.05


class RoutingLogger:
    """Collects routing records in memory and writes them from a background thread."""

    def __init__(self, out_dir: str | Path, meta: TraceMeta, run_id: str, config: LoggerConfig | None = None):
        self.config = config or LoggerConfig()
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.run_id = run_id
        self.stats = LoggerStats()
        self._ctx: StepContext | None = None
        # The bounded buffer: a deque (append/popleft are atomic) whose length the producer checks.
        # The writer wakes when it is half full or every WAKE_INTERVAL_S, not once per record.
        self._buf: deque[_Record] = deque()
        self._wake = threading.Event()
        self._space = threading.Condition()
        self._capacity = self.config.queue_size
        self._wake_at = max(1, self.config.queue_size // 2)
        self._stopping = False
        self._error: BaseException | None = None
        self._closed = False
        self._parquet: pq.ParquetWriter | None = None
        self._jsonl = open(self.out_dir / JSONL_NAME, "w") if "jsonl" in self.config.formats else None  # noqa: SIM115
        if "parquet" in self.config.formats:
            self._parquet = pq.ParquetWriter(self.out_dir / PARQUET_NAME, schema_with_meta(meta))
        self._pending: list[_Record] = []
        self._pending_rows = 0
        self._thread = threading.Thread(target=self._writer_loop, name="moecache-routing-writer", daemon=True)
        self._thread.start()

    # ---- inference path -------------------------------------------------------------------------

    def set_step(self, ctx: StepContext) -> None:
        self._ctx = ctx

    def log(
        self,
        layer_id: int,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        lens_rows_N: np.ndarray | None = None,
        lens_tokens_N: torch.Tensor | None = None,
        cache: object | None = None,
    ) -> None:
        """Record one layer's routing for the current step. Never waits on I/O. `lens_rows_N` (host
        int64, rows of this step) and `lens_tokens_N` (their logit-lens token ids, any device): the
        rows with a `lens_token`; the other rows get null. `cache`: the runtime's result of this visit
        (its `cache_fields` fill the cache columns; read by the writer thread, when the visit's copies
        have had time to complete, so `copy_ready_ns` is known); None leaves them null."""
        if self._error is not None:
            raise MoecacheError(f"routing log writer failed: {self._error}") from self._error
        if self._closed:
            raise MoecacheError("routing logger is closed")
        if self._ctx is None:
            raise MoecacheError("routing logger: log() before set_step(): the step is unknown")
        if len(self._buf) >= self._capacity:
            self._on_full()
        # Keep references only: routers return fresh tensors that nothing writes to afterwards. Device
        # tensors are copied to the host by the writer thread, in batches, off the inference path.
        if weights_TK.requires_grad:
            weights_TK = weights_TK.detach()
        if (lens_rows_N is None) != (lens_tokens_N is None):
            raise MoecacheError("routing logger: lens_rows_N and lens_tokens_N go together")
        self._buf.append(
            _Record(self._ctx, layer_id, expert_ids_TK, weights_TK, lens_rows_N, lens_tokens_N, cache)
        )
        self.stats.records_in += 1
        if len(self._buf) >= self._wake_at:
            self._wake.set()

    def _on_full(self) -> None:
        self.stats.overflow_events += 1
        if self.config.on_overflow == "raise":
            raise RoutingLogOverflow(
                f"routing log buffer full ({self.config.queue_size} records, overflow #{self.stats.overflow_events}): "
                "the writer cannot keep up; raise logging.queue_size or set logging.on_overflow=block"
            )
        start = time.perf_counter()
        with self._space:
            while len(self._buf) >= self.config.queue_size and self._error is None:
                self._wake.set()
                self._space.wait(timeout=WAKE_INTERVAL_S)
        self.stats.blocked_seconds += time.perf_counter() - start
        if self._error is not None:
            raise MoecacheError(f"routing log writer failed: {self._error}") from self._error

    # ---- writer thread --------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        try:
            while True:
                self._wake.wait(timeout=WAKE_INTERVAL_S)
                self._wake.clear()
                stopping = self._stopping  # read before draining: records logged before close() are in _buf
                batch = []
                while self._buf:
                    batch.append(self._buf.popleft())
                    if self.config.on_overflow == "block":
                        with self._space:
                            self._space.notify_all()
                _to_host(batch)
                for item in batch:
                    self._pending.append(item)
                    self._pending_rows += item.expert_ids_TK.shape[0]
                    if self._pending_rows >= self.config.row_group_rows:
                        self._flush()
                if stopping:
                    self._flush()
                    return
        except BaseException as exc:  # surfaced by log() and close()
            self._error = exc

    def _flush(self) -> None:
        if not self._pending:
            return
        table = self._records_to_table(self._pending)
        if self._parquet is not None:
            self._parquet.write_table(table, row_group_size=self.config.row_group_rows)
        if self._jsonl is not None:
            self._jsonl.write(_table_to_jsonl(table))
        self.stats.records_written += len(self._pending)
        self.stats.rows_written += table.num_rows
        self._pending = []
        self._pending_rows = 0

    def _records_to_table(self, records: list[_Record]) -> pa.Table:
        counts = np.array([r.expert_ids_TK.shape[0] for r in records], dtype=np.int64)
        n = int(counts.sum())
        ids_NK = np.concatenate([r.expert_ids_TK.numpy() for r in records]).astype(np.int16)
        w_NK = np.concatenate([r.weights_TK.numpy() for r in records]).astype(np.float32)
        k = ids_NK.shape[1]
        offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
        first = np.repeat(np.array([r.ctx.first_token_index for r in records], dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        columns = {
            "run_id": pa.array([self.run_id] * n, pa.string()),
            "request_id": pa.array(
                np.repeat([r.ctx.request_id for r in records], counts).tolist(), pa.string()
            ),
            "step_index": pa.array(np.repeat([r.ctx.step_index for r in records], counts).astype(np.int32)),
            "token_index": pa.array((first + np.arange(n) - starts).astype(np.int32)),
            "phase": pa.array(np.repeat([r.ctx.phase for r in records], counts).tolist(), pa.string()),
            "layer_id": pa.array(np.repeat([r.layer_id for r in records], counts).astype(np.int16)),
            "expert_ids": pa.ListArray.from_arrays(offsets, pa.array(ids_NK.reshape(-1))),
            "router_weights": pa.ListArray.from_arrays(offsets, pa.array(w_NK.reshape(-1))),
        }
        columns.update(self._cache_columns(records, counts))
        columns[LENS_COLUMN] = _lens_column(records, counts)
        return pa.table(columns, schema=SCHEMA)

    def _cache_columns(self, records: list[_Record], counts: np.ndarray) -> dict[str, pa.Array]:
        """The cache columns: from each record's runtime visit where one ran, null elsewhere."""
        n = int(counts.sum())
        if all(r.cache is None for r in records):
            return {name: pa.nulls(n, SCHEMA.field(name).type) for name in CACHE_COLUMNS}
        values: dict[str, list] = {name: [] for name in CACHE_COLUMNS}
        for record, rows in zip(records, counts.tolist(), strict=True):
            fields = record.cache.cache_fields(self.meta.num_experts) if record.cache is not None else None
            if fields is not None and len(fields) != rows:
                raise MoecacheError(
                    f"routing logger: layer {record.layer_id}'s cache record has {len(fields)} rows, "
                    f"its routing {rows}"
                )
            for name in CACHE_COLUMNS:
                values[name].extend([row[name] for row in fields] if fields is not None else [None] * rows)
        return {name: pa.array(values[name], SCHEMA.field(name).type) for name in CACHE_COLUMNS}

    # ---- shutdown -------------------------------------------------------------------------------

    def close(self) -> LoggerStats:
        """Write every queued record and close the files. Raises if any record was not written."""
        if self._closed:
            return self.stats
        self._closed = True
        self._stopping = True
        self._wake.set()
        self._thread.join()
        if self._parquet is not None:
            self._parquet.close()
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
            self._jsonl.close()
        if self._error is not None:
            raise MoecacheError(f"routing log writer failed: {self._error}") from self._error
        if self.stats.records_written != self.stats.records_in:
            raise MoecacheError(
                f"routing logger wrote {self.stats.records_written} of {self.stats.records_in} records"
            )
        return self.stats

    def stats_dict(self) -> dict:
        return asdict(self.stats)

    def __enter__(self) -> RoutingLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_host(batch: list[_Record]) -> None:
    """Replace the records' tensors by host float32 / int64 copies: one concatenation and one
    device-to-host copy per batch for device tensors (this waits for the GPU on the writer thread);
    likewise one copy for the lens tokens of the records that have them."""
    if not batch:
        return
    counts = [r.expert_ids_TK.shape[0] for r in batch]
    ids_NK = torch.cat([r.expert_ids_TK for r in batch]).to("cpu", torch.int64)
    w_NK = torch.cat([r.weights_TK for r in batch]).to("cpu", torch.float32)
    for r, ids_TK, w_TK in zip(batch, ids_NK.split(counts), w_NK.split(counts), strict=True):
        r.expert_ids_TK, r.weights_TK = ids_TK, w_TK
    lensed = [r for r in batch if r.lens_tokens_N is not None]
    if lensed:
        lens_N = torch.cat([r.lens_tokens_N.reshape(-1) for r in lensed]).to("cpu", torch.int64)
        for r, tokens_N in zip(lensed, lens_N.split([r.lens_tokens_N.numel() for r in lensed]), strict=True):
            r.lens_tokens_N = tokens_N


def _lens_column(records: list[_Record], counts: np.ndarray) -> pa.Array:
    """int32 `lens_token` of the records' rows: the lens token where sampled, else null."""
    n = int(counts.sum())
    if all(r.lens_tokens_N is None for r in records):
        return pa.nulls(n, SCHEMA.field(LENS_COLUMN).type)
    tokens_N = np.zeros(n, np.int32)
    valid_N = np.zeros(n, bool)
    start = 0
    for r, count in zip(records, counts.tolist(), strict=True):
        if r.lens_tokens_N is not None:
            rows = start + np.asarray(r.lens_rows_N, np.int64)
            tokens_N[rows] = r.lens_tokens_N.numpy()
            valid_N[rows] = True
        start += count
    return pa.array(tokens_N, pa.int32(), mask=~valid_N)


def _table_to_jsonl(table: pa.Table) -> str:
    """One JSON object per row, keys in schema order; float32 weights written exactly (as float64 text)."""
    cols = table.to_pydict()
    names = table.column_names
    lines = [
        json.dumps({name: cols[name][i] for name in names}, separators=(",", ":"))
        for i in range(table.num_rows)
    ]
    return "\n".join(lines) + "\n"
