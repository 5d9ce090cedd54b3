"""The real Hydra config tree: every option of every group composes; bad input is a clear error."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moecache.config import CONF_DIR, compose, to_container
from moecache.config_values import check_config
from moecache.errors import MoecacheError
from moecache.stage_keys import STAGE_KEYS, check_overrides, stage_reads

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


def test_an_unknown_policy_option_is_an_error_not_lfu():
    """`policy` is not an `optional` group: Hydra would skip a missing option of one silently."""
    with pytest.raises(MoecacheError, match="policy/lruu"):
        compose(["policy=lruu"])
    with pytest.raises(MoecacheError, match="policy/LRU"):
        compose(["policy=LRU"])
    assert "policy" not in compose([])


@pytest.mark.parametrize("stage", list(STAGE_KEYS))
def test_every_key_a_stage_reads_exists_and_its_defaults_pass(stage, tmp_path):
    """The table of moecache/stage_keys.py names real config keys, and the shipped defaults pass every
    value check of the stage (only `capacity`, which simulate requires, needs to be given)."""
    c = to_container(compose([f"output_root={tmp_path}"]))
    for key in STAGE_KEYS[stage]:
        node = c
        for part in key.split("."):
            if key == "policy":
                break  # selected by policy=<name>; absent by default
            assert part in node, f"{stage} reads {key}, which the config does not have"
            node = node[part]
    check_config(stage, {**c, "capacity": 4} if stage == "simulate" else c)


def test_check_overrides_accepts_what_a_stage_reads():
    check_overrides(
        "simulate", ["capacity=4", "+policy.name=lru", "sim.mode=instant", "hydra/launcher=joblib"], CONF_DIR
    )
    check_overrides("analyze", ["sweep.capacities.dense_step=4", "seed=3"], CONF_DIR)
    check_overrides("sweep", ["policy=lru,lfu", "capacity=4,8", "hydra.launcher.n_jobs=2"], CONF_DIR)
    with pytest.raises(MoecacheError, match="does not read `sweep`"):
        check_overrides("analyze", ["sweep.targets=[0.5]"], CONF_DIR)
    with pytest.raises(MoecacheError, match="unknown stage"):
        check_overrides("simulat", [], CONF_DIR)


@pytest.mark.parametrize("stage", list(STAGE_KEYS))
def test_every_interpolation_in_a_stage_group_is_a_key_the_stage_reads(stage):
    """`seed: ${seed}` in conf/decide makes decide read `seed`; the table must say so, or the override
    `moecache decide seed=3` would be refused although it changes the result."""
    for group in STAGE_KEYS[stage]:
        for path in sorted((Path(CONF_DIR) / group).glob("*.yaml")):
            for ref in re.findall(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)", path.read_text()):
                if not ref.startswith("oc.") and ref != "hydra":
                    assert stage_reads(stage, ref), f"{path.name}: ${{{ref}}} is not in STAGE_KEYS[{stage!r}]"


def test_value_checks_know_the_simulator_modes_and_scales():
    from moecache import config_values
    from moecache.sim import sweep

    assert config_values.MODES == sweep.MODES and config_values.SCALES == sweep.SCALES
