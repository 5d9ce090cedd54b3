"""benchmarks/vs_llamacpp/bench.py: the llama.cpp comparison without llama.cpp (no build, no network): the
pure parts, and the moecache side end to end on a tiny checkpoint on the CPU.

The memory points must give both sides the same routed-expert bytes on the GPU: llama-bench's `-ncmoe N`
(the experts of blocks 0 .. N-1 in host memory) and moecache's capacity as a memory budget, which moecache's
own capacity parser must turn into exactly the slots those bytes hold. llama-bench's JSON / JSONL output
must be read into medians of its samples; bad input is one line and exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moecache.capacity import capacity_spec
from tests.benchmarks.script_module import script_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_llamacpp" / "bench.py"

# DeepSeek-V2-Lite: 27 decoder blocks, block 0 dense, 64 experts of 3 x 2048 x 1408 bf16 weights.
DSV2 = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "first_k_dense_replace": 1, "n_routed_experts": 64,
        "hidden_size": 2048, "moe_intermediate_size": 1408}  # fmt: skip
# Qwen3.6-35B-A3B's text decoder cut to 20 of its 40 blocks, every block sparse, 256 experts of 3 x 2048 x 512.
QWEN20 = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 20, "num_experts": 256, "hidden_size": 2048,
          "moe_intermediate_size": 512}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    """bench.py as a module."""
    with script_module("vs_llamacpp_bench", BENCH) as module:
        yield module


def plan(bench, config):
    blocks = bench.moe_blocks(config)
    return blocks, bench.plan_points(
        blocks, config["num_hidden_layers"], bench.num_experts(config), bench.expert_bytes(config)
    )


def test_moe_blocks_and_expert_bytes(bench):
    assert bench.moe_blocks(DSV2) == list(range(1, 27))
    assert bench.expert_bytes(DSV2) == 17301504  # conf/model/deepseek_v2_lite.yaml's expert_bytes
    assert bench.moe_blocks(QWEN20) == list(range(20))
    assert bench.expert_bytes(QWEN20) == 6291456  # conf/model/qwen3_6_35b_a3b.yaml's
    wrapped = {"text_config": dict(QWEN20, model_type="qwen3_5_moe_text")}
    assert bench.moe_blocks(wrapped) == list(range(20))
    with pytest.raises(bench.BadInput, match="model_type 'llama'"):
        bench.moe_blocks({"model_type": "llama", "num_hidden_layers": 2})


def test_dsv2_points(bench):
    blocks, points = plan(bench, DSV2)
    layer = 64 * 17301504
    got = [(p.label, p.gpu_layers, p.n_cpu_moe, p.gpu_expert_bytes, p.slots) for p in points]
    assert got == [
        ("all on GPU", 26, 0, 26 * layer, 26 * 64),
        # 13 MoE layers (blocks 1..13) in host memory: -ncmoe 14 also covers the dense block 0
        ("50%", 13, 14, 13 * layer, 13 * 64),
        # 25% of 26 layers is 6.5: rounded down, 6 layers (23.1%) on the GPU, blocks 1..20 in host memory
        ("25%", 6, 21, 6 * layer, 6 * 64),
        # every block's experts in host memory, as llama.cpp's --cpu-moe
        ("all in host", 0, 27, 0, 0),
    ]
    assert points[2].gpu_fraction == pytest.approx(6 / 26)


@pytest.mark.parametrize("config", [DSV2, QWEN20, dict(QWEN20, num_hidden_layers=40)])
def test_both_sides_hold_the_same_expert_bytes(bench, config):
    """llama-bench's rule (the last blocks' experts on the GPU) and moecache's capacity parser both give
    exactly the planned layers / slots, and the bytes are the same."""
    blocks, points = plan(bench, config)
    experts, size = bench.num_experts(config), bench.expert_bytes(config)
    for p in points:
        assert bench.gpu_layers_of(blocks, p.n_cpu_moe) == p.gpu_layers
        slots = capacity_spec(p.capacity, key="capacity").slots(
            key="capacity", num_keys=len(blocks) * experts, expert_bytes=size
        )
        assert slots == p.slots == p.gpu_layers * experts
        assert slots * size == p.gpu_expert_bytes
        assert p.gpu_layers == int(p.share * len(blocks))


def test_qwen_points(bench):
    _, points = plan(bench, QWEN20)
    assert [(p.gpu_layers, p.n_cpu_moe) for p in points] == [(20, 0), (10, 10), (5, 15), (0, 20)]
    _, points = plan(bench, dict(QWEN20, num_hidden_layers=40))
    assert [(p.gpu_layers, p.n_cpu_moe) for p in points] == [(40, 0), (20, 20), (10, 30), (0, 40)]


def test_bad_plans(bench):
    with pytest.raises(bench.BadInput, match="increasing"):
        bench.plan_points([3, 1], 4, 8, 10)
    with pytest.raises(bench.BadInput, match="below 4"):
        bench.plan_points([1, 4], 4, 8, 10)
    with pytest.raises(bench.BadInput, match="share 1.5"):
        bench.plan_points([0, 1], 2, 8, 10, shares=(("too much", 1.5),))
    with pytest.raises(bench.BadInput, match="cpu_layers=3"):
        bench.n_cpu_moe_for([0, 1], 3)


def llama_row(n_cpu_moe: int, n_prompt: int, n_gen: int, samples: list[float]) -> dict:
    """One test object as llama-bench (llama.cpp 0c1e57098) writes it with -o jsonl, every field."""
    return {
        "build_commit": "0c1e57098", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
        "model_filename": "dsv2-27l-tiny.bf16.gguf", "model_type": "deepseek2 16B BF16", "model_size": 347395840,
        "model_n_params": 173256128, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0",
        "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
        "n_cpu_moe": n_cpu_moe, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": -1,
        "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto",
        "lazy_mode": "auto", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
        "fit_target": 0, "fit_min_ctx": 0, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
        "test_time": "2026-12-05T07:51:39Z", "avg_ns": int(1e9 / (sum(samples) / len(samples))), "stddev_ns": 0,
        "avg_ts": sum(samples) / len(samples), "stddev_ts": 0.0, "samples_ns": [int(1e9 / s) for s in samples],
        "samples_ts": samples,
    }  # fmt: skip


def test_parse_llama_bench_jsonl_and_json(bench):
    rows = [llama_row(0, 512, 0, [900.0, 1000.0, 950.0]), llama_row(0, 0, 128, [80.0, 70.0, 90.0]),
            llama_row(14, 512, 0, [500.0, 400.0, 450.0]), llama_row(14, 0, 128, [30.0, 31.0, 29.0])]  # fmt: skip
    jsonl = "\n".join(json.dumps(r) for r in rows) + "\n"
    for text in (jsonl, json.dumps(rows, indent=2)):
        parsed = bench.parse_llama_bench(text)
        assert parsed == rows
        by_n = bench.summarize_llama(parsed)
        assert by_n[0]["pp"]["median_ts"] == 950.0 and by_n[0]["pp"]["test"] == "pp512"
        assert by_n[0]["tg"]["median_ts"] == 80.0 and by_n[0]["tg"]["test"] == "tg128"
        assert by_n[14]["pp"]["median_ts"] == 450.0 and by_n[14]["tg"]["samples_ts"] == [30.0, 31.0, 29.0]
    assert bench.parse_llama_bench("") == []
    # a run stopped at the device call's limit: the lines it finished are kept, a cut last line dropped
    assert bench.parse_llama_bench(jsonl + '{"build_commit": "0c1e5') == rows
    assert bench.llama_test_label(llama_row(0, 512, 128, [1.0])) == "pp512+tg128"
    assert bench.summarize_llama([llama_row(0, 512, 128, [1.0])]) == {}  # -pg tests are not pp or tg


def test_parse_llama_bench_refuses_other_text(bench):
    with pytest.raises(bench.BadInput, match="line 1: not JSON"):
        bench.parse_llama_bench("| model | size |\n| --- | --- |\n")
    with pytest.raises(bench.BadInput, match="without samples_ts"):
        bench.parse_llama_bench(json.dumps([{"n_prompt": 512}]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["llama", "--shape", "dsv2", "--checkpoint", "/nonexistent", "--gguf", "x", "--llama-bench", "y"],
         "config.json"),
        (["moecache", "--shape", "dsv2", "--checkpoint", "/nonexistent", "--reps", "0"], "--reps 0"),
        (["moecache", "--shape", "dsv2", "--checkpoint", "/nonexistent", "--stream-min-tokens", "-1"],
         "--stream-min-tokens -1"),
        (["moecache", "--shape", "dsv2", "--checkpoint", "/nonexistent", "--stream-min-tokens", "some"],
         "--stream-min-tokens some: expected auto or an integer >= 0"),
        (["report", "--results", "/nonexistent", "--shapes", "qwen"], "no results of qwen"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(bench, capsys, argv, message):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("vs_llamacpp: ")


def test_the_moecache_side_default_compiled_and_static_layers_in_one_report(
    bench, tmp_path, monkeypatch, capsys
):
    """A tiny DeepSeek-V2 checkpoint written by `write`, the moecache side measured at every point through
    its loader, once as generate runs by default, once with `--compile` (runtime.compile=true; dynamo's
    eager backend here: the compiled step's path, not inductor's speed) and once with `--policy
    static_layers` (llama.cpp's placement), saved apart; `report` puts each decode beside the default's at
    every point and for the unmodified model."""
    import torch

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    common = ["--shape", "dsv2", "--checkpoint", str(ckpt), "--device", "cpu", "--reps", "1", "--pp", "8",
              "--tg", "4", "--threads", "1", "--results", str(results)]  # fmt: skip
    assert bench.main(["write", "--shape", "dsv2", "--size", "tiny", "--device", "cpu", "--layers", "3",
                       "--out", str(ckpt)]) == 0  # fmt: skip
    try:
        assert bench.main(["moecache", *common]) == 0
        assert bench.main(["moecache", *common, "--compile", "--no-unmodified"]) == 0
        assert bench.main(["moecache", *common, "--policy", "static_layers", "--no-unmodified"]) == 0
        assert bench.main(["moecache", *common, "--stream-min-tokens", "1", "--no-unmodified"]) == 0
    finally:
        torch._dynamo.reset()
    default = json.loads((results / "dsv2-moecache.json").read_text())
    compiled = json.loads((results / "dsv2-moecache-compiled.json").read_text())
    assert default["compile"] is False and compiled["compile"] is True and compiled["unmodified"] is None
    # the decode test's host points: every expert in host memory, one CPU call per MoE layer and token,
    # the executor's share of each call timed on its own
    host = default["points"][-1]["own"]["tg"]["host"]
    assert default["points"][-1]["slots"] == 0
    assert host["cpu_calls_per_token"] == default["model"]["num_layers"]
    assert host["cpu_path_us_per_call"] > host["cpu_exec_us_per_call"] > 0
    split = json.loads((results / "dsv2-moecache-static_layers.json").read_text())
    assert split["policy"] == "static_layers" and default["policy"] != "static_layers"
    streamed = json.loads((results / "dsv2-moecache-stream.json").read_text())
    # generate's default (auto) streams nothing on the CPU stand-in
    assert streamed["stream_min_tokens"] == 1 and default["stream_min_tokens"] == 0
    assert default["stream_option"] == "auto" and streamed["stream_option"] == 1
    assert streamed["points"][-1]["own"]["pp"]["streamed_experts"] > 0  # every expert in host memory
    assert default["points"][-1]["own"]["pp"]["streamed_experts"] == 0
    capsys.readouterr()
    summary = bench.report(results, ["dsv2"])["shapes"]["dsv2"]
    table = capsys.readouterr().out
    assert "| compiled tg | compiled forced tg | static_layers tg | static_layers compiled tg |" in table
    assert (
        "| forced pp | streamed pp | streamed forced pp | compiled pp | compiled streamed pp | llama.cpp tg |"
        in table
    )
    assert [p["point"] for p in summary["points"]] == [p["label"] for p in default["points"]]
    for row, d, c, s, st in zip(
        summary["points"],
        default["points"],
        compiled["points"],
        split["points"],
        streamed["points"],
        strict=True,
    ):
        assert row["moecache_tg"] == d["own"]["tg"]["median_ts"] > 0
        assert row["streamed_pp"] == st["own"]["pp"]["median_ts"] > 0
        assert row["compiled_tg"] == c["own"]["tg"]["median_ts"] > 0
        assert row["compiled_pp"] == c["own"]["pp"]["median_ts"] > 0 and row["compiled_streamed_pp"] is None
        assert row["static_layers_tg"] == s["own"]["tg"]["median_ts"] > 0
        assert row["static_layers_compiled_tg"] is None
        assert row["compiled_forced_tg"] is None and row["llama_tg"] is None
    assert summary["unmodified"]["tg"] > 0 and summary["compiled_unmodified_tg"] is None
    # a folder holding only a compiled streamed run (run before llama.cpp's): its points and prefill
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "dsv2-moecache-stream-compiled.json").write_text(json.dumps(streamed))
    lone = bench.report(alone, ["dsv2"])["shapes"]["dsv2"]
    rows = lone["points"]
    assert lone["moecache"]["policy"] == streamed["policy"] and lone["checkpoint"] == streamed["checkpoint"]
    assert [r["compiled_streamed_pp"] for r in rows] == [
        p["own"]["pp"]["median_ts"] for p in streamed["points"]
    ]
    assert all(r["streamed_pp"] is None and r["llama_pp"] is None for r in rows)


def test_each_moecache_column_is_set_against_llamacpps(bench):
    """`ratios`: each moecache pp column over llama.cpp's pp, each tg column over its tg; None where
    either side did not run."""
    row = {"llama_pp": 200.0, "llama_tg": 50.0, "moecache_pp": 300.0, "forced_pp": None, "moecache_tg": 40.0,
           "forced_tg": 60.0, "compiled_tg": 50.0, "compiled_forced_tg": None, "static_layers_tg": None,
           "static_layers_compiled_tg": 55.0, "streamed_pp": 500.0, "streamed_forced_pp": None, "compiled_pp": 100.0,
           "compiled_streamed_pp": None}  # fmt: skip
    assert bench.ratios(row) == {
        "moecache_pp": 1.5, "forced_pp": None, "streamed_pp": 2.5, "streamed_forced_pp": None, "compiled_pp": 0.5,
        "compiled_streamed_pp": None, "moecache_tg": 0.8, "forced_tg": 1.2, "compiled_tg": 1.0,
        "compiled_forced_tg": None, "static_layers_tg": None, "static_layers_compiled_tg": 1.1,
    }  # fmt: skip
    assert set(bench.ratios({**row, "llama_tg": None}).values()) == {1.5, 2.5, 0.5, None}


def test_the_report_sets_the_host_probes_side_by_side_and_says_when_the_host_drifted(bench, tmp_path, capsys):
    """run.sh's probes (bench_cpu_experts.py's JSON line before and after each side's run) in the summary;
    a spread above HOST_DRIFT is said in the table's text, one within it is not."""
    results = tmp_path / "results"
    results.mkdir()
    point = {"label": "50%", "share": 0.5, "gpu_fraction": 0.5, "gpu_expert_bytes": 1, "n_cpu_moe": 1,
             "capacity": "1B", "slots": 1, "pp": {"median_ts": 10.0}, "tg": {"median_ts": 5.0}}  # fmt: skip
    (results / "dsv2-llama.json").write_text(json.dumps({"points": [point]}))

    def probe(run: str, when: str, us: float) -> None:
        line = {"bench": "cpu_experts", "rows": [{"call_median_us": us, "experts": 8, "tokens": 1}]}
        (results / f"dsv2-{run}-host-{when}.json").write_text(json.dumps(line))

    probe("llama", "before", 450.0)
    probe("llama", "after", 460.0)
    probe("moecache-compiled", "before", 470.0)
    (results / "dsv2-moecache-compiled-host-after.json").write_text("")  # a probe that failed
    summary = bench.report(results, ["dsv2"])["shapes"]["dsv2"]
    out = capsys.readouterr().out
    assert summary["host_probes_us"] == {"llama": {"before": 450.0, "after": 460.0},
                                         "moecache-compiled": {"before": 470.0}}  # fmt: skip
    assert summary["host_drift"] == pytest.approx(470 / 450 - 1)
    assert "  moecache-compiled: 470.0 / -" in out and "moved" not in out
    probe("moecache-compiled", "after", 650.0)
    summary = bench.report(results, ["dsv2"])["shapes"]["dsv2"]
    assert summary["host_drift"] == pytest.approx(650 / 450 - 1)
    assert "the host's speed moved by 44% across these runs" in capsys.readouterr().out
