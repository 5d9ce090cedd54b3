"""`moecache validate` on CUDA (GPU marker; run on the H200): the tiny model in fp32 with the slot pool in
device memory and the slot-pool kernel, every strategy at a quarter of the experts. Tokens equal the
unmodified model's, peak CUDA memory is measured, and on_miss="wait" waits for real copies."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.validation.test_validate_stage import decision, validate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_validate_on_cuda_agrees_with_the_unmodified_model(tmp_path):
    decision(tmp_path, "lfu")
    res = validate(tmp_path, "device=cuda")
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    by = {(r["strategy"], r["capacity"]): r for r in runs}
    assert len(runs) == 7
    for key, r in by.items():
        assert r["peak_cuda_bytes"] is not None and r["peak_cuda_bytes"] > 0, key
        if key[0] != "unmodified":
            assert r["token_match_rate"] == 1.0, key
            assert r["max_logit_error"] < 1e-3, key
    assert by[("all_cpu", "0")]["hit_rate"] == 0.0 and by[("all_resident", "all")]["hit_rate"] == 1.0
    sync = by[("lru_sync", "25%")]
    assert 0 < sync["waited_copies"] <= sync["copies"]
