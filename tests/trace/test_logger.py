"""The routing logger: completeness, both formats agree, overflow is explicit, errors surface."""

import json
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from moecache.errors import MoecacheError
from moecache.trace.logger import LoggerConfig, RoutingLogger, RoutingLogOverflow, StepContext
from moecache.trace.schema import SCHEMA, TraceMeta, read_trace

META = TraceMeta(num_layers=3, num_experts=16, top_k=4, expert_bytes=1024, model="test")


def _feed(logger: RoutingLogger, steps: list[int], seed: int = 0) -> list[tuple]:
    """Log `len(steps)` forward steps of one request (T tokens each) over 3 layers; return the
    expected rows (step, token, layer, ids, weights) in canonical order."""
    gen = torch.Generator().manual_seed(seed)
    expected, token = [], 0
    for step, t in enumerate(steps):
        logger.set_step(StepContext("req-0", step, "prefill" if step == 0 else "decode", token))
        for layer in range(3):
            ids_TK = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(t)])
            w_TK = torch.rand(t, 4, generator=gen)
            logger.log(layer, ids_TK, w_TK)
            for i in range(t):
                expected.append((step, token + i, layer, ids_TK[i].tolist(), w_TK[i].tolist()))
        token += t
    return expected


def test_every_record_is_written_in_both_formats(tmp_path):
    logger = RoutingLogger(tmp_path, META, "run-x", LoggerConfig(row_group_rows=7))
    expected = _feed(logger, [5, 1, 1, 1, 3])
    stats = logger.close()
    assert stats.records_in == stats.records_written == 5 * 3
    assert stats.rows_written == len(expected) == (5 + 1 + 1 + 1 + 3) * 3

    table, meta = read_trace(tmp_path / "trace.parquet")
    assert meta.num_experts == 16 and meta.top_k == 4
    assert table.schema.remove_metadata() == SCHEMA
    rows = table.to_pylist()
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(rows) == len(lines) == len(expected)
    for row, line, (step, token, layer, ids, w) in zip(rows, lines, expected, strict=False):
        assert (row["step_index"], row["token_index"], row["layer_id"]) == (step, token, layer)
        assert row["expert_ids"] == ids
        np.testing.assert_array_equal(np.float32(row["router_weights"]), np.float32(w))
        assert row["phase"] == ("prefill" if step == 0 else "decode")
        assert row["run_id"] == "run-x" and row["request_id"] == "req-0"
        assert row["cache_hit"] is None and row["copy_bytes"] is None
        # JSONL and Parquet hold the same values, float32 weights exactly
        assert line == row


def test_formats_are_configurable(tmp_path):
    logger = RoutingLogger(tmp_path, META, "r", LoggerConfig(formats=("jsonl",)))
    _feed(logger, [2])
    logger.close()
    assert (tmp_path / "trace.jsonl").exists() and not (tmp_path / "trace.parquet").exists()
    with pytest.raises(MoecacheError, match="logging.formats"):
        LoggerConfig(formats=("csv",))
    with pytest.raises(MoecacheError, match="logging.on_overflow"):
        LoggerConfig(on_overflow="drop")


class _StalledLogger(RoutingLogger):
    """A logger whose writer stops at its first flush until `release` is set."""

    def __init__(self, *a, **kw):
        self.release = threading.Event()
        self.entered = threading.Event()
        super().__init__(*a, **kw)

    def _flush(self):
        self.entered.set()
        self.release.wait(timeout=30)
        super()._flush()


def test_overflow_raises_and_is_counted(tmp_path):
    logger = _StalledLogger(tmp_path, META, "r", LoggerConfig(queue_size=1, row_group_rows=1))
    ids, w = torch.arange(4).view(1, 4), torch.ones(1, 4)
    logger.set_step(StepContext("q", 0, "decode", 0))
    logger.log(0, ids, w)  # taken by the writer, which stalls in its flush
    assert logger.entered.wait(timeout=30)
    logger.log(1, ids, w)  # fills the one-slot queue
    with pytest.raises(RoutingLogOverflow, match="buffer full"):
        logger.log(2, ids, w)
    assert logger.stats.overflow_events == 1
    logger.release.set()
    stats = logger.close()
    # nothing accepted was lost; the refused record was never counted as accepted
    assert stats.records_in == stats.records_written == 2


def test_block_mode_applies_back_pressure_without_loss(tmp_path):
    logger = _StalledLogger(
        tmp_path, META, "r", LoggerConfig(queue_size=1, row_group_rows=1, on_overflow="block")
    )
    ids, w = torch.arange(4).view(1, 4), torch.ones(1, 4)
    logger.set_step(StepContext("q", 0, "decode", 0))
    logger.log(0, ids, w)
    assert logger.entered.wait(timeout=30)
    logger.log(1, ids, w)
    threading.Timer(0.2, logger.release.set).start()
    logger.log(2, ids, w)  # waits for the writer instead of dropping
    stats = logger.close()
    assert stats.overflow_events == 1 and stats.blocked_seconds > 0
    assert stats.records_written == 3
    assert pq.read_table(tmp_path / "trace.parquet").num_rows == 3


def test_writer_failure_is_raised_not_swallowed(tmp_path):
    class Broken(RoutingLogger):
        def _flush(self):
            if self._pending:
                raise OSError("disk full")

    logger = Broken(tmp_path, META, "r", LoggerConfig(row_group_rows=1))
    logger.set_step(StepContext("q", 0, "decode", 0))
    logger.log(0, torch.arange(4).view(1, 4), torch.ones(1, 4))
    with pytest.raises(MoecacheError, match="disk full"):
        logger.close()


def test_log_before_step_is_an_error(tmp_path):
    logger = RoutingLogger(tmp_path, META, "r")
    with pytest.raises(MoecacheError, match="set_step"):
        logger.log(0, torch.arange(4).view(1, 4), torch.ones(1, 4))
    logger.close()
