"""`moecache validate` on CUDA (GPU marker; run on the H200): the tiny model in fp32 with the slot pool in
device memory and the slot-pool kernel, every strategy at a quarter of the experts. Every offloaded run's
teacher-forced logits agree with transformers' eager loop (fp32: the same top-1 token everywhere), peak
CUDA memory is measured, and on_miss="wait" waits for real copies."""

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
    folder = Path(res.stdout.strip().splitlines()[-1])
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    by = {(r["strategy"], r["capacity"]): r for r in runs}
    assert len(runs) == 7
    for key, r in by.items():
        assert r["peak_cuda_bytes"] is not None and r["peak_cuda_bytes"] > 0, key
    agreement = pq.read_table(folder / "agreement.parquet").to_pylist()
    # the grouped_mm baseline, the eager tolerance, then every offloaded run (test_validate_stage.py)
    assert [r["kind"] for r in agreement] == ["baseline", "tolerance"] + ["moecache"] * 6
    for r in agreement:
        assert r["top1_agreement"] == 1.0 and r["max_abs_logit_error"] < 1e-3, r["run"]
    assert by[("all_cpu", "0")]["hit_rate"] == 0.0 and by[("all_resident", "all")]["hit_rate"] == 1.0
    sync = by[("lru_sync", "25%")]
    assert 0 < sync["waited_copies"] <= sync["copies"]


def test_forced_fast_loop_on_cuda_replays_graphs_and_routes_the_forcing_trace(tmp_path):
    """The ESFT law trace forcing a random DeepSeek-V2-Lite-shaped model in bf16 on CUDA (tiny width),
    validate.loop=fast: the offloaded runs decode through CUDA graphs (fast-graphs), the unmodified
    reference eagerly (its routers are forced by hooks); every trace holds the forcing trace's ids."""
    import numpy as np

    from tests.validation import test_validate_forced as f

    if not f.ESFT.is_file():
        pytest.skip("needs ../shared (the ESFT traces)")
    root = f.imported(tmp_path)
    res = f.run(
        root, "device=cuda", "model.dtype=bfloat16", "model.experts_implementation=null",
        f"validate.forced_trace={f.trace_id(root)}", f"validate.forced_requests={f.REQUESTS}",
        "validate.forced_max_tokens=12", "validate.capacities=[25%]", f.STRATEGIES, "validate.loop=fast",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    runs = {(r["strategy"], r["capacity"]): r for r in pq.read_table(folder / "runs.parquet").to_pylist()}
    forced, table = f.forcing_rows(root / "import_trace" / f.trace_id(root))
    rids = forced.request_ids[: f.REQUESTS]
    want = f.per_request(table, rids)
    for key, r in runs.items():
        assert r["loop"] == ("fast-eager" if key[0] == "unmodified" else "fast-graphs"), key
        assert r["peak_cuda_bytes"] > 0 and r["decode_tokens_per_s"] > 0, key
        got = f.per_request(f.read_trace(folder / r["trace"])[0], rids)
        for rid, (ids, _) in got.items():
            assert np.array_equal(ids, want[rid][0][:, : ids.shape[1]]), key
        if key[0] != "unmodified":
            assert r["forced_rows_checked"] == f.REQUESTS * (f.PROMPT + 12 - 1) * f.L, key
    assert runs[("all_cpu", "0")]["hit_rate"] == 0.0 and runs[("all_resident", "all")]["hit_rate"] == 1.0
