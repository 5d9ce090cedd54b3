"""benchmarks/bench_agreement.py on a narrow DeepSeek-V2-Lite-shaped model forced by the real law trace: the
baseline is transformers' default grouped_mm path, eager its tolerance, every moecache run compared with
each (its verdict against the baseline) and with the float32 truth; the baseline as its own tolerance is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_agreement.py"
TRACE = REPO.parent / "shared" / "data" / "traces" / "deepseek-v2-lite-esft" / "esft_law_routing.npz"
NARROW = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_attention_heads": 2,
          "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
          "v_head_dim": 8}  # fmt: skip
ARGS = ["--model", str(REPO / "conf/model/deepseek_v2_lite.yaml"), "--layers", "3",
        "--vocab", "320", "--device", "cpu", "--trace", str(TRACE), "--requests", "1", "--positions", "12",
        "--prompt-tokens", "6", "--capacities", "25%", "--overrides", json.dumps(NARROW)]  # fmt: skip


def run(monkeypatch, capsys, *extra: str) -> dict:
    return run_script(monkeypatch, capsys, SCRIPT, [*ARGS, *extra])


@pytest.mark.skipif(not TRACE.exists(), reason="needs ../shared's traces")
def test_moecache_is_compared_with_the_default_path_and_held_to_eagers_distance(monkeypatch, capsys):
    result = run(monkeypatch, capsys)
    assert result["baseline"] == "grouped_mm" and result["impls"] == ["eager"]
    rows = {(r["run"], r["vs"]): r for r in result["rows"]}
    tolerance = rows[("eager", "grouped_mm")]
    assert tolerance["positions"] == 12 and tolerance["mean_abs_logit_error"] > 0
    assert {("grouped_mm", "fp32"), ("eager", "fp32")} <= set(rows)
    mine = {vs: r for (run, vs), r in rows.items() if run == "moecache 25% lru"}
    assert set(mine) == {"grouped_mm", "eager", "fp32"}
    assert mine["grouped_mm"]["gpu_entries"] > 0 < mine["grouped_mm"]["cpu_entries"]  # both halves ran
    within = mine["grouped_mm"]["within"]["eager"]
    assert result["within"] == all(within.values())
    assert within["mean_abs_logit_error"] == (
        mine["grouped_mm"]["mean_abs_logit_error"] <= tolerance["mean_abs_logit_error"]
    )


def test_the_baseline_cannot_be_its_own_tolerance(monkeypatch, capsys):
    with pytest.raises(SystemExit, match="cannot be its own tolerance"):
        run(monkeypatch, capsys, "--impls", "grouped_mm")
