"""moecache/compose_cache.py: a cached composition is the composition; any change of its inputs misses."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from moecache import compose_cache
from moecache.config import CONF_DIR, _hydra_compose, compose
from moecache.errors import MoecacheError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECACHE_COMPOSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    "stage,overrides",
    [
        (None, []),
        ("simulate", ["policy=lru", "capacity=416"]),
        (None, ["model=deepseek_v2_lite", "sweep.workers=2", "traces=[a,b]"]),
        ("analyze", ["sweep.capacities.dense_step=4", "traces=[a,b]"]),
    ],
)
def test_cached_equals_composed(cache, stage, overrides):
    fresh = OmegaConf.to_yaml(_hydra_compose(overrides, CONF_DIR, with_hydra=False, stage=stage))
    first = compose(overrides, stage=stage)  # composes and stores
    assert len(list(cache.glob("*.pkl"))) == 1
    second = compose(overrides, stage=stage)  # loads
    assert OmegaConf.to_yaml(first) == OmegaConf.to_yaml(second) == fresh
    assert OmegaConf.is_struct(second) == OmegaConf.is_struct(first)


def test_key_covers_the_root_overrides_and_every_conf_file(cache, tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    base = compose_cache.key(conf, "simulate", ["policy=lru"])
    assert compose_cache.key(conf, "sweep", ["policy=lru"]) != base
    assert compose_cache.key(conf, "simulate", ["policy=lfu"]) != base
    assert compose_cache.key(conf, "simulate", ["capacity=4", "policy=lru"]) != compose_cache.key(
        conf, "simulate", ["policy=lru", "capacity=4"]
    )
    before = compose(["policy=lru"], conf, stage="simulate")
    (conf / "sim" / "default.yaml").write_text(
        (conf / "sim" / "default.yaml").read_text() + "\nextra_key: 1\n"
    )
    assert compose_cache.key(conf, "simulate", ["policy=lru"]) != base
    after = compose(["policy=lru"], conf, stage="simulate")
    assert "extra_key" in after.sim and "extra_key" not in before.sim
    edited = compose_cache.key(conf, "simulate", ["policy=lru"])
    (conf / "policy" / "new_one.yaml").write_text("name: lru\n")  # an added file
    added = compose_cache.key(conf, "simulate", ["policy=lru"])
    (conf / "policy" / "new_one.yaml").unlink()  # and removed again
    assert len({base, edited, added}) == 3 and compose_cache.key(conf, "simulate", ["policy=lru"]) == edited


def test_a_stage_and_the_whole_tree_are_cached_apart(cache):
    """The same overrides compose a different tree for each root: neither entry answers for the other."""
    whole = compose(["policy=lru"])
    simulate = compose(["policy=lru"], stage="simulate")
    assert len(list(cache.glob("*.pkl"))) == 2
    assert (
        "decide" in whole
        and "decide" not in simulate
        and compose(["policy=lru"], stage="simulate") == simulate
    )


def test_environment_is_read_at_resolve_time(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(tmp_path / "one"))
    assert compose([]).output_root == str(tmp_path / "one")
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(tmp_path / "two"))
    assert compose([]).output_root == str(tmp_path / "two")  # the cached entry keeps ${oc.env:...}


def test_corrupt_entry_is_recomposed(cache):
    compose(["policy=lru"])
    (entry,) = cache.glob("*.pkl")
    entry.write_bytes(b"not a pickle")
    assert compose(["policy=lru"]).policy.name == "lru"
    assert entry.read_bytes() != b"not a pickle"


def test_errors_are_not_cached(cache):
    with pytest.raises(MoecacheError, match="policy=lruu: no such option"):
        compose(["policy=lruu"])
    with pytest.raises(MoecacheError, match="does not read `decide`"):
        compose(["+decide.margin=9"], stage="simulate")  # Hydra composes it; the stage refuses it
    assert not list(cache.glob("*.pkl"))


def test_off_and_unwritable(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECACHE_COMPOSE_CACHE", "off")
    assert compose(["policy=lru"]).policy.name == "lru"
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MOECACHE_COMPOSE_CACHE", str(blocker / "sub"))  # cannot be created
    assert compose(["policy=lru"]).policy.name == "lru"
