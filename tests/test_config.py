"""The real Hydra config tree: every option of every group composes; bad input is a clear error."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moecache.config import CONF_DIR, compose, to_container
from moecache.errors import MoecacheError

GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir())


@pytest.mark.parametrize(
    "group,option",
    [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))],
)
def test_every_config_option_composes(group, option, tmp_path):
    cfg = compose([f"{group}={option}", f"output_root={tmp_path}"])
    assert cfg[group] is not None
    if OmegaConf.is_missing(cfg[group], "path"):
        return  # real checkpoints and external traces need a path; see test_missing_checkpoint_path_is_named
    to_container(cfg)


def test_groups_exist():
    assert {"model", "workload", "logging", "cost", "trace_import"} <= set(GROUPS)


def test_unknown_key_is_named():
    with pytest.raises(MoecacheError, match="generation.max_new_tokenz"):
        compose(["generation.max_new_tokenz=3"])


def test_unknown_group_option_is_named():
    with pytest.raises(MoecacheError, match="no_such_model"):
        compose(["model=no_such_model"])


def test_missing_checkpoint_path_is_named():
    cfg = compose(["model=qwen3_6_35b_a3b"])
    with pytest.raises(MoecacheError, match="model.path"):
        to_container(cfg)


def test_output_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(tmp_path))
    assert compose([]).output_root == str(tmp_path)
