"""The `moecache` command: multirun, `artifacts list|show`, help and `--cfg` for every stage."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moecache.artifacts import ArtifactStore
from moecache.cli import STAGES, app
from moecache.config_tree import group_options, groups, root_name, stage_keys

SMALL = ["workload.num_requests=1", "generation.max_new_tokens=2", "workload.max_prompt_tokens=32"]


def test_every_stage_has_help():
    for stage in [*STAGES, "generate"]:
        res = CliRunner().invoke(app, [stage, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and "Hydra overrides" in res.output
        assert f"moecache {stage} --cfg job" in res.output
        unwrapped = " ".join(res.output.split())
        assert f"Config keys it reads (conf/{root_name(stage)}.yaml): " in unwrapped
        assert groups(stage)
        for group in groups(stage):
            assert f"Group {group}: {', '.join(group_options(group))}" in unwrapped


@pytest.mark.parametrize("stage", [*STAGES, "generate"])
def test_cfg_job_prints_the_keys_the_stage_reads(stage):
    res = CliRunner().invoke(app, [stage, "--cfg", "job"])
    assert res.exit_code == 0, res.output
    printed = yaml.safe_load(res.stdout)
    tops = {k.split(".")[0] for k in stage_keys(stage)}
    # policy: no option is selected by default, so the composed config has no policy node
    assert set(printed) == tops - {"policy"} and {"output_root", "force"} <= tops
    assert "hydra" not in printed
    both = yaml.safe_load(CliRunner().invoke(app, [stage, "--cfg", "all"]).stdout)
    assert both == {**printed, "hydra": both["hydra"]} and "run" in both["hydra"]


def test_cfg_job_shows_overrides_and_resolves():
    res = CliRunner().invoke(
        app, ["simulate", "--cfg", "job", "--resolve", "capacity=25%", "policy=lru", "output_root=/x"]
    )
    assert res.exit_code == 0, res.output
    printed = yaml.safe_load(res.stdout)
    assert (
        printed["capacity"] == "25%" and printed["policy"]["name"] == "lru" and printed["output_root"] == "/x"
    )
    hydra = CliRunner().invoke(app, ["sweep", "--cfg", "hydra", "hydra/launcher=joblib"])
    assert hydra.exit_code == 0 and "joblib" in hydra.stdout


def test_help_is_fast_from_a_cold_start():
    """`moecache --help` imports neither Hydra, numba nor torch (the issue's target: <= 0.3 s)."""
    code = (
        "import sys; sys.argv = ['moecache', 'simulate', '--help']\n"
        "from moecache.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numba', 'hydra', 'pyarrow', 'omegaconf') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out


def test_multirun_writes_one_artifact_per_point(tmp_path):
    res = CliRunner().invoke(app, ["collect", "-m", "seed=0,1", f"output_root={tmp_path}", *SMALL])
    assert res.exit_code == 0, res.output
    found = sorted(p.name for p in (tmp_path / "collect").iterdir())
    assert len(found) == 2
    seeds = sorted(
        json.loads((tmp_path / "collect" / f / "manifest.json").read_text())["seed"] for f in found
    )
    assert seeds == [0, 1]


def test_artifacts_list_and_show(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(tmp_path))
    res = CliRunner().invoke(app, ["collect", *SMALL])
    assert res.exit_code == 0, res.output
    art = Path(res.stdout.strip().splitlines()[-1])
    listing = CliRunner().invoke(app, ["artifacts", "list"])
    assert listing.exit_code == 0 and art.name in listing.stdout
    shown = CliRunner().invoke(app, ["artifacts", "show", art.name])
    assert shown.exit_code == 0
    manifest = json.loads(shown.stdout[: shown.stdout.rindex("}") + 1])
    assert manifest["artifact_id"] == art.name and manifest["stage"] == "collect"
    missing = CliRunner().invoke(app, ["artifacts", "show", "collect-000000000000"])
    assert missing.exit_code != 0 and "no artifact" in missing.stderr


def _publish(store, stage, config, inputs=()):
    with store.create(stage, schema_version=1, config=config, inputs=list(inputs), seed=None):
        pass
    return [a for a in store.list(stage) if a.manifest["config"] == config][0]


def test_artifacts_list_prints_whole_ids_in_plain_columns(tmp_path):
    store = ArtifactStore(tmp_path)
    trace = _publish(store, "import_trace", {"name": "t"})
    sweep = _publish(store, "sweep", {"a": 1}, [trace.id, "/some/very/long/path/to/a/trace.parquet"])
    env = {"MOECACHE_OUTPUT_ROOT": str(tmp_path), "COLUMNS": "30"}
    res = CliRunner().invoke(app, ["artifacts", "list"], env=env)
    assert res.exit_code == 0 and "…" not in res.stdout
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["artifact", "id", "stage", "created", "inputs"]
    assert lines[1].split()[:2] == [trace.id, "import_trace"]
    assert lines[2].split()[:2] == [sweep.id, "sweep"]
    assert lines[2].endswith(f"{trace.id}, /some/very/long/path/to/a/trace.parquet")
    assert lines[1].index("import_trace") == lines[2].index("sweep")  # aligned columns
    only = CliRunner().invoke(app, ["artifacts", "list", "--stage", "import-trace"], env=env)
    assert only.exit_code == 0 and trace.id in only.stdout and sweep.id not in only.stdout


def test_artifacts_list_through_a_pipe_keeps_ids_whole(tmp_path):
    sweep = _publish(ArtifactStore(tmp_path), "sweep", {"a": 1})
    env = {**os.environ, "MOECACHE_OUTPUT_ROOT": str(tmp_path), "COLUMNS": "20"}
    out = subprocess.run(
        [sys.executable, "-m", "moecache.cli", "artifacts", "list"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and sweep.id in out.stdout.split() and "…" not in out.stdout


def test_artifacts_list_unknown_stage_is_an_error(tmp_path):
    res = CliRunner().invoke(
        app, ["artifacts", "list", "--stage", "sweeps"], env={"MOECACHE_OUTPUT_ROOT": str(tmp_path)}
    )
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert "--stage sweeps: no such stage; known: collect, calibrate, import-trace" in line


def test_artifacts_list_skips_a_damaged_manifest_and_show_refuses_it(tmp_path):
    store = ArtifactStore(tmp_path)
    good = _publish(store, "sweep", {"a": 1})
    bad = _publish(store, "sweep", {"a": 2})
    (bad.path / "manifest.json").write_text("{not json")
    env = {"MOECACHE_OUTPUT_ROOT": str(tmp_path)}
    res = CliRunner().invoke(app, ["artifacts", "list"], env=env)
    assert res.exit_code == 0 and good.id in res.stdout and bad.id not in res.stdout
    (warning,) = res.stderr.strip().splitlines()
    assert "warning" in warning and str(bad.path / "manifest.json") in warning
    shown = CliRunner().invoke(app, ["artifacts", "show", bad.id], env=env)
    assert shown.exit_code == 2
    (line,) = shown.stderr.strip().splitlines()
    assert line.startswith("moecache artifacts show: error: ") and str(bad.path / "manifest.json") in line


def test_artifacts_show_takes_a_unique_prefix(tmp_path):
    store = ArtifactStore(tmp_path)
    arts = [_publish(store, "sweep", {"a": i}) for i in range(30)]
    env = {"MOECACHE_OUTPUT_ROOT": str(tmp_path)}
    target = arts[0]
    n = next(n for n in range(7, 19) if sum(a.id.startswith(target.id[:n]) for a in arts) == 1)
    shown = CliRunner().invoke(app, ["artifacts", "show", target.id[:n]], env=env)
    assert (
        shown.exit_code == 0
        and json.loads(shown.stdout[: shown.stdout.rindex("}") + 1])["artifact_id"] == target.id
    )
    ambiguous = CliRunner().invoke(app, ["artifacts", "show", "sweep-"], env=env)
    assert ambiguous.exit_code == 2
    (line,) = ambiguous.stderr.strip().splitlines()
    assert "'sweep-' is ambiguous" in line and all(a.id in line for a in arts)
