"""Calibration on the CPU: timing primitives, the latency/bandwidth fit, CostProfile, and the calibrate stage.

Tiny shapes and few repeats keep this to seconds. No assertion compares two timings tightly.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from moecache import calibration as cal
from moecache import calibration_fit
from moecache.config import compose
from moecache.cost_profile import PROFILE_FILE, CostProfile
from moecache.errors import MoecacheError
from moecache.stages import calibrate, calibrate_runtime

SHAPE = cal.ExpertShape(hidden_size=256, moe_intermediate_size=128)
FAST = [
    "cost.repeats=3",
    "cost.warmup=1",
    "cost.tokens_per_call=[1,4,64]",
    "cost.num_pool_experts=8",
    "device=cpu",
]


def test_expert_shape_bytes() -> None:
    assert SHAPE.bytes(torch.bfloat16) == 3 * 256 * 128 * 2
    assert SHAPE.bytes(torch.float32) == 2 * SHAPE.bytes(torch.bfloat16)


def test_summarize_percentiles() -> None:
    t = cal.summarize([float(v) for v in range(1, 12)])  # 1..11
    assert (t.median_us, t.p10_us, t.p90_us, t.repeats) == (6.0, 2.0, 10.0, 11)
    with pytest.raises(ValueError):
        cal.summarize([])


def test_pool_exceeds_twice_the_cache_within_the_cap() -> None:
    assert cal.pool_experts(expert_bytes=10, cache_bytes=100, max_pool_bytes=10_000) * 10 > 200
    assert cal.pool_experts(expert_bytes=10, cache_bytes=100, max_pool_bytes=50) == 5
    assert cal.pool_experts(expert_bytes=10, cache_bytes=0, max_pool_bytes=0) == 2


def test_last_level_cache_reads_sysfs(tmp_path) -> None:
    for n, size in enumerate(["48K", "2048K", "300M"]):
        (tmp_path / f"index{n}").mkdir()
        (tmp_path / f"index{n}" / "size").write_text(size + "\n")
    assert cal.last_level_cache_bytes(tmp_path) == 300 << 20
    assert cal.last_level_cache_bytes(tmp_path / "absent") is None


def test_pool_experts_have_distinct_memory() -> None:
    gate_up_P2IH, down_PHI = cal.make_pool(SHAPE, 3, torch.bfloat16)
    assert gate_up_P2IH.shape == (3, 256, 256) and down_PHI.shape == (3, 256, 128)
    assert gate_up_P2IH[0].data_ptr() != gate_up_P2IH[1].data_ptr()
    assert gate_up_P2IH.is_contiguous() and gate_up_P2IH.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_expert_times_are_positive(dtype: torch.dtype) -> None:
    pool = cal.make_pool(SHAPE, 4, dtype)
    small = cal.time_cpu_expert(pool, tokens=1, repeats=5, warmup=1)
    large = cal.time_cpu_expert(pool, tokens=256, repeats=5, warmup=1, start=6)
    for t in (small, large):
        assert 0 < t.p10_us <= t.median_us <= t.p90_us and t.repeats == 5
    # 256 tokens do 256x the arithmetic of one; only a loose order is asserted.
    assert large.median_us > 0.5 * small.median_us


@pytest.mark.parametrize("latency_us, gbps", [(25.0, 55.0), (3.0, 12.5), (0.0, 40.0)])
def test_fit_recovers_latency_and_bandwidth(latency_us: float, gbps: float) -> None:
    sizes = [1 << 16, 1 << 20, 6 << 20, 1 << 26, 1 << 28]
    points = [(b, latency_us + b / (gbps * 1e3)) for b in sizes]
    got_latency, got_gbps = cal.fit_latency_bandwidth(points)
    assert got_latency == pytest.approx(latency_us, abs=1e-6)
    assert got_gbps == pytest.approx(gbps, rel=1e-9)


def test_fit_with_noise_and_bad_input() -> None:
    noise = [1.03, 0.97, 1.02, 0.99, 1.01]
    sizes = [1 << 16, 1 << 20, 6 << 20, 1 << 26, 1 << 28]
    points = [(b, (20.0 + b / 50e3) * f) for b, f in zip(sizes, noise, strict=True)]
    latency_us, gbps = cal.fit_latency_bandwidth(points)
    assert 15 < latency_us < 25 and 45 < gbps < 55
    with pytest.raises(ValueError):
        cal.fit_latency_bandwidth([(100, 1.0)])
    with pytest.raises(ValueError):
        cal.fit_latency_bandwidth([(100, 2.0), (200, 1.0)])


def _profile_dict() -> dict:
    """A hand-made profile (numbers chosen for easy arithmetic, not measurements)."""
    rows = [
        {
            "dtype": "bfloat16",
            "tokens_per_call": m,
            "median_us": us,
            "p10_us": us,
            "p90_us": us,
            "pool_experts": 4,
        }
        for m, us in [(1, 100.0), (4, 130.0), (16, 250.0)]
    ]
    return {
        "schema_version": 1,
        "shape": {"hidden_size": 8, "moe_intermediate_size": 4, "expert_bytes": 1_000_000},
        "dtype": "bfloat16",
        "machine": {"cpu_model": "x", "threads": 2},
        "cpu": rows,
        "cuda": None,
        "h2d": {
            "pinned": [{"bytes": 1_000_000, "median_us": 40.0, "gbps": 25.0}],
            "pageable": [{"bytes": 1_000_000, "median_us": 100.0, "gbps": 10.0}],
            "fit": {"latency_us": 20.0, "gbps": 50.0},
            "expert_bytes": 1_000_000,
        },
        "measured_at": "2026-01-01T00:00:00Z",
    }


def test_cost_profile_round_trip_and_interpolation(tmp_path) -> None:
    path = tmp_path / PROFILE_FILE
    path.write_text(json.dumps(_profile_dict()))
    profile = CostProfile.load(tmp_path)  # a folder finds its cost_profile.json
    assert profile.cpu_expert_us(1) == 100.0
    assert profile.cpu_expert_us(2) == pytest.approx(110.0)
    assert profile.cpu_expert_us(10) == pytest.approx(190.0)
    assert profile.cpu_expert_us(32) == pytest.approx(410.0)  # extrapolated with the last slope
    assert profile.cpu_expert_us(0) == 0.0
    assert profile.cuda_expert_us(1) is None
    assert profile.copy_us(1_000_000) == pytest.approx(40.0)  # 20 us + 1 MB / 50 GB/s
    assert profile.expert_copy_us() == pytest.approx(40.0)
    assert profile.pinned_at(1_000_000)["gbps"] == 25.0
    with pytest.raises(MoecacheError, match="float32"):
        profile.cpu_expert_us(1, "float32")


def test_expert_times_are_made_non_decreasing_in_tokens() -> None:
    data = _profile_dict()
    for row, us in zip(data["cpu"], [100.0, 90.0, 250.0], strict=True):  # M=4 measured faster than M=1
        row["median_us"] = us
    profile = CostProfile.from_dict(data)
    assert profile.cpu_expert_us(1) == profile.cpu_expert_us(4) == pytest.approx(95.0)
    assert profile.cpu_expert_us(2) == pytest.approx(95.0)
    assert profile.cpu_expert_us(16) == 250.0


def test_cost_profile_without_h2d_says_so() -> None:
    data = _profile_dict() | {"h2d": None}
    with pytest.raises(MoecacheError, match="device=cuda"):
        CostProfile.from_dict(data).copy_us(100)


@pytest.mark.parametrize(
    "drop, key",
    [
        (("cpu",), "'cpu'"),
        (("cpu", 1, "median_us"), "cpu[1].median_us"),
        (("h2d", "fit", "gbps"), "h2d.fit.gbps"),
    ],
)
def test_bad_profile_names_file_and_key(tmp_path, drop: tuple, key: str) -> None:
    data = copy.deepcopy(_profile_dict())
    parent = data
    for part in drop[:-1]:
        parent = parent[part]
    del parent[drop[-1]]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MoecacheError) as info:
        CostProfile.load(path)
    assert str(path) in str(info.value) and key in str(info.value)


def test_missing_or_invalid_profile_file(tmp_path) -> None:
    with pytest.raises(MoecacheError, match="nope.json"):
        CostProfile.load(tmp_path / "nope.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(MoecacheError, match="junk.json"):
        CostProfile.load(tmp_path / "junk.json")


def test_shape_from_cost_overrides_without_model_weights(tmp_path) -> None:
    cfg = compose(
        ["model=tiny", f"output_root={tmp_path}", "cost.shape.hidden_size=96", "cost.shape.dtype=float32"]
    )
    shape, dtype, _ = calibrate.resolve_shape(cfg)
    assert shape.hidden_size == 96 and dtype == "float32"


def test_calibrate_stage_writes_then_reuses(tmp_path) -> None:
    cfg = compose(["model=tiny", f"output_root={tmp_path}", *FAST])
    first = calibrate.run(cfg)
    assert not first.reused and (first.artifact / "manifest.json").is_file()
    data = json.loads((first.artifact / PROFILE_FILE).read_text())
    for key in (
        "schema_version",
        "shape",
        "dtype",
        "machine",
        "cpu",
        "cuda",
        "h2d",
        "measured_at",
        "settings",
    ):
        assert key in data
    assert data["cuda"] is None and data["h2d"] is None  # device=cpu
    assert data["machine"]["threads"] == torch.get_num_threads()
    assert {r["dtype"] for r in data["cpu"]} == {"bfloat16", "float32"}
    for row in data["cpu"]:
        assert 0 < row["p10_us"] <= row["median_us"] <= row["p90_us"] and row["pool_experts"] == 8
    profile = CostProfile.load(first.artifact / PROFILE_FILE)
    assert profile.cpu_expert_us(1) > 0 and first.summary[f"cpu us/expert M=1 {profile.dtype}"] > 0

    again = calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST]))
    assert again.reused and again.artifact == first.artifact
    assert again.summary == first.summary

    other = calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST, "cost.repeats=2"]))
    assert not other.reused and other.artifact != first.artifact


def test_calibrate_rejects_bad_settings(tmp_path) -> None:
    with pytest.raises(MoecacheError, match="cost.dtypes"):
        calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST, "cost.dtypes=[float42]"]))


# ---- schema 2: the runtime section --------------------------------------------------------------------


def _runtime_profile(overlap: str = "serial", copy_engine: dict | None = None) -> dict:
    """_profile_dict as schema 2 with a hand-made runtime section (easy arithmetic, not measurements):
    operator 10 us per resident entry at T=1 and 5 us per entry (+20) at T=4; CPU path 20 us per call
    + 5 us per expert of 1 token, 8 us of 4 tokens; visit 3 us; non-expert 100 us/layer, 20 us/token."""
    timing = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    kernel = [{"tokens": 1, "entries": n, "median_us": 10.0 * n, **timing} for n in (1, 2)]
    kernel += [{"tokens": 4, "entries": n, "median_us": 20.0 + 5.0 * n, **timing} for n in (1, 4, 8)]
    cpu = [
        {"tokens_per_expert": m, "experts": u, "median_us": 20.0 + u * per, **timing}
        for m, per in ((1, 5.0), (4, 8.0))
        for u in (1, 2)
    ]
    return _profile_dict() | {
        "schema_version": 2,
        "runtime": {
            "model": {"num_experts": 8, "top_k": 2, "expert_bytes": 1_000_000},
            "execution": {"path": "transformers", "overlap": overlap},
            "slot_moe": kernel,
            "cpu_path": cpu,
            "visit": [{"tokens": 1, "median_us": 3.0, **timing}],
            "copy_engine": copy_engine,
            "non_expert": {"moe_layers": 2, "decode_us_per_layer": 100.0, "prefill_us_per_token_per_layer": 20.0},
        },
    }  # fmt: skip


def test_schema_1_has_no_runtime_and_schema_2_reads_it() -> None:
    assert CostProfile.from_dict(_profile_dict()).runtime_costs() is None
    costs = CostProfile.from_dict(_runtime_profile()).runtime_costs()
    assert costs.cpu_call_us == pytest.approx(20.0)
    assert costs.cpu_expert_us(1) == pytest.approx(5.0) and costs.cpu_expert_us(4) == pytest.approx(8.0)
    assert list(costs.kernel_row_us(1)) == pytest.approx([0.0, 10.0, 20.0])
    assert list(costs.kernel_row_us(4)) == pytest.approx(
        [0.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0, 55.0, 60.0]
    )
    assert costs.visit_us(1) == pytest.approx(3.0) and costs.copy_us is None
    bad = _runtime_profile()
    bad["runtime"]["execution"]["overlap"] = "sometimes"
    with pytest.raises(MoecacheError, match="runtime.execution.overlap"):
        CostProfile.from_dict(bad)
    del bad["runtime"]["visit"]
    with pytest.raises(MoecacheError, match="runtime.visit"):
        CostProfile.from_dict(bad)


def _decode_trace(make_trace=None):
    """One request, 4 decode steps of one token over 2 layers x 8 experts, top-2, 1 MB experts."""
    from moecache.sim.trace_arrays import from_table
    from tests.conftest import trace_table

    tokens = [[[0, 1]], [[0, 2]], [[0, 1]], [[3, 1]]]
    steps = [(0, i, layer, tok) for i, tok in enumerate(tokens) for layer in range(2)]
    table, meta = trace_table(steps, 2, 8, 2, expert_bytes=1_000_000)
    return from_table(table, meta)


@pytest.mark.parametrize("overlap", ["serial", "parallel"])
def test_timed_replay_prices_the_runtime_step(make_trace, overlap) -> None:
    from moecache.sim.cost_model import CostModel, instant_step_us
    from moecache.sim.policy import make_policy
    from moecache.sim.replay import replay_instant
    from moecache.sim.timed import replay_timed

    trace = _decode_trace(make_trace)
    profile = CostProfile.from_dict(_runtime_profile(overlap))
    cost = CostModel.for_trace(profile, trace, non_expert_us_per_layer=0.0)  # 0.0: the measurement stays
    assert cost.non_expert_us_per_layer == 100.0 and cost.copy_us() == 0.0
    timed = replay_timed(trace, make_policy("lru"), 4, cost)
    inst = replay_instant(trace, make_policy("lru"), 4)
    assert (timed.hit_A == inst.hit_A).all()  # free copies: the stand-in's before_visit equals instant
    layer = 100.0 + 3.0
    want = []
    for s in range(trace.num_steps):
        hits = int(timed.hit_A[trace.start_V[s] : trace.start_V[s + 1]].sum())
        misses = int(trace.start_V[s + 1] - trace.start_V[s]) - hits
        gpu, cpu = 10.0 * hits, (20.0 + 5.0 * misses) if misses else 0.0
        want.append(layer + (gpu + cpu if overlap == "serial" else max(gpu, cpu)))
    assert list(timed.step_us_V) == pytest.approx(want)
    assert list(instant_step_us(trace, inst.hit_A, cost)) == pytest.approx(want)
    assert 0 < inst.hit_A.sum() < trace.num_accesses  # both halves are exercised


def test_prefill_cost_interpolates_the_measured_prompt_lengths() -> None:
    """A profile timed at two prompt lengths prices a prefill layer step by the curve through them (not
    per token x tokens from the shortest: a prefill's cost is not linear); an override still wins."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.trace_arrays import from_table
    from tests.conftest import trace_table

    data = _runtime_profile()
    timing = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    # 2 MoE layers: per layer 400 us at 10 tokens, 1,000 us at 100 tokens (20 us/token at 10 tokens)
    data["runtime"]["non_expert"]["prefill_points"] = [
        {"prompt_tokens": 10, "median_us": 800.0, **timing},
        {"prompt_tokens": 100, "median_us": 2000.0, **timing},
    ]
    profile = CostProfile.from_dict(data)
    steps = [(0, 0, layer, [[0, 1]] * 55) for layer in range(2)] + [
        (0, 1, layer, [[0, 2]]) for layer in range(2)
    ]
    table, meta = trace_table(steps, 2, 8, 2, expert_bytes=1_000_000)
    trace = from_table(table, meta)
    cost = CostModel.for_trace(profile, trace)
    prefill, decode = 400.0 + (55 - 10) * (1000.0 - 400.0) / 90, 100.0
    visit = float(cost.runtime.visit_us(55))  # the manager's visit, also per layer step
    assert list(cost.non_expert_V(trace)) == pytest.approx([prefill + visit] * 2 + [decode + 3.0] * 2)
    single = CostModel.for_trace(CostProfile.from_dict(_runtime_profile()), trace)  # one length: per token
    assert list(single.non_expert_V(trace))[:2] == pytest.approx([20.0 * 55 + visit] * 2)
    forced = CostModel.for_trace(profile, trace, non_expert_us_per_prefill_token=1.0)
    assert list(forced.non_expert_V(trace))[:2] == pytest.approx([55.0 + visit] * 2)


def test_the_prefill_curve_follows_a_non_expert_time_that_shrinks_with_the_prompt() -> None:
    """Host-bound short prompts, device-bound long ones (cost_profile._prefill_curve): per layer 2,000 us
    at 32 tokens and 800 at 512 are kept as measured, flat below 32 (a 1-token first step pays 2,000),
    flat past 512 (the slope is kept >= 0)."""
    data = _runtime_profile()
    timing = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    data["runtime"]["non_expert"]["prefill_points"] = [
        {"prompt_tokens": 32, "median_us": 4000.0, **timing},
        {"prompt_tokens": 512, "median_us": 1600.0, **timing},
    ]
    curve = CostProfile.from_dict(data).runtime_costs().non_expert_prefill_layer
    assert list(curve([1, 32, 272, 512, 1024])) == pytest.approx([2000.0, 2000.0, 1400.0, 800.0, 800.0])


def test_the_prefill_excess_is_linear_in_the_steps_tokens_where_the_prompt_is_known(make_trace) -> None:
    """runtime.cpu_step_excess with runtime.cpu_path_prefill.prompt_tokens = P: a prefill step of T tokens
    pays decode_us + (prefill_us - decode_us) (T - 1) / (P - 1), at least 0; without P, prefill_us."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.trace_arrays import DECODE, from_table
    from tests.conftest import trace_table

    steps = [(r, 0, 0, [[0, 1]] * t) for r, t in enumerate((2, 5, 9, 20))] + [(9, 1, 0, [[0, 1]])]
    table, meta = trace_table(steps, 1, 8, 2, expert_bytes=1_000_000)
    trace = from_table(table, meta)
    data = _runtime_profile()
    data["runtime"]["cpu_step_excess"] = {"decode_us": 40.0, "raw_us": 40.0, "prefill_us": 200.0}

    def excess(prompt_tokens):
        if prompt_tokens is not None:
            data["runtime"]["cpu_path_prefill"] = {"prompt_tokens": prompt_tokens, "runs": []}
        return CostModel.for_trace(CostProfile.from_dict(data), trace).cpu_excess_V(trace)

    assert (trace.phase_V == DECODE).tolist() == [False] * 4 + [True]
    assert list(excess(None)) == pytest.approx([200.0] * 4 + [40.0])
    assert list(excess(9)) == pytest.approx([60.0, 120.0, 200.0, 420.0, 40.0])
    data["runtime"]["cpu_step_excess"]["prefill_us"] = 0.0  # below decode's: the line, floored at 0
    assert list(excess(9)) == pytest.approx([35.0, 20.0, 0.0, 0.0, 40.0])


def test_copy_engine_prices_the_copies(make_trace) -> None:
    from moecache.sim.cost_model import CostModel

    engine = {"expert_bytes": 1_000_000, "per_copy_us": 50.0, "single": {}, "batch": {}}
    cost = CostModel.for_trace(
        CostProfile.from_dict(_runtime_profile(copy_engine=engine)), _decode_trace(make_trace)
    )
    assert cost.copy_us() == pytest.approx(50.0) and cost.copy_latency_us == 0.0


def test_calibrate_measures_the_runtime(tmp_path) -> None:
    fast_runtime = [
        "cost.runtime.repeats=3", "cost.runtime.warmup=1", "cost.runtime.kernel_tokens=[1,4]",
        "cost.runtime.cpu_tokens_per_expert=[1,4]", "cost.runtime.visit_tokens=[1]",
        "cost.runtime.prompt_tokens=[4,12]", "cost.runtime.decode_steps=3",
    ]  # fmt: skip
    result = calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST, *fast_runtime]))
    data = json.loads((result.artifact / PROFILE_FILE).read_text())
    rt = data["runtime"]
    assert data["schema_version"] == 2 and rt["execution"] == {
        "path": "transformers", "overlap": "serial", "device": "standin"
    }  # fmt: skip
    assert rt["model"]["num_experts"] == 32 and rt["model"]["top_k"] == 4 and rt["copy_engine"] is None
    assert rt["host_timed"] == "in_model" and rt["slots"] == 32 - 4  # E - K: misses keep K experts
    assert {(r["tokens"], r["entries"]) for r in rt["slot_moe"]} == {(1, 1), (1, 2), (1, 4)} | {
        (4, n) for n in (1, 2, 4, 8, 16)
    }
    assert {(r["tokens_per_expert"], r["experts"]) for r in rt["cpu_path"]} == {
        (1, 1),
        (1, 4),
        (4, 1),
        (4, 4),
    }
    for row in rt["slot_moe"] + rt["cpu_path"] + rt["visit"] + rt["layer_call"]:
        assert 0 < row["p10_us"] <= row["median_us"] <= row["p90_us"]
    (call,) = rt["layer_call"]  # the whole experts-module call, halves stubbed: the step's host cost
    assert call["tokens"] == 1
    ne = rt["non_expert"]
    assert ne["moe_layers"] == 4 and ne["decode_us_per_layer"] == pytest.approx(ne["decode"]["median_us"] / 4)
    assert [p["prompt_tokens"] for p in ne["prefill_points"]] == [4, 12] and ne["prompt_tokens"] == 4
    profile = CostProfile.load(result.artifact)
    assert float(profile.runtime_costs().visit_us(1)) == pytest.approx(call["median_us"])
    curve = profile.runtime_costs().non_expert_prefill_layer
    p4, p12 = (p["median_us"] / 4 for p in ne["prefill_points"])
    # as measured, not pooled: a prefill step's non-expert time may shrink as the prompt grows
    assert [float(curve(4)), float(curve(12))] == pytest.approx([p4, p12], rel=1e-6)
    assert profile.runtime_costs().kernel_row_us(1)[4] > 0
    assert result.summary["decode ms/token, all hits (model)"] > 0
    off = calibrate.run(
        compose(["model=tiny", f"output_root={tmp_path}", *FAST, "cost.runtime.enabled=false"])
    )
    assert (
        off.artifact != result.artifact
        and json.loads((off.artifact / PROFILE_FILE).read_text())["runtime"] is None
    )


@pytest.mark.parametrize("tokens", [1, 5])
def test_time_in_model_times_the_call_inside_the_forward(tmp_path, tokens: int) -> None:
    """The call runs at the MoE layers on the model's own hidden states of `tokens` rows (decode steps
    for 1, prefills for more), warmup + repeats times in order, and the experts modules come back."""
    from moecache.models import load_model

    cfg = compose(["model=tiny", f"output_root={tmp_path}", "device=cpu"])
    loaded = load_model(cfg.model, cfg.output_root, "cpu")
    cal.zero_experts(loaded.adapter)
    before = [layer.block.experts for layer in loaded.adapter.moe_layers()]
    hidden = loaded.model.config.get_text_config().hidden_size
    seen = []

    def call(n, x_TH):
        assert torch.is_inference_mode_enabled()  # as moecache validate runs the model
        seen.append((n, tuple(x_TH.shape)))

    vocab = int(loaded.model.config.get_text_config().vocab_size)
    timing = cal.time_in_model(loaded.model, loaded.adapter, tokens, call, 5, 2, vocab_size=vocab)
    assert timing.repeats == 5 and 0 < timing.p10_us <= timing.median_us <= timing.p90_us
    timed = [n for n, _ in seen][max(i for i, (n, _) in enumerate(seen) if n == 0) :]  # after the untimed run
    assert timed == list(range(len(timed))) and len(timed) >= 7 and {s for _, s in seen} == {(tokens, hidden)}
    assert [layer.block.experts for layer in loaded.adapter.moe_layers()] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_measures_the_runtime_on_cuda(tmp_path) -> None:
    """On CUDA: slot_moe timed with events, the copy engine present and priced, the stage end to end."""
    fast = [
        "model=tiny", f"output_root={tmp_path}", "device=cuda", "cost.repeats=3", "cost.warmup=1",
        "cost.tokens_per_call=[1,4]", "cost.num_pool_experts=8", "cost.copy_sizes_bytes=[65536,1048576]",
        "cost.runtime.repeats=5", "cost.runtime.warmup=2", "cost.runtime.kernel_tokens=[1,8]",
        "cost.runtime.cpu_tokens_per_expert=[1,4]", "cost.runtime.visit_tokens=[1]",
        "cost.runtime.prompt_tokens=[8]", "cost.runtime.decode_steps=5",
    ]  # fmt: skip
    result = calibrate.run(compose(fast))
    data = json.loads((result.artifact / PROFILE_FILE).read_text())
    rt = data["runtime"]
    assert rt["execution"]["device"] == "cuda" and rt["copy_engine"]["per_copy_us"] > 0
    assert rt["copy_engine"]["batch"]["copies"] == 8
    for row in rt["slot_moe"]:
        assert row["median_us"] > 0
    profile = CostProfile.load(result.artifact)
    from moecache.sim.cost_model import CostModel

    cost = CostModel.for_trace(profile, _decode_trace())
    ratio = 1_000_000 / rt["model"]["expert_bytes"]  # the test trace's experts are 1 MB
    assert cost.copy_us() == pytest.approx(rt["copy_engine"]["per_copy_us"] * ratio)


FAST_RUNTIME = [  # the operator timed at the prompts' lengths too: extrapolated past T=4 to the 8-token
    # prefill, the stand-in's operator row could exceed the whole all-resident step it is taken off
    "cost.runtime.repeats=5", "cost.runtime.warmup=1", "cost.runtime.kernel_tokens=[1,4,8]",
    "cost.runtime.cpu_tokens_per_expert=[1]", "cost.runtime.visit_tokens=[1,16]",
    "cost.runtime.prompt_tokens=[4,8]", "cost.runtime.decode_steps=3", "cost.runtime.step=fast",
    "cost.runtime.cpu_path_decode_steps=48", "cost.runtime.cpu_path_prompt_tokens=12",
]  # fmt: skip


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: on a busy 2-core machine the stand-in operator's two-thread
    calls wait for a descheduled thread (70-270 ms against 0.2 ms quiet), one thread is only slowed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_calibrate_step_fast_times_the_fast_loop_all_resident(tmp_path, one_torch_thread) -> None:
    """cost.runtime.step=fast: the non-expert time is the all-resident fast loop's step less what the
    simulator adds back to it, so the timed replay of an all-resident decode gives back exactly the
    measured step (the algebra of the profile's own numbers, not a timing comparison)."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.policy import make_policy
    from moecache.sim.timed import replay_timed
    from moecache.sim.trace_arrays import from_table
    from tests.conftest import trace_table

    result = calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST, *FAST_RUNTIME]))
    rt = json.loads((result.artifact / PROFILE_FILE).read_text())["runtime"]
    assert rt["execution"]["path"] == "fast" and rt["host_timed"] == "in_model"
    ne, costs = rt["non_expert"], CostProfile.load(result.artifact).runtime_costs()
    L, K = ne["moe_layers"], costs.top_k
    assert costs.path == "fast" and ne["decode_us_per_layer"] > 0 and ne["prefill_us_per_token_per_layer"] > 0
    back = ne["added_back_us_per_layer"]
    assert back["decode"] == pytest.approx(float(costs.visit_us(1) + costs.kernel_row_us(1)[K]), rel=1e-12)
    measured_decode = ne["measured"]["decode"]["median_us"]
    assert ne["decode_us_per_layer"] + back["decode"] == pytest.approx(measured_decode / L, rel=1e-12)
    points = zip(ne["prefill_points"], ne["measured"]["prefill_points"], back["prefill_points"], strict=True)
    for point, measured, added in points:
        t = point["prompt_tokens"]
        assert t == measured["prompt_tokens"] == added["prompt_tokens"] and point["median_us"] > 0
        assert added["us"] == pytest.approx(
            float(costs.visit_us(t) + costs.kernel_row_us(t)[t * K]), rel=1e-12
        )
        assert point["median_us"] + L * added["us"] == pytest.approx(measured["median_us"], rel=1e-12)
    # An all-resident decode replayed through the timed simulator: each token costs the measured step.
    experts = [[[(3 * i + j) % 32 for j in range(K)]] for i in range(3)]
    steps = [(0, i, layer, tok) for i, tok in enumerate(experts) for layer in range(L)]
    table, meta = trace_table(steps, L, 32, K, expert_bytes=rt["model"]["expert_bytes"])
    trace = from_table(table, meta)
    cost = CostModel.for_trace(CostProfile.load(result.artifact), trace)
    timed = replay_timed(trace, make_policy("static_cold"), L * 32, cost)
    assert timed.hit_A.all() and list(timed.forward_us_F) == pytest.approx([measured_decode] * 3, rel=1e-9)
    row = result.summary["decode ms/token, all resident (fast loop, measured)"]
    assert row == pytest.approx(result.summary["decode ms/token, all hits (model)"], rel=1e-9)
    # ... and an all-CPU one (capacity 0): each token costs the all-CPU run's step, the excess its
    # remainder over the priced step (clamped at 0: then the priced step)
    excess = rt["cpu_step_excess"]
    assert excess["decode_us"] == max(excess["raw_us"], 0.0) == costs.cpu_step_excess_us
    all_cpu = next(r for r in rt["cpu_path_prefill"]["runs"] if r["slots"] == 0)["decode"]["median_us"]
    timed = replay_timed(trace, make_policy("static_cold"), 0, cost)
    priced = all_cpu - L * excess["raw_us"]  # the step the rows price without the excess
    assert not timed.hit_A.any()
    assert list(timed.forward_us_F) == pytest.approx([max(all_cpu, priced)] * 3, rel=1e-9)
    # its prefill likewise: the prompt's forced routing as the simulator prices it, with the excess
    run = next(r for r in rt["cpu_path_prefill"]["runs"] if r["slots"] == 0)
    profile = json.loads((result.artifact / PROFILE_FILE).read_text())
    with_excess, decode_with_excess = calibration_fit.priced_all_cpu_us(
        profile, 12, profile["settings"]["runtime"]
    )
    assert decode_with_excess == pytest.approx(max(all_cpu, priced), rel=1e-9)  # as the timed replay's
    assert excess["prefill_us"] == max(excess["prefill_raw_us"], 0.0) == costs.cpu_step_excess_prefill_us
    assert with_excess == pytest.approx(run["prefill"]["median_us"] - L * min(excess["prefill_raw_us"], 0.0))
    # The one-token CPU-path rows are the fast loop's own calls (all-CPU and half-resident runs): several
    # entry counts, among them K (every entry of the all-CPU run's calls); the call cost is theirs.
    one = [r for r in rt["cpu_path"] if r["tokens_per_expert"] == 1]
    assert one and all(r["timed"] == "fast_loop" and r["median_us"] > 0 for r in one)
    counts = [r["experts"] for r in one]
    assert K in counts and len(counts) >= 2 and counts == sorted(set(counts))
    lo, hi = one[0], one[-1]
    slope = max((hi["median_us"] - lo["median_us"]) / (hi["experts"] - lo["experts"]), 0.0)
    assert costs.cpu_call_us == pytest.approx(max(lo["median_us"] - lo["experts"] * slope, 0.0))
    # those runs' generations start from cpu_path_prompt_tokens-token prompts; their steps are recorded
    prefill = rt["cpu_path_prefill"]
    assert prefill["prompt_tokens"] == 12 and [r["slots"] for r in prefill["runs"]] == [0, L * 32 // 2]
    assert all(r[k]["median_us"] > 0 for r in prefill["runs"] for k in ("prefill", "decode"))
    # on_miss="split"'s host time, in the fast loop under lru at 25%: the decisions (misses admitted now
    # are candidates) and, where visits waited, their wait; the simulator reads both
    split = rt["split_host"]
    assert split["timed"] == "fast_loop" and split["policy"] == "lru" and split["decisions"] > 0
    assert split["decide_us"] > 0 and (split["wait_us"] > 0 if split["waits"] else split["wait_us"] is None)
    assert (costs.split_decide_us, costs.split_wait_us) == (split["decide_us"], split["wait_us"] or 0.0)
    # the publish lag, in the fast loop under lru at 25% with on_miss="cpu" (every visit deferred): its
    # 21 quantiles over the deferred visits that copied, which the simulator samples
    lag = rt["publish_lag"]
    assert lag["timed"] == "fast_loop" and lag["policy"] == "lru" and lag["visits"] > 0
    q = lag["quantiles_us"]
    assert len(q) == 21 and 0 < q[0] <= q[10] <= q[-1] and q == sorted(q)
    median = result.summary["publish lag us, median (p10..p90) (fast loop)"]
    assert median == f"{q[10]:.1f} ({q[2]:.1f}..{q[18]:.1f})"
    assert costs.publish_lag_quantiles_us == tuple(q)
    # the same decoder's warm-up (its first decode step, eager here: no graphs on the CPU), as the time it
    # took beyond a timed step's median; the simulator pauses the first request's decode steps by it
    warm = rt["decode_warmup"]
    assert warm["timed"] == "fast_loop" and len(warm["gaps_us"]) == len(warm["pause_us"]) >= 1
    assert warm["pause_us"] == [max(0.0, gap - warm["step_us"]) for gap in warm["gaps_us"]]
    assert costs.decode_warmup_pause_us == tuple(warm["pause_us"])
    shown = result.summary["decoder warm-up ms beyond a step (fast loop)"]
    assert shown == ", ".join(f"{p / 1e3:.1f}" for p in warm["pause_us"])


def test_fast_non_expert_refuses_a_non_positive_remainder() -> None:
    timing = cal.Timing(median_us=400.0, p10_us=390.0, p90_us=420.0, repeats=3)
    less = calibration_fit.less_expert_path(timing, 4, 60.0, "decode step")
    assert (less.median_us, less.p10_us, less.p90_us, less.repeats) == (160.0, 150.0, 180.0, 3)
    with pytest.raises(
        MoecacheError, match=r"cost.runtime.step=fast: the all-resident decode step took 100.0"
    ):
        calibration_fit.less_expert_path(timing, 4, 100.0, "decode step")


def test_calibrate_refuses_an_unknown_step(tmp_path) -> None:
    from typer.testing import CliRunner

    from moecache.cli import app

    with pytest.raises(
        MoecacheError, match=r"cost.runtime.step='warp': expected one of \['fast', 'transformers'\]"
    ):
        calibrate.run(compose(["model=tiny", f"output_root={tmp_path}", *FAST, "cost.runtime.step=warp"]))
    res = CliRunner().invoke(
        app, ["calibrate", "model=tiny", f"output_root={tmp_path}", "cost.runtime.step=warp"]
    )
    assert res.exit_code == 2 and "cost.runtime.step='warp'" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_step_fast_on_cuda(tmp_path) -> None:
    """On CUDA: the fast loop's all-resident steps (CUDA graphs between the host points) less the added-back
    expert path, the algebra as on the CPU."""
    fast = [
        "model=tiny", f"output_root={tmp_path}", "device=cuda", "cost.repeats=3", "cost.warmup=1",
        "cost.tokens_per_call=[1,4]", "cost.num_pool_experts=8", "cost.copy_sizes_bytes=[65536,1048576]",
        "cost.runtime.repeats=5", "cost.runtime.warmup=2", "cost.runtime.kernel_tokens=[1,8]",
        "cost.runtime.cpu_tokens_per_expert=[1,4]", "cost.runtime.visit_tokens=[1,8]",
        "cost.runtime.prompt_tokens=[8]", "cost.runtime.decode_steps=5", "cost.runtime.step=fast",
    ]  # fmt: skip
    result = calibrate.run(compose(fast))
    rt = json.loads((result.artifact / PROFILE_FILE).read_text())["runtime"]
    ne = rt["non_expert"]
    assert rt["execution"]["path"] == "fast" and rt["execution"]["device"] == "cuda"
    assert ne["decode_us_per_layer"] > 0 and ne["prefill_points"][0]["median_us"] > 0
    measured = ne["measured"]["decode"]["median_us"] / ne["moe_layers"]
    assert ne["decode_us_per_layer"] + ne["added_back_us_per_layer"]["decode"] == pytest.approx(measured)


def test_a_random_weight_model_has_weights_to_run() -> None:
    cfg = compose(["model=deepseek_v2_lite", "model.path=null", "model.random.seed=0"])
    assert calibrate_runtime._model_weights(cfg) is None  # built in memory (models/random_full.py)
    assert "model.path is not set" in calibrate_runtime._model_weights(
        compose(["model=deepseek_v2_lite", "model.path=null"])
    )


class _SlowDrain:
    """A device whose drain takes 50 ms (a visit's queued expert copies)."""

    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda

    def synchronize(self) -> None:
        import time

        time.sleep(0.05)


def test_host_timer_leaves_a_cuda_drain_out_and_keeps_the_standins() -> None:
    assert (
        cal.HostClock(_SlowDrain(is_cuda=True)).sample_us(lambda: None) < 40_000
    )  # us: the copies run on the device
    assert (
        cal.HostClock(_SlowDrain(is_cuda=False)).sample_us(lambda: None) >= 50_000
    )  # host work of the stand-in


def test_the_fast_loop_prices_each_copy_enqueued_on_the_host(make_trace) -> None:
    """step=fast with visit_hits rows: a layer step's host cost is the visit without admissions plus,
    per admission, (visit - visit_hits) / copies per visit; the transformers path keeps its visit rows."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.policy import make_policy
    from moecache.sim.timed import replay_timed

    trace = _decode_trace(make_trace)
    d = _runtime_profile("parallel")
    rt = d["runtime"]
    rt["execution"]["path"] = "fast"
    rt["visit"] = [{**row, "copies_per_visit": 2.0, "median_us": 43.0} for row in rt["visit"]]
    rt["visit_hits"] = [{**row, "median_us": 3.0} for row in rt["visit"]]
    costs = CostProfile.from_dict(d).runtime_costs()
    assert costs.visit_us(1) == pytest.approx(3.0) and costs.copy_host_us == pytest.approx(20.0)
    cost = CostModel.for_trace(CostProfile.from_dict(d), trace, non_expert_us_per_layer=0.0)
    timed = replay_timed(trace, make_policy("lru"), 4, cost)
    rt["visit_hits"] = None
    rt["visit"] = [{**row, "median_us": 3.0} for row in rt["visit"]]
    plain_cost = CostModel.for_trace(CostProfile.from_dict(d), trace, non_expert_us_per_layer=0.0)
    plain = replay_timed(trace, make_policy("lru"), 4, plain_cost)
    assert CostProfile.from_dict(d).runtime_costs().copy_host_us == 0.0
    assert list(timed.step_us_V - plain.step_us_V) == pytest.approx(list(20.0 * timed.admits_V))
    assert timed.admits_V.sum() > 0
    rt["execution"]["path"] = "transformers"
    rt["visit"] = [{**row, "copies_per_visit": 2.0, "median_us": 43.0} for row in rt["visit"]]
    rt["visit_hits"] = [{**row, "median_us": 3.0} for row in rt["visit"]]
    other = CostProfile.from_dict(d).runtime_costs()
    assert other.copy_host_us == 0.0 and other.visit_us(1) == pytest.approx(43.0)


def test_the_split_pays_its_host_time_where_the_profile_has_it(make_trace) -> None:
    """runtime.split_host: a step that weighed candidates pays the decision; a waiting one its wait too,
    which the rule weighs (a wait dearer than any saving: the split is on_miss="cpu", plus decisions)."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.policy import make_policy
    from moecache.sim.timed import replay_timed

    trace = _decode_trace(make_trace)
    engine = {"expert_bytes": 1_000_000, "per_copy_us": 1.0, "single": {}, "batch": {}}
    d = _runtime_profile("parallel", copy_engine=engine)

    def replay(split_host, on_miss="split"):
        d["runtime"]["split_host"] = split_host
        cost = CostModel.for_trace(CostProfile.from_dict(d), trace, non_expert_us_per_layer=0.0)
        assert cost.split_host_us() == (
            (0.0, 0.0) if split_host is None else (split_host["decide_us"], split_host["wait_us"])
        )
        return replay_timed(trace, make_policy("lru"), 4, cost, on_miss=on_miss).step_us_V

    row = {"decisions": 10, "waits": 5, "policy": "lru", "capacity": "25%", "timed": "fast_loop"}
    free = replay(None)
    decided = replay({**row, "decide_us": 7.0, "wait_us": 0.0}) - free
    paid = set(np.round(decided, 9).tolist())
    assert 7.0 in paid and paid <= {0.0, 7.0}  # the decision, in each step that had candidates
    cpu = replay(None, on_miss="cpu")
    assert (free < cpu).any()  # some step waited (its copies land within 1 us)
    never = replay({**row, "decide_us": 7.0, "wait_us": 1e6}) - cpu
    assert list(never) == pytest.approx(list(decided))  # no step waits: cpu's steps, plus the decisions
    for bad in (-1.0, "7", True):
        d["runtime"]["split_host"] = {**row, "decide_us": bad, "wait_us": 0.0}
        with pytest.raises(MoecacheError, match="runtime.split_host.decide_us"):
            CostProfile.from_dict(d, "p.json")


@pytest.mark.parametrize(
    "section,key,costs_field,bads,good",
    [
        # the publish lag's quantiles: at least two, numbers >= 0, non-decreasing
        ("publish_lag", "quantiles_us", "publish_lag_quantiles_us",
         ([5.0], [5.0, 3.0], [-1.0, 2.0], "5", [1.0, True]), [3.0, 5.0]),
        # the decoder warm-up's pauses: a list of numbers >= 0
        ("decode_warmup", "pause_us", "decode_warmup_pause_us",
         ([-1.0], "5", [1.0, True], [float("nan")], 3.0), [8.0, 0.0]),
    ],
)  # fmt: skip
def test_a_list_row_is_checked(section, key, costs_field, bads, good) -> None:
    """runtime.<section>.<key> out of its bounds: one line naming it; in them, read into RuntimeCosts;
    absent, empty."""
    d = _runtime_profile("parallel")
    for bad in bads:
        d["runtime"][section] = {key: bad}
        with pytest.raises(MoecacheError, match=rf"p.json: runtime.{section}.{key}="):
            CostProfile.from_dict(d, "p.json")
    d["runtime"][section] = {key: good}
    assert getattr(CostProfile.from_dict(d).runtime_costs(), costs_field) == tuple(good)
    del d["runtime"][section]
    assert getattr(CostProfile.from_dict(d).runtime_costs(), costs_field) == ()


def test_the_fast_loop_publishes_and_copies_at_its_host_points(make_trace) -> None:
    """timed.py, 7.: in a profile of the fast loop, on_miss="cpu", a step's copies are enqueued after its
    CPU half and its hits checked at that host point of the step before (the first step's at its
    routing: no visit precedes it). Decode steps: non-expert 100 +
    visit 3, CPU half 20 + 2 x 5 = 30 (each step here misses), so a step takes 133; copies 135 us.
    transformers loop: step 0's copies at its routing (103): key 0 lands at 238, a hit at step 2 (369).
    fast loop: at 133 (after the CPU half): key 0 lands at 268, after step 2's host point (266): a miss.
    on_miss="split" and "wait" run their visits before the CPU half in both loops: no difference."""
    from moecache.sim.cost_model import CostModel
    from moecache.sim.policy import make_policy
    from moecache.sim.timed import replay_timed

    trace = _decode_trace(make_trace)
    engine = {"expert_bytes": 1_000_000, "per_copy_us": 135.0, "single": {}, "batch": {}}

    def replay(path, on_miss="cpu"):
        d = _runtime_profile("parallel", copy_engine=engine)
        d["runtime"]["execution"]["path"] = path
        cost = CostModel.for_trace(CostProfile.from_dict(d), trace, non_expert_us_per_layer=0.0)
        return replay_timed(trace, make_policy("lru"), 4, cost, on_miss=on_miss)

    module, fast = replay("transformers"), replay("fast")
    assert module.copy_start_us_C[:2].tolist() == [103.0, 238.0]
    assert module.route_us_V[:3].tolist() == [103.0, 236.0, 369.0]
    assert fast.copy_start_us_C[:2].tolist() == [133.0, 268.0]
    assert fast.route_us_V[:3].tolist() == [103.0, 133.0, 266.0]  # the first step: no visit before it
    assert module.hit_A[4] and not fast.hit_A[4]  # step 2's key 0
    assert fast.hit_A.sum() < module.hit_A.sum()
    # the step's evictions happen at its visit too: copies 130 us, key 1 lands at 133 + 2 x 130 = 393;
    # step 2 (routing 369, one miss: CPU half 25) evicts it at 394, landed: not a wasted copy
    engine["per_copy_us"] = 130.0
    late = replay("fast")
    assert late.copy_key_C[1] == 1 and late.copy_ready_us_C[1] == 393.0 and late.route_us_V[3] == 394.0
    assert late.evicts_V[2] == 1 and not late.copy_wasted_C[1]
    engine["per_copy_us"] = 135.0
    for on_miss in ("split", "wait"):
        a, b = replay("transformers", on_miss), replay("fast", on_miss)
        assert (
            a.hit_A.tolist() == b.hit_A.tolist() and a.copy_start_us_C.tolist() == b.copy_start_us_C.tolist()
        )


def test_the_cpu_step_excess_is_paid_by_decode_steps_with_cpu_work(make_trace) -> None:
    """runtime.cpu_step_excess: a decode step with a miss on the CPU pays decode_us more, in both replays;
    a step of hits only and a prefill step do not; a bad value is refused, an absent row is 0."""
    from moecache.sim.cost_model import CostModel, instant_step_us
    from moecache.sim.policy import make_policy
    from moecache.sim.replay import replay_instant
    from moecache.sim.timed import replay_timed
    from moecache.sim.trace_arrays import DECODE, from_table
    from tests.conftest import trace_table

    # a 2-token prefill, then decode steps: hits only (twice: the second once the copies have landed),
    # then misses; 2 layers x 8 experts at 16 slots: nothing is evicted
    tokens = [[[0, 1], [2, 3]], [[0, 1]], [[0, 1]], [[4, 5]]]
    steps_ = [(0, i, layer, tok) for i, tok in enumerate(tokens) for layer in range(2)]
    table, meta = trace_table(steps_, 2, 8, 2, expert_bytes=1_000_000)
    trace = from_table(table, meta)
    d = _runtime_profile("parallel")

    def steps(excess):
        d["runtime"]["cpu_step_excess"] = excess
        cost = CostModel.for_trace(CostProfile.from_dict(d), trace, non_expert_us_per_layer=0.0)
        timed = replay_timed(trace, make_policy("lru"), 16, cost)
        instant = instant_step_us(trace, replay_instant(trace, make_policy("lru"), 16).hit_A, cost)
        return timed, instant

    excess = {"decode_us": 40.0, "raw_us": 40.0, "prefill_us": 25.0, "prefill_raw_us": 25.0}
    (base, base_i), (more, more_i) = steps(None), steps(excess)
    for b, m, hit_A in ((base.step_us_V, more.step_us_V, base.hit_A), (base_i, more_i, None)):
        if hit_A is None:
            hit_A = replay_instant(trace, make_policy("lru"), 16).hit_A
        miss_V = np.array(
            [not hit_A[a0:a1].all() for a0, a1 in zip(trace.start_V[:-1], trace.start_V[1:], strict=True)]
        )
        decode_V = trace.phase_V == DECODE
        assert (miss_V & decode_V).any() and (miss_V & ~decode_V).any() and (~miss_V & decode_V).any()
        assert list(m - b) == pytest.approx(list(np.where(miss_V, np.where(decode_V, 40.0, 25.0), 0.0)))
    # a profile that did not price the prefill's (prefill_us null) adds none there
    _, no_prefill = steps(excess | {"prefill_us": None})
    assert list(no_prefill - base_i) == pytest.approx(list(np.where(miss_V & decode_V, 40.0, 0.0)))
    for key, bad in [("decode_us", v) for v in (-1.0, "7", True, None)] + [("prefill_us", -1.0)]:
        d["runtime"]["cpu_step_excess"] = excess | {key: bad}
        with pytest.raises(MoecacheError, match=f"runtime.cpu_step_excess.{key}"):
            CostProfile.from_dict(d, "p.json")


def test_the_prefill_calls_scale_the_multi_token_cpu_rows() -> None:
    """prefill_scale: the factor on the rows of several tokens per expert under which the CPU-path model
    prices the loop's prefill calls right (by hand: call 5 us, one expert of 1 token 5 us, of 4 tokens 20
    us before scaling; calls measured at 45 and 85 us: f = 2); None without calls or multi-token rows."""
    from moecache.calibration_fit import prefill_scale, scaled_row

    t = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    one = [{"tokens_per_expert": 1, "experts": u, "median_us": 5.0 + 5.0 * u, **t} for u in (1, 2)]
    multi = [{"tokens_per_expert": 4, "experts": u, "median_us": 10.0 + 20.0 * u, **t} for u in (1, 2)]
    f = prefill_scale(multi, one, [(45.0, (4,)), (85.0, (4, 4))])
    assert f == pytest.approx(2.0, rel=1e-9)
    assert (
        scaled_row(multi[0], f)["median_us"] == pytest.approx(60.0)
        and scaled_row(multi[0], f)["scaled_to_fast_loop"] == f
    )
    assert prefill_scale(multi, one, []) is None and prefill_scale([], one, [(45.0, (4,))]) is None
    assert prefill_scale(multi, one, [(1e6, (4,))]) is None  # past 16x: refused as a scale


def test_time_calls_runs_the_warmup_then_the_timed_calls_in_order() -> None:
    """The one timing primitive: call(n) for n = 0 .. warmup + repeats - 1, the warmup left out."""
    seen: list[int] = []
    timing = cal.time_calls(seen.append, 5, 2, cal.HostClock())
    assert seen == list(range(7)) and timing.repeats == 5 and timing.median_us >= 0


def test_the_layer_call_is_timed_with_stubbed_halves_leaving_the_runtime_as_it_was() -> None:
    """time_layer_call times `run` on a subclass whose halves return zeros: the runtime given keeps its
    own halves (no attribute set on it), and a stubbed call returns zeros of x's shape."""
    from moecache.stages.calibrate_runtime import _runtime_device

    shape = cal.RuntimeShape(8, 2, 64, 32, torch.float32)
    runtime = cal.synthetic_runtime(shape, 8, 4, _runtime_device("cpu"), cpu_backend="torch")
    timing = cal.time_layer_call(runtime, shape, 2, 3, 1)
    assert timing.repeats == 3 and not {"resident", "cpu_half"} & set(vars(runtime))
    stubbed = cal.halves_stubbed(runtime)
    x_TH = torch.ones(2, 64)
    ids_TK = torch.tensor([[0, 5], [6, 7]])
    y_TH = stubbed.run(0, x_TH, ids_TK, torch.full((2, 2), 0.5))
    assert tuple(y_TH.shape) == (2, 64) and not y_TH.any()
