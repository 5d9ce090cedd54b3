"""validate's second prediction (moecache/validation/anchors.py): the profile's decode anchors moved onto
the artifact's own all_resident and all_cpu runs price those two runs' decode exactly, keep the excess
>= 0, leave the profile's other rows alone, and reach every run of the workload; a profile without the
anchors gives no second prediction."""

from __future__ import annotations

import json

import pytest

from moecache.sim.policy_spec import PolicySpec
from moecache.validation import anchors
from tests.validation.test_fidelity import _profile, recorded_run, tiny_model  # noqa: F401 (fixture)

NUM_KEYS = 4 * 32  # the tiny model: every expert of its 4 MoE layers


def _with_excess(tmp_path, excess_us: float) -> str:
    path = _profile(tmp_path)
    data = json.loads(open(path).read())
    data["runtime"]["cpu_step_excess"] = {"decode_us": excess_us, "raw_us": excess_us}
    out = tmp_path / "profile_excess.json"
    out.write_text(json.dumps(data))
    return str(out)


RUNS = {  # strategy: (policy, slots)
    "all_resident": ("static_cold", NUM_KEYS),
    "all_cpu": ("static_cold", 0),
    "selected": ("lru", 32),
}


@pytest.fixture(scope="module")
def traces(tiny_model, tmp_path_factory):  # noqa: F811
    """Each strategy's recorded trace on the tiny model, made once."""
    out = {}
    for name, (policy, slots) in RUNS.items():
        _, out[name] = recorded_run(tiny_model, tmp_path_factory.mktemp(name), policy, slots)
    return out


def _run(traces, strategy: str, decode_ms: float = 1.0) -> anchors.Predicted:
    """The strategy's run as predicted, with a fresh row whose measured decode takes `decode_ms`."""
    policy, slots = RUNS[strategy]
    row = {
        "strategy": strategy, "hit_rate": None, "time_per_token_ms": 1.0,
        "decode_tokens_per_s": 1e3 / decode_ms, "prefill_tokens_per_s": None,
    }  # fmt: skip
    return anchors.Predicted(row, traces[strategy], PolicySpec.of(policy), slots, "cpu")


def _decode(run: anchors.Predicted, profile: str) -> dict:
    return json.loads(run.predict(profile)["fidelity_errors"])["phases"]["decode"]


@pytest.mark.parametrize("excess_us", [0.0, 50.0])
def test_the_anchored_profile_prices_both_anchors_exactly(traces, tmp_path, excess_us):
    profile = _with_excess(tmp_path, excess_us)
    # measured: the all-resident decode 30% dearer than the profile prices it, the all-CPU one dearer still
    runs = {name: _run(traces, name) for name in RUNS}
    res_ms = _decode(runs["all_resident"], profile)["predicted_ms"] * 1.3
    cpu_ms = _decode(runs["all_cpu"], profile)["predicted_ms"] * 1.6
    runs["all_resident"].row["decode_tokens_per_s"] = 1e3 / res_ms
    runs["all_cpu"].row["decode_tokens_per_s"] = 1e3 / cpu_ms
    out = anchors.anchored_profile(profile, runs, tmp_path / "anchored.json")
    assert out is not None
    for name, want in (("all_resident", res_ms), ("all_cpu", cpu_ms)):
        assert _decode(runs[name], str(out))["predicted_ms"] == pytest.approx(want, rel=1e-6), name
    before, after = json.loads(open(profile).read()), json.loads(out.read_text())
    assert after["runtime"]["cpu_step_excess"]["decode_us"] > excess_us  # the all-CPU run was dearer still
    assert (
        after["runtime"]["non_expert"]["decode_us_per_layer"]
        > before["runtime"]["non_expert"]["decode_us_per_layer"]
    )
    for key in ("slot_moe", "cpu_path", "visit"):
        assert after["runtime"][key] == before["runtime"][key], key

    anchors.add_anchored(list(runs.values()), profile, tmp_path, "w")
    assert (tmp_path / "cost_profile_anchored_w.json").is_file()
    for name, run in runs.items():
        assert run.row["anchored_profile"] == "cost_profile_anchored_w.json", name
        assert json.loads(run.row["fidelity_errors_anchored"])["time_per_token_error_pct"] is not None, name


def test_an_all_cpu_run_cheaper_than_priced_keeps_the_excess_at_zero(traces, tmp_path):
    profile = _with_excess(tmp_path, 0.0)
    runs = {name: _run(traces, name) for name in ("all_resident", "all_cpu")}
    res_ms = _decode(runs["all_resident"], profile)["predicted_ms"]
    runs["all_resident"].row["decode_tokens_per_s"] = 1e3 / res_ms
    runs["all_cpu"].row["decode_tokens_per_s"] = 1e3 / (
        _decode(runs["all_cpu"], profile)["predicted_ms"] * 0.8
    )
    out = anchors.anchored_profile(profile, runs, tmp_path / "anchored.json")
    assert json.loads(out.read_text())["runtime"]["cpu_step_excess"]["decode_us"] == 0.0
    assert _decode(runs["all_resident"], str(out))["predicted_ms"] == pytest.approx(res_ms, rel=1e-6)


def test_no_second_prediction_without_both_anchors_or_an_excess(traces, tmp_path):
    runs = [_run(traces, "all_resident"), _run(traces, "selected")]
    anchors.add_anchored(runs, _with_excess(tmp_path, 0.0), tmp_path, "w")  # no all_cpu run
    assert all(r.row["fidelity_errors_anchored"] is None and r.row["anchored_profile"] is None for r in runs)
    both = {"all_resident": runs[0], "all_cpu": _run(traces, "all_cpu")}
    assert anchors.anchored_profile(_profile(tmp_path), both, tmp_path / "x.json") is None  # no excess row


def test_the_decoder_warm_up_is_taken_from_the_all_cpu_run(traces, tmp_path):
    """The anchored profile's runtime.decode_warmup: the all-CPU run's warm-up gaps each beyond its mean
    decode step (its row's decode rate), at least 0; a row without the gaps keeps the profile's."""
    profile = _with_excess(tmp_path, 0.0)
    data = json.loads(open(profile).read())
    data["runtime"]["decode_warmup"] = {"pause_us": [5.0]}
    open(profile, "w").write(json.dumps(data))
    runs = {name: _run(traces, name, decode_ms=2.0) for name in ("all_resident", "all_cpu")}
    runs["all_cpu"].row["warmup_gaps_ms"] = [7.5, 1.5]
    out = anchors.anchored_profile(profile, runs, tmp_path / "anchored.json")
    warm = json.loads(out.read_text())["runtime"]["decode_warmup"]
    assert warm["pause_us"] == pytest.approx([5500.0, 0.0]) and warm["step_us"] == pytest.approx(2000.0)
    assert warm["anchored_on"] == "validate: all_cpu"
    runs["all_cpu"].row["warmup_gaps_ms"] = []
    out = anchors.anchored_profile(profile, runs, tmp_path / "anchored.json")
    assert json.loads(out.read_text())["runtime"]["decode_warmup"] == {"pause_us": [5.0]}
