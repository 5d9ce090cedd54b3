"""benchmarks/profile_decode.py on the tiny model, on the CPU: a profiled generation's time by kind, per
step, and the kinds its names fall into."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script, script_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_decode.py"


def test_the_tiny_model_offloaded_is_profiled_per_step(monkeypatch, capsys):
    args = ["--device", "cpu", "--new-tokens", "3", "--capacity", "50%", "--policy", "lru", "--top", "5"]
    result = run_script(monkeypatch, capsys, SCRIPT, args)
    assert (result["mode"], result["steps"], len(result["top"])) == ("split", 3, 5)
    kinds = {k["kind"]: k["us_per_step"] for k in result["kinds"]}
    # the tiny model's projections and its routing ran, each put in its kind
    assert kinds["matmul (GEMM / GEMV)"] > 0 and kinds["routing (top-k, sort, scatter)"] > 0
    assert result["kernel_us_per_step"] > 0 and result["step_wall_us"] > 0
    assert [t["us_per_step"] for t in result["top"]] == sorted(
        (t["us_per_step"] for t in result["top"]), reverse=True
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("_gate_up_decode", "slot-pool MoE kernel"),
        ("_down_decode", "slot-pool MoE kernel"),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", "gated delta rule / conv1d"),
        ("aten::mkldnn_convolution", "gated delta rule / conv1d"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
        ("nvjet_hsh_128x64_64x4_1x2_h_bz_NNT", "matmul (GEMM / GEMV)"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("triton_poi_fused_add_mul_sigmoid_3", "fused elementwise (Inductor)"),
        ("triton_poi_fused__to_copy_add_1", "fused elementwise (Inductor)"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("aten::as_strided", "views and casts"),
        ("something_else", "other"),
    ],
)
def test_kernel_names_fall_into_their_kind(name, kind):
    with script_module("profile_decode_names", SCRIPT) as module:
        assert module.kind_of(name) == kind


def test_fewer_than_two_steps_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, capsys, SCRIPT, ["--device", "cpu", "--new-tokens", "1"])
    assert exc.value.code == 2
    assert "--new-tokens 1: at least 2" in capsys.readouterr().err
