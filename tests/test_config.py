"""The real Hydra config tree: every option of every group composes, each stage's root holds what the stage
reads and nothing else; bad input is a clear error."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moecache.config import CONF_DIR, compose, to_container
from moecache.config_tree import COMMON, stage_keys, stages
from moecache.config_values import check_config
from moecache.errors import MoecacheError

GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir() and p.name != COMMON)
STAGES = stages()


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


def test_every_command_has_a_root():
    from moecache.cli import STAGES as COMMANDS

    assert set(STAGES) == {*COMMANDS, "generate"}


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
    with pytest.raises(
        MoecacheError, match=re.escape("policy=lruu: no such option (did you mean lru?); known: ")
    ):
        compose(["policy=lruu"])
    with pytest.raises(MoecacheError, match=re.escape("policy=LRU: no such option (did you mean lru?);")):
        compose(["policy=LRU"], stage="simulate")
    assert "policy" not in compose([])


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_root_is_what_the_stage_reads_and_its_defaults_pass(stage, tmp_path):
    """conf/<stage>.yaml composes exactly the keys moecache/config_tree.py lists for it (a group with no
    option selected, `policy`, composes to nothing); every interpolation in it resolves, so a stage's
    group never refers to a key the stage does not read; and the shipped defaults pass every value check
    of the stage (only `capacity`, which simulate requires, needs to be given)."""
    cfg = compose([f"output_root={tmp_path}"], stage=stage)
    keys = stage_keys(stage)
    assert {str(k) for k in cfg} == {k.split(".")[0] for k in keys} - {"policy"}
    parts = [k.split(".", 1) for k in keys if "." in k]  # analyze: sweep.capacities, sweep.policies
    for top in {top for top, _ in parts}:
        assert set(cfg[top]) == {sub for t, sub in parts if t == top}
    c = to_container(cfg)
    check_config(stage, {**c, "capacity": 4} if stage == "simulate" else c)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_tree_is_part_of_the_whole_tree(stage):
    """conf/config.yaml (the Python API's root) holds every stage's keys with the same defaults, so a
    stage run from `compose(overrides)` and from its command computes the same thing."""
    whole = to_container(compose([]))
    part = to_container(compose([], stage=stage))
    for key, value in part.items():
        if key == "sweep" and stage == "analyze":
            assert {k: whole["sweep"][k] for k in value} == value
        else:
            assert whole[key] == value, key


def test_a_stage_accepts_what_it_reads_and_refuses_the_rest():
    cfg = compose(
        ["capacity=4", "+policy.name=lru", "sim.mode=instant", "hydra/launcher=joblib"], stage="simulate"
    )
    assert cfg.policy.name == "lru" and cfg.sim.mode == "instant"
    assert (
        compose(["sweep.capacities.dense_step=4", "seed=3"], stage="analyze").sweep.capacities.dense_step == 4
    )
    assert compose(
        ["policy=lru", "capacity=4", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], stage="sweep"
    )
    refused = [
        (
            "analyze",
            "sweep.targets=[0.5]",
            "sweep.targets=[0.5]: `moecache analyze` does not read `sweep.targets`",
        ),
        ("analyze", "+sweep.targets=[0.5]", "does not read `sweep.targets`"),
        (
            "simulate",
            "decide.margin=9",
            "decide.margin=9: `moecache simulate` does not read `decide` (it reads ",
        ),
        ("simulate", "+decide.margin=9", "+decide.margin=9: `moecache simulate` does not read `decide`"),
        ("simulate", "~decide", "~decide: `moecache simulate` does not read `decide`"),
        ("simulate", "model=tiny", "model=tiny: `moecache simulate` does not read `model`"),
        ("simulate", "+model=tiny", "+model=tiny: `moecache simulate` does not read `model`"),
        (
            "report",
            "seed=3",
            "seed=3: `moecache report` does not read `seed` (it reads report, output_root, force)",
        ),
        (
            "simulate",
            "sim.bandwith_scale=2",
            "no such key `sim.bandwith_scale` (did you mean sim.bandwidth_scale?)",
        ),
    ]
    for stage, override, message in refused:
        with pytest.raises(MoecacheError) as info:
            compose([override], stage=stage)
        assert message in str(info.value) and "\n" not in str(info.value), (stage, override, str(info.value))
    with pytest.raises(MoecacheError, match="unknown stage 'simulat'; known: analyze, calibrate"):
        compose([], stage="simulat")


def test_value_checks_know_the_simulator_modes_and_scales():
    from moecache import config_values
    from moecache.sim import sweep

    assert config_values.MODES == sweep.MODES and config_values.SCALES == sweep.SCALES
