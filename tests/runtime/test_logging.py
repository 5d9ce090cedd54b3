"""With the routing logger on, the runtime fills every cache column of the record (trace/schema.py)."""

from __future__ import annotations

import numpy as np
import torch

from moecache.trace.logger import LoggerConfig, RoutingLogger, StepContext
from moecache.trace.schema import CACHE_COLUMNS, TraceMeta, read_trace
from tests.runtime.helpers import manager


def test_logged_visits_carry_the_managers_cache_fields(tmp_path):
    m = manager("lru", 6, mode="before_visit")
    meta = TraceMeta(2, 8, 2, m.store.expert_bytes, model="toy", source="test")
    logger = RoutingLogger(tmp_path, meta, "run", LoggerConfig(formats=("parquet",)))
    routing = [np.array([[1, 2], [2, 3]]), np.array([[2, 3]]), np.array([[2, 5]])]
    visits = []
    for step, ids_TK in enumerate(routing):
        t = ids_TK.shape[0]
        logger.set_step(
            StepContext("q0", step, "prefill" if t > 1 else "decode", 0 if step == 0 else 1 + step)
        )
        for layer in (0, 1):
            r = m.visit(layer, ids_TK)
            m.commit()
            visits.append((layer, ids_TK, r))
            logger.log(layer, torch.from_numpy(ids_TK), torch.full(ids_TK.shape, 0.5), cache=r)
    logger.close()
    table, _ = read_trace(tmp_path / "trace.parquet")
    assert table.num_rows == sum(ids.shape[0] for _, ids, _ in visits)
    row = 0
    for layer, ids_TK, r in visits:
        want = r.cache_fields(8)
        for t in range(ids_TK.shape[0]):
            got = {name: table[name][row].as_py() for name in CACHE_COLUMNS}
            assert got == want[t], (layer, t)
            row += 1
    hit = table["cache_hit"].to_pylist()
    assert hit[0] == [False, False] and any(any(h) for h in hit)  # misses first, hits once copies landed
    copies = [v for v in table["copy_bytes"].to_pylist() if v]
    assert copies and all(v % m.store.expert_bytes == 0 for v in copies)
    assert all(v is not None for v in table["copy_ready_ns"].to_pylist()[:1])  # seen complete by then


def test_without_a_cache_the_columns_stay_null(tmp_path):
    meta = TraceMeta(1, 4, 1, 64, model="toy", source="test")
    logger = RoutingLogger(tmp_path, meta, "run", LoggerConfig(formats=("parquet",)))
    logger.set_step(StepContext("q0", 0, "decode", 0))
    logger.log(0, torch.tensor([[1]]), torch.tensor([[1.0]]))
    logger.close()
    table, _ = read_trace(tmp_path / "trace.parquet")
    assert all(table[name].null_count == 1 for name in CACHE_COLUMNS)
