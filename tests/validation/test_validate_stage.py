"""`moecache validate` end to end through the CLI on the tiny model (CPU, fp32, the CPU stand-in device),
composing the real conf: every strategy's run, capacity 0 without a hit, the n-cpu-moe placement holding
exactly the last layer, traces with the cache columns filled, every offloaded run's output agreement
against transformers' default grouped_mm path beside its eager tolerance, the fidelity table (hit rate only
without a profile), a reproducible artifact id; bad input is one line, exit 2, no artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.artifacts import ArtifactStore
from moecache.cli import app
from moecache.trace.schema import read_trace

SMALL = [
    "validate.workloads=[multi_request]",
    "validate.requests=2",
    "validate.max_new_tokens=4",
    "validate.capacities=[25%]",
]
L, E = 4, 32  # the tiny model: 4 MoE layers x 32 experts; 25% = 32 slots = one whole layer


def decision(root: Path, policy: str = "lru", on_miss: str | None = None) -> str:
    """A decide artifact whose decision.json selects `policy` (what validate reads of it), judged with
    `on_miss` (None: the key absent, as in decisions made before it existed)."""
    store = ArtifactStore(root)
    body = {"selected": {"policy": policy, "params": {}}} | ({"on_miss": on_miss} if on_miss else {})
    with store.create(
        "decide", schema_version=2, config={"test": policy, "on_miss": on_miss}, inputs=[], seed=0
    ) as tmp:
        (tmp / "decision.json").write_text(json.dumps(body))
    return store.latest("decide").id


def validate(root: Path, *overrides: str):
    return CliRunner().invoke(app, ["validate", f"output_root={root}", *SMALL, *overrides])


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate-out")
    decision(root)
    res = validate(root)
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    return root, folder, {(r["strategy"], r["capacity"]): r for r in runs}, res


def test_every_strategy_runs_once_per_capacity_and_the_files_are_there(done):
    _, folder, runs, _ = done
    assert set(runs) == {
        ("unmodified", None), ("all_resident", "all"), ("all_cpu", "0"), ("n_cpu_moe", "25%"),
        ("lru_sync", "25%"), ("hindsight_static", "25%"), ("selected", "25%"),
    }  # fmt: skip
    result = json.loads((folder / "validation.json").read_text())
    assert result["selected"]["policy"] == "lru" and len(result["runs"]) == 7
    assert result["cost_profile"] is None  # hit rate predicted, no time: nothing fitted, nothing held out
    (direction,) = result["fidelity"]["directions"]
    assert direction["direction"] == "no cost profile -> multi_request" and direction["predicted_runs"] == 6
    assert direction["hit_rate_within"] == 6 and direction["time_judged"] == 0
    assert result["fidelity"]["held_out"] is None
    fidelity = pq.read_table(folder / "fidelity.parquet").to_pylist()
    assert len(fidelity) == 6 and {r["role"] for r in fidelity} == {"predicted"}
    assert all(r["hit_rate_error_pp"] == 0.0 and r["predicted_time_per_token_ms"] is None for r in fidelity)
    latency = pq.read_table(folder / "latency.parquet")
    assert latency.num_rows == sum(r["generated_tokens"] for r in runs.values()) == 7 * 2 * 4
    for r in runs.values():
        assert r["generated_tokens"] == 8 and r["ttft_ms"] > 0 and r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["peak_cuda_bytes"] is None  # CPU run
        assert (folder / r["trace"]).is_file()
        assert r["predicted_time_per_token_ms"] is None  # no cost profile given
        if r["strategy"] != "unmodified":  # every offloaded run's own trace replayed: hit rate exact
            assert r["predicted_hit_rate"] == pytest.approx(r["hit_rate"])


def test_every_run_says_on_stderr_when_it_is_done(done):
    _, _, runs, res = done
    lines = [line for line in res.stderr.splitlines() if line.startswith("validate: ")]
    assert len(lines) == len(runs) == 7
    for line, (strategy, capacity) in zip(lines, runs, strict=True):  # in the order the runs ran
        assert line.startswith(f"validate: multi_request {strategy} {capacity or ''}: "), line
        assert " ms/token, hit rate " in line and line.endswith(" s)"), line


def test_every_offloaded_run_is_held_to_transformers_own_tolerance(done):
    """agreement.parquet: the grouped_mm baseline's row (a float32 model: its own float32 truth), the eager
    row (the tolerance) against it, then one row per offloaded run, each teacher-forced on the same
    positions with the same (captured) routing; all resident runs every entry from the slot pool, all on
    the CPU every one there, 25% both; fp32: every error at the float32 rounding level, the top-1 token
    everywhere the same."""
    _, folder, runs, _ = done
    rows = pq.read_table(folder / "agreement.parquet").to_pylist()
    summary = json.loads((folder / "validation.json").read_text())["agreement"]["multi_request"]
    assert (
        summary["requests"] == 1 and summary["fed_tokens"] == 3
    )  # max_new_tokens 4: 3 routed after the prompt
    assert "captured" in summary["routing"] and set(summary["tolerance"]) == {"eager"}
    baseline, tolerance, *moecache = rows
    assert (baseline["run"], baseline["kind"], baseline["float32_max_abs_logit_error"]) == (
        "grouped_mm",
        "baseline",
        0.0,
    )
    assert tolerance["run"] == "eager" and tolerance["kind"] == "tolerance"
    # a float32 model: the baseline is the truth
    assert tolerance["float32_max_abs_logit_error"] == tolerance["max_abs_logit_error"]
    assert tolerance["within_tolerance"] is None and tolerance["baseline"] == "grouped_mm"
    assert [(r["run"], r["capacity"]) for r in moecache] == [k for k in runs if k[0] != "unmodified"]
    assert summary["runs"] == 6 and summary["runs_within"] == sum(r["within_tolerance"] for r in moecache)
    entries = summary["positions"] * L * 4  # top-4
    for r in rows:
        assert r["positions"] == summary["positions"] and r["top1_agreement"] == 1.0, r["run"]
        assert r["max_abs_logit_error"] < 1e-5, r["run"]
    for r in moecache:
        assert r["gpu_entries"] + r["cpu_entries"] == entries, r["run"]
        assert r["within_tolerance"] == (
            r["max_abs_logit_error_within"]
            and r["mean_abs_logit_error_within"]
            and r["top1_agreement_within"]
        )
        assert r["max_abs_logit_error_within"] == (
            r["max_abs_logit_error"] <= tolerance["max_abs_logit_error"]
        )
        assert r["float32_mean_abs_logit_error"] == r["mean_abs_logit_error"]  # the same truth
    assert summary["runs_within_float32_spread"] == sum(r["within_float32_spread"] for r in moecache)
    by_run = {r["run"]: r for r in moecache}
    assert by_run["all_resident"]["cpu_entries"] == 0 and by_run["all_cpu"]["gpu_entries"] == 0
    assert by_run["selected"]["gpu_entries"] > 0 < by_run["selected"]["cpu_entries"]  # both halves
    r = runs[("all_resident", "all")]
    assert r["hit_rate"] == 1.0 and r["copies"] == 0 and r["cpu_fallbacks"] == 0


def test_without_agreement_requests_no_agreement_is_measured(tmp_path):
    decision(tmp_path)
    res = validate(tmp_path, "validate.agreement_requests=0", "validate.strategies=[all_cpu]")
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    assert pq.read_table(folder / "agreement.parquet").num_rows == 0
    assert json.loads((folder / "validation.json").read_text())["agreement"] == {}


def test_capacity_zero_never_hits_and_runs_every_entry_on_the_cpu(done):
    _, _, runs, _ = done
    r = runs[("all_cpu", "0")]
    routed = r["prompt_tokens"] + r["generated_tokens"] - r["requests"]
    assert r["hit_rate"] == 0.0 and r["copies"] == 0 and r["gpu_entries"] == 0
    assert r["cpu_fallbacks"] == routed * L * 4  # top-4


def test_n_cpu_moe_holds_exactly_the_last_layer_and_the_trace_says_so(done):
    _, folder, runs, _ = done
    r = runs[("n_cpu_moe", "25%")]
    table, _ = read_trace(folder / r["trace"])
    hits = table["cache_hit"].to_pylist()
    layers = table["layer_id"].to_pylist()
    last = list(range((L - 1) * E, L * E))  # a row lists its own layer's residents: the last layer's all
    resident = table["resident_experts"].to_pylist()
    assert all(keys == (last if layer == L - 1 else []) for keys, layer in zip(resident, layers, strict=True))
    assert all(
        all(h) == (layer == L - 1) and any(h) == (layer == L - 1)
        for h, layer in zip(hits, layers, strict=True)
    )
    assert r["hit_rate"] == pytest.approx(0.25, abs=0.01) and r["copies"] == 0


def test_runs_agree_with_the_unmodified_model_and_their_traces_route_alike(done):
    _, folder, runs, _ = done
    ref, _ = read_trace(folder / runs[("unmodified", None)]["trace"])
    assert ref["cache_hit"].null_count == ref.num_rows  # no cache ran
    for key, r in runs.items():
        if key[0] == "unmodified":
            continue
        table, meta = read_trace(folder / r["trace"])
        assert table["expert_ids"].to_pylist() == ref["expert_ids"].to_pylist(), key
        assert table["cache_hit"].null_count == 0 and meta.run["strategy"] == key[0]
    table, _ = read_trace(folder / runs[("selected", "25%")]["trace"])
    rows = zip(
        table["phase"].to_pylist(), table["cache_hit"].to_pylist(),
        table["cuda_duration_ns"].to_pylist(), table["cpu_duration_ns"].to_pylist(), strict=True,
    )  # fmt: skip
    decode = [(hit, cuda, cpu) for phase, hit, cuda, cpu in rows if phase == "decode"]  # a row = a visit
    assert decode and all((cuda is not None) == any(hit) for hit, cuda, _ in decode)  # the GPU part timed
    assert all((cpu is not None) == (not all(hit)) for hit, _, cpu in decode)  # the CPU part timed
    assert all(v > 0 for _, cuda, cpu in decode for v in (cuda, cpu) if v is not None)
    sync = runs[("lru_sync", "25%")]
    assert sync["waited_copies"] > 0 and sync["waited_copies"] <= sync["copies"]
    assert sync["cpu_fallbacks"] < runs[("selected", "25%")]["cpu_fallbacks"]  # waits instead of the CPU
    assert runs[("hindsight_static", "25%")]["copies"] == 0


def test_the_same_config_gives_the_same_id_and_reuses_the_artifact(done):
    root, folder, _, _ = done
    again = validate(root)
    assert again.exit_code == 0, again.output
    assert again.stdout.strip().splitlines()[-1] == str(folder) and "reused" in again.stderr


def test_a_warm_up_first_leaves_every_run_as_it_was(done, tmp_path, monkeypatch):
    """validate.warmup=on (auto: on CUDA) runs each strategy once untimed before the timed runs: every
    run still starts from a cold cache, so its tokens, hits and copies are those of the run without."""
    from moecache.validation import pipeline
    from moecache.validation import runs as runs_module

    _, _, runs, _ = done
    measured = []
    real_measure = runs_module.measure
    monkeypatch.setattr(
        pipeline, "measure", lambda *a, **kw: measured.append(a[1].label) or real_measure(*a, **kw)
    )
    decision(tmp_path)
    res = validate(tmp_path, "validate.warmup=on")
    assert res.exit_code == 0, res.output
    strategies = {label for label, _ in runs} - {"unmodified"}
    assert len(measured) == len(runs) + len(strategies)  # one warm-up per strategy, then every run
    warmed = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    assert len(warmed) == len(runs)
    for r in warmed:
        before = runs[(r["strategy"], r["capacity"])]
        for key in ("hits", "misses", "copies", "generated_tokens"):
            assert r[key] == before[key], (r["strategy"], key)


def test_an_all_resident_reference_is_warmed_up_before_it_runs(tmp_path, monkeypatch):
    """validate.reference=all_resident: the reference is the first timed run, so its warm-up comes before
    it (the process's first-call costs fell on it: on the H200 its prefill measured 48 ms per token against
    1 ms predicted); every other strategy is warmed up once, after it."""
    from moecache.validation import pipeline
    from moecache.validation import runs as runs_module

    calls = []  # (warm-up or timed run, strategy) in call order
    real_measure = runs_module.measure

    def measure(*a, **kw):
        calls.append(("warm" if "moecache-warmup-" in str(kw["trace_dir"]) else "run", a[1].label))
        return real_measure(*a, **kw)

    monkeypatch.setattr(pipeline, "measure", measure)
    decision(tmp_path)
    strategies = ["all_resident", "all_cpu", "selected"]
    res = validate(
        tmp_path, f"validate.strategies=[{','.join(strategies)}]", "validate.reference=all_resident",
        "validate.warmup=on", "validate.capacities=[25%]",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    assert [r["strategy"] for r in runs] == strategies and runs[0]["reference"]
    assert calls == [
        ("warm", "all_resident"), ("run", "all_resident"),  # its warm-up, then the reference run
        ("warm", "all_cpu"), ("warm", "selected"), ("run", "all_cpu"), ("run", "selected"),
    ]  # fmt: skip


def test_auto_warms_up_where_times_are_predicted(tmp_path, monkeypatch):
    """validate.warmup=auto on the CPU: no warm-up without a cost profile, one per strategy with one (the
    predicted times are held against the measured: first-call costs must fall on no run)."""
    from moecache.validation import pipeline
    from moecache.validation import runs as runs_module
    from tests.validation.test_fidelity import _profile

    labels = []
    real_measure = runs_module.measure
    monkeypatch.setattr(
        pipeline, "measure", lambda *a, **kw: labels.append(a[1].label) or real_measure(*a, **kw)
    )
    decision(tmp_path)
    for extra, warmups in (((), 0), ((f"validate.cost_profile={_profile(tmp_path)}",), 1)):
        labels.clear()
        res = validate(tmp_path, "validate.strategies=[selected]", *extra)
        assert res.exit_code == 0, res.output
        runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").num_rows
        assert len(labels) == runs + warmups * len(set(labels) - {"unmodified"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("validate.decision=decide-000000000000", "no artifact 'decide-000000000000'"),
        ("validate.capacities=[abc]", "validate.capacities[0]"),
        ("validate.capacities=[200%]", "validate.capacities[0]"),
        ("validate.workloads=[nope]", "no workload 'nope'"),
        ("validate.strategies=[selected,oracle]", "unknown strategy 'oracle'"),
        ("validate.warmup=sometimes", "validate.warmup='sometimes'"),
        ("validate.on_miss=wait", "validate.on_miss='wait': expected one of cpu, split (or null"),
        ("validate.agreement_requests=-1", "validate.agreement_requests=-1: expected an integer >= 0"),
        ("validate.agreement_tokens=x", "validate.agreement_tokens='x'"),
        (
            "validate.agreement_impls=[grouped_mm]",
            "validate.agreement_impls: 'grouped_mm': expected some of eager, batched_mm",
        ),
        ("validate.forced_trace=[a.parquet,a.parquet]", "a trace is listed twice"),
        (
            "validate.on_miss=split",
            "validate.on_miss=split: weighs copies against the CPU with validate.cost_profile",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_artifact(tmp_path, override, message):
    decision(tmp_path)
    res = validate(tmp_path, override)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moecache validate: error:") and message in lines[0]
    assert not (tmp_path / "validate").exists() or not list((tmp_path / "validate").iterdir())


def test_an_offline_selection_is_refused_before_any_run(tmp_path):
    decision(tmp_path, "belady")
    res = validate(tmp_path)
    assert res.exit_code == 2 and "offline" in res.stderr and not (tmp_path / "validate").exists()


def test_the_selected_policy_runs_split_with_a_profile_and_is_predicted_so(tmp_path):
    """validate.on_miss=split: the selected run's manager splits its misses (its row says so, with
    copies waited for: the hand-made profile's copies are free), its hit rate is on_miss=cpu's, and the
    prediction replays it split."""
    from tests.validation.test_fidelity import _profile

    decision(tmp_path)
    profile = _profile(tmp_path)
    runs = {}
    for mode in ("cpu", "split"):
        res = validate(
            tmp_path, "validate.strategies=[selected]", f"validate.on_miss={mode}",
            f"validate.cost_profile={profile}",
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        folder = Path(res.stdout.strip().splitlines()[-1])
        runs[mode] = next(
            r for r in pq.read_table(folder / "runs.parquet").to_pylist() if r["strategy"] == "selected"
        )
        check = json.loads((folder / "validation.json").read_text())["machine_check"]
        (cpu,) = check["probes"]  # the hand-made profile has no host loop
        assert cpu["probe"] == "cpu expert" and cpu["profile_median_us"] == 5.0
        assert cpu["before_median_us"] > 0 < cpu["after_median_us"]
        assert check["changed"] == (max(abs(cpu["change_pct_before"]), abs(cpu["change_pct_after"])) > 10)
    split, cpu = runs["split"], runs["cpu"]
    assert split["on_miss"] == "split" and split["waited_copies"] > 0 == cpu["waited_copies"]
    assert split["hit_rate"] == cpu["hit_rate"] and split["copies"] == cpu["copies"]
    assert split["predicted_hit_rate"] == pytest.approx(split["hit_rate"])
    assert split["predicted_time_per_token_ms"] < cpu["predicted_time_per_token_ms"]
    # the error split by phase, from the run's own prefill and decode rates
    phases = json.loads(cpu["fidelity_errors"])["phases"]
    assert set(phases) == {"prefill", "decode"}
    assert phases["decode"]["measured_ms"] == pytest.approx(1e3 / cpu["decode_tokens_per_s"])
    assert phases["prefill"]["measured_ms"] == pytest.approx(1e3 / cpu["prefill_tokens_per_s"])


def test_with_a_profile_every_run_is_predicted_again_on_the_artifacts_own_anchors(tmp_path):
    """moecache/validation/anchors.py through the stage: the profile anchored on this validate's
    all_resident and all_cpu runs is in the artifact, prices those two runs' decode exactly, predicts
    every strategy's run again, and the summary counts both predictions against the target."""
    from tests.validation.test_anchors import _with_excess

    decision(tmp_path)
    res = validate(
        tmp_path,
        "validate.strategies=[all_resident,all_cpu,selected]",
        f"validate.cost_profile={_with_excess(tmp_path, 0.0)}",
    )
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    assert (folder / "cost_profile_anchored_multi_request.json").is_file()
    excess = json.loads((folder / "cost_profile_anchored_multi_request.json").read_text())["runtime"][
        "cpu_step_excess"
    ]["decode_us"]
    runs = {r["strategy"]: r for r in pq.read_table(folder / "runs.parquet").to_pylist()}
    assert runs["unmodified"]["fidelity_errors_anchored"] is None
    for name in ("all_resident", "all_cpu", "selected"):
        assert runs[name]["anchored_profile"] == "cost_profile_anchored_multi_request.json", name
        anchored = json.loads(runs[name]["fidelity_errors_anchored"])
        assert anchored["time_per_token_error_pct"] is not None, name
    decode = {
        n: json.loads(runs[n]["fidelity_errors_anchored"])["phases"]["decode"]["error_pct"]
        for n in runs
        if n != "unmodified"
    }
    assert decode["all_resident"] == pytest.approx(0.0, abs=1e-6)
    if excess > 0:  # priced exactly, unless the all-CPU run was cheaper than its rows (the excess kept at 0)
        assert decode["all_cpu"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert decode["all_cpu"] > 0
    from moecache.stages.validate import _summary

    result = json.loads((folder / "validation.json").read_text())
    summary = _summary(result)
    assert "time/token within 15%: " in summary["fidelity calibrate -> multi_request"], summary
    fitted = "time/token within 15% (anchored on the same workload: its all_resident and all_cpu fitted)"
    assert summary[fitted].endswith(" of 3 runs"), summary
    # one workload: nothing is held out across workloads, calibrate's profile predicts every run
    assert result["fidelity"]["held_out"] is None
    assert [d["direction"] for d in result["fidelity"]["directions"]] == ["calibrate -> multi_request"]


def test_a_selected_policy_that_weighs_costs_needs_a_profile_and_runs_with_one(tmp_path):
    """impact reads the cost model: without validate.cost_profile the stage refuses it in one line, before
    any run; with one its run is made (on_miss=cpu) and predicted."""
    from tests.validation.test_fidelity import _profile

    decision(tmp_path, policy="impact")
    res = validate(tmp_path, "validate.strategies=[selected]")
    assert res.exit_code == 2 and "impact" in res.stderr and "validate.cost_profile" in res.stderr
    assert "\n" not in res.stderr.strip()
    res = validate(tmp_path, "validate.strategies=[selected]", f"validate.cost_profile={_profile(tmp_path)}")
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    selected = next(r for r in runs if r["strategy"] == "selected")
    assert selected["policy"].startswith("impact(") and selected["on_miss"] == "cpu"
    assert selected["predicted_hit_rate"] == pytest.approx(selected["hit_rate"])


def test_the_decisions_on_miss_is_the_default_and_split_needs_a_profile(tmp_path):
    """validate.on_miss=null (the default): the decision's own on_miss; a split decision without
    validate.cost_profile is refused in one line, before any run."""
    from tests.validation.test_fidelity import _profile

    decision(tmp_path, on_miss="split")
    res = validate(tmp_path, "validate.strategies=[selected]")
    assert res.exit_code == 2 and "validate.on_miss=split" in res.stderr
    res = validate(tmp_path, "validate.strategies=[selected]", f"validate.cost_profile={_profile(tmp_path)}")
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    selected = next(
        r for r in pq.read_table(folder / "runs.parquet").to_pylist() if r["strategy"] == "selected"
    )
    assert selected["on_miss"] == "split"


def test_the_selected_cache_starts_from_a_saved_state(done, tmp_path):
    """validate.init: a state that `moecache generate` saved (the same policy and capacity) starts the
    selected strategy's cache; another policy's state is refused in one line."""
    root, _, cold, _ = done
    state = tmp_path / "lru.npz"
    gen = CliRunner().invoke(
        app, ["generate", "model=tiny", "prompt=Hello there", "generation.max_new_tokens=4", "capacity=25%",
              "policy=lru", f"runtime.save_state={state}", f"output_root={tmp_path}"],
    )  # fmt: skip
    assert gen.exit_code == 0 and state.is_file(), gen.output
    res = validate(root, "validate.strategies=[selected]", f"validate.init={state}")
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    warm = next(r for r in runs if r["strategy"] == "selected")
    assert warm["hit_rate"] != cold[("selected", "25%")]["hit_rate"]  # its first visits find residents
    assert validate(root, "validate.init=/nonexistent.npz").exit_code == 2
