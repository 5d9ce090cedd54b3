"""benchmarks/bench_decode.py on the tiny model, on the CPU: the unmodified model, then offloaded at 100%
(fused and split) and at capacity 0, each run in the JSON line with the mode and hit rate it ran with,
and the host point's CPU-path time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"
SMALL = ["--device", "cpu", "--prompt-tokens", "8", "--new-tokens", "4"]


def run(monkeypatch, capsys, *args: str) -> dict:
    """bench_decode.py's main with these arguments; its JSON line."""
    return run_script(monkeypatch, capsys, SCRIPT, list(args))


def test_the_tiny_model_runs_unmodified_and_offloaded(monkeypatch, capsys):
    result = run(monkeypatch, capsys, *SMALL, "--capacities", "100%,0", "--skip", "hf")
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"unmodified", "100%", "100% split", "0"}
    assert runs["unmodified"]["mode"] == "dense"
    assert (runs["100%"]["mode"], runs["100%"]["hit_rate"]) == ("fused", 1.0)
    assert (runs["100% split"]["mode"], runs["100% split"]["hit_rate"]) == ("split", 1.0)
    assert (runs["0"]["hit_rate"], runs["0"]["fallback_entries"] > 0) == (0.0, True)
    assert all(r["ms_per_token"] > 0 for r in runs.values())
    # the host point's breakdown: the CPU path's time per call where entries ran there, none where not
    assert runs["0"]["cpu_path_us_per_call"] > runs["0"]["cpu_exec_us_per_call"] > 0  # of it, the executor
    assert runs["0"]["cpu_calls_per_token"] == result["model"]["num_layers"]  # one call per MoE layer
    assert runs["100% split"]["cpu_path_us_per_call"] is None
    assert runs["100% split"]["cpu_calls_per_token"] == 0


def test_cpu_teams_run_each_capacity_below_100_once_per_team(monkeypatch, capsys):
    teams = ("--cpu-teams", "1:work,2:idle")
    result = run(monkeypatch, capsys, *SMALL, "--capacities", "100%,0", "--skip", "hf,unmodified", *teams)
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"100%", "100% split", "0 1:work", "0 2:idle"}
    assert (runs["0 1:work"]["cpu_threads"], runs["0 1:work"]["host_thread"]) == (1, "work")
    assert (runs["0 2:idle"]["cpu_threads"], runs["0 2:idle"]["host_thread"]) == (2, "idle")
    assert "cpu_threads" not in runs["100%"]
    # the same model and prompt on either team: as many entries ran on the CPU
    assert runs["0 1:work"]["fallback_entries"] == runs["0 2:idle"]["fallback_entries"] > 0


def test_a_bad_cpu_team_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, "--device", "cpu", "--cpu-teams", "15:busy")
    assert exc.value.code == 2
    assert "--cpu-teams: '15:busy' is not THREADS:work or THREADS:idle" in capsys.readouterr().err


def test_visit_first_reruns_each_capacity_below_100_and_restores_the_taps(monkeypatch, capsys):
    from moecache.runtime.segments import ExpertsTaps

    deferred = ExpertsTaps._defer_visit
    result = run(
        monkeypatch, capsys, *SMALL, "--capacities", "100%,0", "--skip", "hf,unmodified", "--visit-first"
    )
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"100%", "100% split", "0", "0 visit-first"}
    assert runs["0"]["fallback_entries"] == runs["0 visit-first"]["fallback_entries"] > 0
    assert ExpertsTaps._defer_visit is deferred


def test_a_decode_stream_share_reruns_each_capacity_below_100_with_its_misses_partly_streamed(
    monkeypatch, capsys
):
    result = run(monkeypatch, capsys, *SMALL, "--capacities", "100%,25%", "--skip", "hf,unmodified",
                 "--decode-stream-share", "0.34")  # fmt: skip
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"100%", "100% split", "25%", "25% stream0.34"}
    assert runs["25%"]["streamed_experts"] == 0 and runs["25% stream0.34"]["streamed_experts"] > 0
    # the same misses (lru, the same routing): the streamed ones left the CPU's count (one entry an expert)
    streamed = runs["25% stream0.34"]
    assert runs["25%"]["fallback_entries"] == streamed["fallback_entries"] + streamed["streamed_experts"]
    assert runs["25%"]["hit_rate"] == streamed["hit_rate"]


def test_a_share_of_1_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, *SMALL, "--decode-stream-share", "1")
    assert (
        exc.value.code == 2
        and "--decode-stream-share: runtime.decode_stream_share must be" in capsys.readouterr().err
    )


def test_policies_each_split_everywhere_in_rounds_of_alternating_order(monkeypatch, capsys):
    """--policy a list (each capacity once per policy), --split-all (each run again with every layer
    split) and --rounds 2 (the second round in reverse order), with a median per run kind."""
    args = ("--capacities", "50%", "--skip", "hf,unmodified", "--policy", "static_layers,lfu", "--split-all")
    result = run(monkeypatch, capsys, *SMALL, *args, "--rounds", "2")
    order = [(r["policy"], r["variant"], r["round"]) for r in result["runs"]]
    assert order == [
        (policy, variant, rnd)
        for policy in ("static_layers", "lfu")
        for variant, rnd in (("50%", 0), ("50% split", 0), ("50% split", 1), ("50%", 1))
    ]
    medians = {(m["policy"], m["variant"]): m for m in result["medians"]}
    assert set(medians) == {(p, v) for p in ("static_layers", "lfu") for v in ("50%", "50% split")}
    for m in medians.values():
        assert m["runs"] == 2 and m["min_ms_per_token"] <= m["median_ms_per_token"] <= m["max_ms_per_token"]
    # one placement either way: static_layers' CPU calls per token are its CPU layers', split or not
    static = [r for r in result["runs"] if r["policy"] == "static_layers"]
    L = result["model"]["num_layers"]
    assert {r["cpu_calls_per_token"] for r in static} == {L - L // 2}
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, *SMALL, "--rounds", "0")
    assert exc.value.code == 2 and "--rounds 0: must be >= 1" in capsys.readouterr().err
