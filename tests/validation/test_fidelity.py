"""Simulator fidelity on the CPU: a tiny offloaded model (CPU stand-in, before_visit) generates while its
routing is recorded; replaying that trace through the simulator's instant mode gives exactly the
manager's measured hit rate (lru and lfu, two capacities). Plus the timed prediction with a profile and
`compare`'s arithmetic and targets.

Legend: T tokens.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers

import moecache
from moecache.errors import MoecacheError
from moecache.models import ADAPTERS, adapter_for
from moecache.sim.policy_spec import PolicySpec
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import RoutingLogger
from moecache.trace.schema import TraceMeta
from moecache.validation.fidelity import compare, predict_run

PROMPT_T = [5, 17, 99, 42, 7, 250, 3, 11, 64]
GREEDY = dict(
    max_new_tokens=6, do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0,
    eos_token_id=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model():
    config = ADAPTERS["qwen3_5_moe"].tiny_config()
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForCausalLM(config.text_config).eval()


def recorded_run(model, tmp_path, policy: str, capacity: int) -> tuple[dict, str]:
    """Offload a copy of `model`, generate twice (two requests) with the routing logger on; the
    manager's stats and the trace's path."""
    model = copy.deepcopy(model)
    adapter = adapter_for(model)  # the routers stay the model's after offloading: the hooks too
    meta = TraceMeta(
        num_layers=adapter.num_layers, num_experts=adapter.num_experts, top_k=adapter.top_k,
        expert_bytes=adapter.expert_bytes, model="tiny", source="test",
    )  # fmt: skip
    logger = RoutingLogger(tmp_path, meta, "fidelity-test")
    with RoutingRecorder(model, adapter, logger) as recorder:
        model = moecache.offload(model, capacity=capacity, policy=policy, device="cpu")
        with torch.inference_mode():
            for n, prompt in enumerate((PROMPT_T, PROMPT_T[::-1])):
                recorder.start_request(f"r{n}")
                model.generate(torch.tensor([prompt]), **GREEDY)
    logger.close()
    return model.moecache.stats(), str(tmp_path / "trace.parquet")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [16, 48])
def test_instant_replay_of_the_runs_trace_equals_the_measured_hit_rate(
    tiny_model, tmp_path, policy, capacity
):
    stats, trace = recorded_run(tiny_model, tmp_path, policy, capacity)
    predicted = predict_run(trace, policy=PolicySpec.of(policy), capacity=capacity, profile_path=None)
    assert predicted["accesses"] == stats["accesses"]
    assert 0 < stats["hit_rate"] < 1
    assert predicted["hit_rate"] == stats["hit_rate"]  # exactly: the same compiled policy, the same visits
    assert predicted["time_per_token_ms"] is None and predicted["tokens"] == 2 * (len(PROMPT_T) + 5)
    errors = compare(predicted, {"hit_rate": stats["hit_rate"], "time_per_token_ms": 1.0})
    assert errors["hit_rate_error_pp"] == 0.0 and errors["hit_rate_within_target"] is True
    assert errors["time_per_token_error_pct"] is None and errors["time_within_target"] is None


def _profile(tmp_path, overlap: str = "serial") -> str:
    """A hand-made schema-2 profile of the tiny shape (numbers chosen for easy arithmetic)."""
    timing = {"p10_us": 0.0, "p90_us": 0.0, "repeats": 1}
    data = {
        "schema_version": 2,
        "shape": {"hidden_size": 64, "moe_intermediate_size": 32, "expert_bytes": 24576},
        "dtype": "float32",
        "machine": {"threads": 1},
        "cpu": [{"dtype": "float32", "tokens_per_call": 1, "median_us": 5.0, "p10_us": 5.0, "p90_us": 5.0, "pool_experts": 2}],
        "cuda": None,
        "h2d": None,
        "measured_at": "2026-01-01T00:00:00Z",
        "runtime": {
            "model": {"num_experts": 32, "top_k": 4, "expert_bytes": 24576},
            "execution": {"path": "transformers", "overlap": overlap},
            "slot_moe": [{"tokens": 1, "entries": n, "median_us": 10.0 * n, **timing} for n in (1, 2, 4)],
            "cpu_path": [
                {"tokens_per_expert": 1, "experts": 1, "median_us": 25.0, **timing},
                {"tokens_per_expert": 1, "experts": 4, "median_us": 40.0, **timing},
            ],
            "visit": [{"tokens": 1, "median_us": 3.0, **timing}],
            "copy_engine": None,
            "non_expert": {"moe_layers": 4, "decode_us_per_layer": 100.0, "prefill_us_per_token_per_layer": 20.0},
        },
    }  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_timed_prediction_prices_the_runtime_step(tiny_model, tmp_path):
    stats, trace = recorded_run(tiny_model, tmp_path, "lru", 0)  # capacity 0: every access on the CPU
    predicted = predict_run(trace, policy=PolicySpec.of("lru"), capacity=0, profile_path=_profile(tmp_path))
    assert predicted["hit_rate"] == stats["hit_rate"] == 0.0
    # A decode layer step: non-expert 100 + visit 3 + CPU call 20 (25 - 5) + 4 distinct experts x 5.
    # The tiny model has 4 MoE layers, so a decode token takes 4 x 143 us.
    assert predicted["decode_ms_per_token"] == pytest.approx(4 * 143.0 / 1e3)
    assert predicted["time_per_token_ms"] == pytest.approx(predicted["total_ms"] / predicted["tokens"])
    assert predicted["prefill_ms_per_token"] > 0
    assert any("copies free" in note for note in predicted["cost_notes"])


def test_with_a_profile_the_predicted_hit_rate_is_the_timed_one(tiny_model, tmp_path):
    """A copy counts once it has landed (the runtime's published row on CUDA): with copies slower than a
    whole run, no copy is ever usable and the predicted hit rate is the timed replay's, below instant
    mode's (what the stand-in, whose copies are free, measured); with free copies the two are equal."""
    stats, trace = recorded_run(tiny_model, tmp_path, "lru", 16)
    free = predict_run(trace, policy=PolicySpec.of("lru"), capacity=16, profile_path=_profile(tmp_path))
    assert free["hit_rate"] == free["instant_hit_rate"] == stats["hit_rate"] > 0
    path = Path(_profile(tmp_path))
    data = json.loads(path.read_text())
    data["runtime"]["copy_engine"] = {"expert_bytes": 24576, "per_copy_us": 1e9, "single": {}, "batch": {}}
    path.write_text(json.dumps(data))
    slow = predict_run(trace, policy=PolicySpec.of("lru"), capacity=16, profile_path=str(path))
    assert slow["hit_rate"] == 0.0
    assert slow["instant_hit_rate"] == stats["hit_rate"]


def test_compare_errors_and_targets():
    errors = compare(
        {"hit_rate": 0.505, "time_per_token_ms": 1.2}, {"hit_rate": 0.5, "time_per_token_ms": 1.0}
    )
    assert errors["hit_rate_error_pp"] == pytest.approx(0.5) and errors["hit_rate_within_target"] is True
    assert errors["time_per_token_error_pct"] == pytest.approx(20.0) and errors["time_within_target"] is False
    errors = compare(
        {"hit_rate": 0.48, "time_per_token_ms": 0.9}, {"hit_rate": 0.5, "time_per_token_ms": 1.0}
    )
    assert errors["hit_rate_error_pp"] == pytest.approx(-2.0) and errors["hit_rate_within_target"] is False
    assert errors["time_per_token_error_pct"] == pytest.approx(-10.0) and errors["time_within_target"] is True
    with pytest.raises(MoecacheError, match="time_per_token_ms"):
        compare({"hit_rate": None, "time_per_token_ms": 1.0}, {"hit_rate": None, "time_per_token_ms": 0.0})
    assert errors["phases"] == {}  # neither side has a phase's figure


def test_compare_says_which_phase_an_error_comes_from():
    errors = compare(
        {"hit_rate": 0.5, "time_per_token_ms": 0.8, "prefill_ms_per_token": 3.0, "decode_ms_per_token": 20.0},
        {"hit_rate": 0.5, "time_per_token_ms": 1.0, "prefill_ms_per_token": 6.0, "decode_ms_per_token": 20.0},
    )
    assert errors["phases"]["prefill"] == {"predicted_ms": 3.0, "measured_ms": 6.0, "error_pct": -50.0}
    assert errors["phases"]["decode"]["error_pct"] == 0.0
    # a phase the run did not measure (no decode gaps) is left out, not reported as an error
    errors = compare(
        {"hit_rate": 0.5, "time_per_token_ms": 1.0, "prefill_ms_per_token": 3.0, "decode_ms_per_token": 20.0},
        {"hit_rate": 0.5, "time_per_token_ms": 1.0, "prefill_ms_per_token": 3.0, "decode_ms_per_token": None},
    )
    assert list(errors["phases"]) == ["prefill"]


def test_scales_move_the_prediction_with_the_costs_they_scale(tiny_model, tmp_path):
    """capacity 0: every access on the CPU, so the CPU scale moves the decode time by its CPU part (per
    MoE layer the call's 20 us and 4 distinct experts x 5 us: the test above) and the copy bandwidth
    moves nothing."""
    _, trace = recorded_run(tiny_model, tmp_path, "lru", 0)
    profile = _profile(tmp_path)
    base = predict_run(trace, policy=PolicySpec.of("lru"), capacity=0, profile_path=profile)
    slow_cpu = predict_run(
        trace, policy=PolicySpec.of("lru"), capacity=0, profile_path=profile, scales={"cpu_scale": 3.0}
    )
    assert slow_cpu["decode_ms_per_token"] == pytest.approx(
        base["decode_ms_per_token"] + 4 * (20.0 + 4 * 5.0) * 2 / 1e3
    )
    pcie = predict_run(
        trace, policy=PolicySpec.of("lru"), capacity=0, profile_path=profile, scales={"bandwidth_scale": 0.5}
    )
    assert pcie["decode_ms_per_token"] == pytest.approx(base["decode_ms_per_token"])
    with pytest.raises(MoecacheError, match="scales"):
        predict_run(
            trace, policy=PolicySpec.of("lru"), capacity=0, profile_path=profile, scales={"copy": 2.0}
        )


def test_predict_run_refuses_a_missing_trace(tmp_path):
    with pytest.raises(MoecacheError, match="no such trace"):
        predict_run(tmp_path / "absent.parquet", policy=PolicySpec.of("lru"), capacity=1, profile_path=None)


def test_a_waiting_run_is_predicted_waiting(tiny_model, tmp_path):
    """on_miss="wait" (the lru_sync baseline): the timed replay waits for the step's copies and runs those
    misses on the device. Copies are free on this profile, so with LRU (every miss admitted) a decode layer
    step is non-expert 100 + visit 3 + the operator at all 4 entries 40 = 143 us; the CPU-fallback replay
    of the same trace prices its misses on the CPU and is slower. Hits count as the cache began either way."""
    stats, trace = recorded_run(tiny_model, tmp_path, "lru", 16)
    profile = _profile(tmp_path)
    cpu = predict_run(trace, policy=PolicySpec.of("lru"), capacity=16, profile_path=profile)
    wait = predict_run(trace, policy=PolicySpec.of("lru"), capacity=16, profile_path=profile, on_miss="wait")
    assert wait["hit_rate"] == cpu["hit_rate"] == stats["hit_rate"] and 0 < stats["hit_rate"] < 1
    assert wait["decode_ms_per_token"] == pytest.approx(4 * 143.0 / 1e3)
    assert cpu["decode_ms_per_token"] > wait["decode_ms_per_token"]
    with pytest.raises(MoecacheError, match="on_miss='sometimes'"):
        predict_run(
            trace, policy=PolicySpec.of("lru"), capacity=16, profile_path=profile, on_miss="sometimes"
        )


def test_check_loop_refuses_a_profile_of_another_loop(tmp_path):
    """validate refuses a profile whose non-expert time was measured in another decode loop than its runs'
    (cost.runtime.step against validate.loop); a profile measuring none, or no profile, passes."""
    from moecache.validation.fidelity import check_loop

    profile = _profile(tmp_path)  # measured with cost.runtime.step=transformers
    check_loop(profile, "transformers")
    check_loop(None, "fast")
    with pytest.raises(
        MoecacheError, match=r"cost.runtime.step=transformers, the runs use validate.loop=fast"
    ):
        check_loop(profile, "fast")
    data = json.loads(Path(profile).read_text())
    data["runtime"]["non_expert"] = None
    Path(profile).write_text(json.dumps(data))
    check_loop(profile, "fast")
