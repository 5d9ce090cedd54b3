"""`moecache generate` end to end on the tiny model: the text on stdout (the same as the unmodified
model's, greedy), the cache statistics on stderr, `runtime.enabled=false`, and one-line errors (exit 2)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from moecache.cli import app

BASE = ["model=tiny", "prompt=Hello there", "generation.max_new_tokens=6"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("generate-out"))


def generate(root: str, *overrides: str):
    return CliRunner().invoke(app, ["generate", *BASE, f"output_root={root}", *overrides])


def stats_of(stderr: str) -> dict:
    """The `key: value` lines of the statistics."""
    return dict(
        line.split(": ", 1) for line in stderr.splitlines() if ": " in line and " " not in line.split(": ")[0]
    )


def test_generate_streams_the_text_and_prints_the_statistics(root):
    offloaded = generate(root, "capacity=25%", "policy=lru")
    assert offloaded.exit_code == 0, offloaded.output
    plain = generate(root, "runtime.enabled=false")
    assert plain.exit_code == 0, plain.output
    assert offloaded.stdout == plain.stdout and offloaded.stdout.endswith("\n") and offloaded.stdout.strip()
    stats = stats_of(offloaded.stderr)
    assert stats["policy"] == "lru" and stats["capacity"] == "32"  # 25% of 4 layers x 32 experts
    assert int(stats["hits"]) + int(stats["misses"]) == int(stats["accesses"]) > 0
    assert 0.0 <= float(stats["hit_rate"]) <= 1.0 and int(stats["copies"]) > 0
    assert len(yaml.safe_load(stats["residents_per_layer"])) == 4
    assert "generated 6 tokens" in offloaded.stderr
    assert "runtime: disabled" in plain.stderr and "hit_rate" not in plain.stderr


def test_a_streamed_prompt_generates_the_same_text(root):
    res = generate(root, "capacity=25%", "policy=lru", "runtime.stream_min_tokens=1")
    assert res.exit_code == 0, res.output
    plain = generate(root, "runtime.enabled=false")
    assert res.stdout == plain.stdout
    stats = stats_of(res.stderr)
    assert int(stats["streamed_entries"]) > 0 and int(stats["streamed_experts"]) > 0


def test_capacity_zero_runs_every_expert_on_the_cpu(root):
    res = generate(root, "capacity=0")
    assert res.exit_code == 0, res.output
    stats = stats_of(res.stderr)
    assert stats["policy"].startswith("lfu") and float(stats["hit_rate"]) == 0.0 and stats["copies"] == "0"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["capacity=abc"], "capacity='abc': expected an integer slot count"),
        (["capacity=[4,8]"], "capacity=[4, 8]: expected one capacity"),
        (["capacity=200%"], "capacity=200%: a percentage of all experts must be from 0% to 100%"),
        (["capacity=1000"], "capacity=1000: more slots than experts (128 in all)"),
        ([], "capacity is required"),
        (["capacity=4", "policy=belady"], "policy=belady is offline"),
        (["capacity=4", "runtime.device=cuda"], "runtime.device=cuda but the model computes on device=cpu"),
        (["capacity=4", "runtime.enabled=no"], "runtime.enabled='no': expected true or false"),
        (["capacity=4", "workload=long_single"], "does not read `workload`"),
        (["capacity=4", "policy=lruu"], "policy=lruu: no such option (did you mean lru?)"),
        (["capacity=4", "policy=impact"], "policy impact weighs measured costs: give runtime.cost_profile"),
        (["capacity=4", "runtime.on_miss=split"], "runtime.on_miss=split weighs measured costs"),
        (["capacity=4", "runtime.on_miss=later"], "runtime.on_miss='later'"),
        (
            ["capacity=4", "runtime.stream_min_tokens=-1"],
            "runtime.stream_min_tokens=-1: expected auto or an integer >= 0",
        ),
        (
            ["capacity=4", "runtime.stream_min_tokens=always"],
            "runtime.stream_min_tokens='always': expected auto or",
        ),
        (["capacity=4", "runtime.stream_chunk=0"], "runtime.stream_chunk=0"),
        (
            ["capacity=4", "runtime.cost_profile=p.json"],
            "runtime.cost_profile=p.json is read only with runtime.on_miss=split or a policy that weighs costs",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(root, overrides, message):
    res = generate(root, "device=cpu", *overrides)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("moecache generate: error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert res.stdout == ""


def test_a_prompt_is_required(root):
    res = CliRunner().invoke(app, ["generate", "model=tiny", "capacity=4", f"output_root={root}"])
    assert res.exit_code == 2 and "prompt is required" in res.stderr


def test_help_and_cfg_job():
    res = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "Group runtime: default" in res.output
    job = CliRunner().invoke(app, ["generate", "--cfg", "job", "capacity=25%", "policy=lru"])
    assert job.exit_code == 0, job.output
    printed = yaml.safe_load(job.stdout)
    assert printed["capacity"] == "25%" and printed["policy"]["name"] == "lru"
    assert printed["runtime"]["enabled"] is True and "workload" not in printed


def test_a_policy_that_weighs_costs_runs_with_runtime_cost_profile(root, tmp_path):
    """policy=impact reads a cost profile (runtime.cost_profile: a calibrate artifact, a path, bundled:):
    the text is the unmodified model's."""
    plain = generate(root, "runtime.enabled=false")
    res = generate(
        root, "capacity=25%", "policy=impact", "runtime.cost_profile=bundled:h200_qwen3_6_35b_a3b_2026-11-30"
    )
    assert res.exit_code == 0, res.output
    assert res.stdout == plain.stdout and stats_of(res.stderr)["policy"].startswith("impact")


def test_a_saved_cache_state_starts_the_next_run_warm(root, tmp_path):
    state = tmp_path / "state.npz"
    cold = generate(root, "capacity=25%", "policy=lfu", f"runtime.save_state={state}")
    assert cold.exit_code == 0, cold.output
    assert state.is_file() and f"cache state: saved to {state}" in cold.stderr
    warm = generate(root, "capacity=25%", "policy=lfu", f"runtime.init={state}")
    assert warm.exit_code == 0, warm.output
    assert f"cache: started from {state}" in warm.stderr
    assert warm.stdout == cold.stdout  # the cache changes where experts run, not what they compute
    # the same prompt again: the saved residents serve its first tokens, so fewer copies are needed
    assert int(stats_of(warm.stderr)["copies"]) < int(stats_of(cold.stderr)["copies"])
    other = generate(root, "capacity=25%", "policy=lru", f"runtime.init={state}")
    assert other.exit_code == 2 and "\n" not in other.stderr.strip()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.enabled=false", "runtime.init=x.npz"], "runtime.init=x.npz is the cache's state"),
        (
            ["capacity=25%", "runtime.init=/nonexistent/state.npz"],
            "runtime.init=/nonexistent/state.npz: no such",
        ),
        (["capacity=25%", "runtime.headroom=25%"], "runtime.headroom='25%': expected a memory size"),
    ],
)
def test_cache_state_and_headroom_errors_are_one_line(root, overrides, message):
    res = generate(root, *overrides)
    assert res.exit_code == 2 and message in res.stderr and "\n" not in res.stderr.strip()
