"""A policy's identity (moecache/sim/policy_spec.py): canonical (name, params), the sweep's label, the one
reader of the params column; and every parameter set defined once (conf/policy = the class defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moecache.errors import MoecacheError
from moecache.sim.policy import POLICIES, make_policy
from moecache.sim.policy_spec import PolicySpec

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_defaults_are_filled_in_and_specs_compare_by_value():
    a = PolicySpec.of("lfu")
    b = PolicySpec.of("lfu", {"reset_per_request": False})
    assert a == b and hash(a) == hash(b)
    assert a.params == {"init_counts": None, "reset_per_request": False}
    assert a.params_json == '{"init_counts": null, "reset_per_request": false}'  # sorted keys, JSON
    assert PolicySpec.of("lfu", {"reset_per_request": True}) != a
    assert a.to_dict() == {"policy": "lfu", "params": {"init_counts": None, "reset_per_request": False}}
    assert PolicySpec.from_dict(a.to_dict(), "x") == a


@pytest.mark.parametrize(
    "name, params",
    [("lfu", {}), ("lfu", {"reset_per_request": True}), ("lru", {}), ("lfu_window", {"window_tokens": 64}),
     ("belady", {"warm": True}), ("transition_prefetch", {"budget": 2, "min_probability": 0.3}),
     ("impact", {"alpha": 0.1})],
)  # fmt: skip
def test_label_is_the_sweeps_label(name, params):
    assert PolicySpec.of(name, params).label() == make_policy(name, **params).label()


def test_from_row_reads_the_params_column():
    row = {"policy": "lfu_decay", "params": '{"half_life_tokens": 64}', "label": "whatever"}
    spec = PolicySpec.from_row(row)
    assert spec == PolicySpec.of("lfu_decay", {"half_life_tokens": 64})
    assert PolicySpec.from_row({"policy": "lru", "params": None}) == PolicySpec.of("lru")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: PolicySpec.of("lruu", {}, "where"), r"where: unknown policy 'lruu'"),
        (lambda: PolicySpec.of("LRU", {}, "where"), r"where: unknown policy 'LRU'"),
        (
            lambda: PolicySpec.of("lfu", {"reset": True}, "where"),
            r"where: lfu \{\"reset\": true\}: unknown parameter",
        ),
        (lambda: PolicySpec.of("lfu", [1], "where"), r"where.params=\[1\]: must be a mapping"),
        (lambda: PolicySpec.of("", {}, "where"), r"where.policy='': must be a non-empty"),
        (lambda: PolicySpec.of("lfu", {"init_counts": {1, 2}}, "where"), "where: params of lfu are not JSON"),
        (lambda: PolicySpec.from_dict({"policy": "lru", "parms": {}}, "where"), r"where.parms: unknown key"),
        (
            lambda: PolicySpec.from_row({"policy": "lru", "params": "{oops"}, "where"),
            r"where: params='\{oops'",
        ),
        (lambda: PolicySpec.from_row({"policy": "lru", "params": "[1]"}, "where"), "is not a JSON object"),
    ],
)
def test_bad_specs_name_the_culprit(call, message):
    with pytest.raises(MoecacheError, match=message):
        call()


@pytest.mark.parametrize("path", sorted((CONF / "policy").glob("*.yaml")), ids=lambda p: p.stem)
def test_conf_policy_is_the_class_default(path):
    # conf/policy/<name>.yaml is the single-policy default of `policy=<name>`: it must be the class's own
    # defaults (the one definition), so `policy=lfu` replays the sweep's `lfu` with its defaults
    conf = OmegaConf.to_container(OmegaConf.load(path))
    assert conf["name"] == path.stem and conf["name"] in POLICIES
    assert PolicySpec.of(conf["name"], conf["params"] or {}) == PolicySpec.of(conf["name"])
    assert (conf["params"] or {}) == POLICIES[conf["name"]].defaults


def test_every_registered_policy_has_a_conf_file():
    assert sorted(p.stem for p in (CONF / "policy").glob("*.yaml")) == sorted(POLICIES)
