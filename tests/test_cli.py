"""The `moecache` command: multirun, `artifacts list|show`, help for every stage."""

import json
from pathlib import Path

from typer.testing import CliRunner

from moecache.cli import STAGES, app

SMALL = ["workload.num_requests=1", "generation.max_new_tokens=2", "workload.max_prompt_tokens=32"]


def test_every_stage_has_help():
    for stage in STAGES:
        res = CliRunner().invoke(app, [stage, "--help"])
        assert res.exit_code == 0 and "Hydra overrides" in res.output


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
