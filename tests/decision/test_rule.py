"""The decision rule (moecache/decision/rule.py): the verdict boundaries and the validation of every key."""

from __future__ import annotations

import copy
import math

import pytest

from moecache.config import compose, to_container
from moecache.decision.rule import COMPETITIVE, VERDICTS, Rule, classify
from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec
from moecache.stages.decide import rule_config

# the pre-registered rule as shipped (conf/decide/default.yaml)
DEFAULT = rule_config(to_container(compose([])))

M = 0.02


@pytest.mark.parametrize(
    "lo, hi, verdict",
    [
        (-0.5, -0.1, "better"),
        (-0.01, -1e-12, "better"),  # hi just below 0
        (-0.01, 0.0, "equivalent"),  # hi == 0 is not better; -0.02 < -0.01 and 0 < 0.02
        (-0.019, 0.019, "equivalent"),
        (0.001, 0.019, "equivalent"),  # equivalent even if slower for sure, within the margin
        (-0.02, 0.01, "non_inferior"),  # lo == -margin is not inside (-m, m)
        (-0.5, 0.019, "non_inferior"),
        (-0.5, 0.02, "inconclusive"),  # hi == margin: not non-inferior; lo <= 0: not worse
        (0.0, 0.05, "inconclusive"),  # lo == 0 is not > 0
        (1e-12, 0.02, "worse"),  # lo just above 0 and hi == margin
        (0.03, 0.08, "worse"),
        (float("nan"), 0.0, "inconclusive"),
        (None, None, "inconclusive"),
    ],
)
def test_classify_boundaries(lo, hi, verdict):
    assert classify(lo, hi, M) == verdict


def test_competitive_labels():
    assert COMPETITIVE == {"better", "equivalent", "non_inferior"}
    assert set(VERDICTS) == COMPETITIVE | {"worse", "inconclusive"}


def test_round_trip_of_the_default_rule():
    rule = Rule.from_dict(DEFAULT)
    assert rule.baseline == PolicySpec.of("static_hindsight")
    # the candidate's parameters with the policy's defaults filled in: lfu {} is the same policy
    assert rule.candidates == (PolicySpec.of("lfu", {}),)
    assert rule.candidates[0].params == {"reset_per_request": False, "init_counts": None}
    assert rule.extensions.policies == "all" and rule.extensions.exclude == ("belady",)
    assert rule.bootstrap.resamples == 2000 and rule.bootstrap.min_requests == 8
    assert rule.useful_range == (0.2, 0.95) and rule.max_hit_rate_deficit == 0.05
    assert rule.transfers.max_bytes_per_token is None and rule.transfers.max_link_busy == 1.0
    assert rule.required_workloads == ("multi_request", "long_single")
    canonical = {**DEFAULT, "candidates": [PolicySpec.of("lfu").to_dict()]}
    assert rule.to_dict() == canonical
    assert Rule.from_dict(rule.to_dict()) == rule


def test_left_out_keys_take_the_defaults_and_are_recorded():
    rule = Rule.from_dict({"baseline": DEFAULT["baseline"], "candidates": DEFAULT["candidates"]})
    expected = {
        **DEFAULT,
        "candidates": [PolicySpec.of("lfu").to_dict()],
        "workloads": {"required": None},
        "extensions": {"policies": "all", "exclude": ["belady"], "prefix_fraction": 0.5, "preference": []},
    }
    assert rule.to_dict() == expected


def test_useful_range_ends_are_included():
    rule = Rule.from_dict(DEFAULT)
    assert rule.in_useful_range(0.2) and rule.in_useful_range(0.95) and rule.in_useful_range(0.5)
    assert not rule.in_useful_range(0.19) and not rule.in_useful_range(0.951)
    assert not rule.in_useful_range(None)


def with_value(path: str, value):
    d = copy.deepcopy(DEFAULT)
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[last] = value
    return d


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("margin", 0, "decide.margin=0"),
        ("margin", 1.0, "decide.margin=1.0"),
        ("margin", "0.02", "decide.margin='0.02'"),
        ("margin", math.nan, "decide.margin=nan"),
        ("confidence", 0.5, "decide.confidence=0.5"),
        ("confidence", 1, "decide.confidence=1"),
        ("bootstrap.resamples", 99, "decide.bootstrap.resamples=99"),
        ("bootstrap.resamples", 200.0, "decide.bootstrap.resamples=200.0"),
        ("bootstrap.resamples", True, "decide.bootstrap.resamples=True"),
        ("bootstrap.min_requests", 0, "decide.bootstrap.min_requests=0"),
        ("useful_range.baseline_hit_rate", [0.5, 0.5], r"decide.useful_range.baseline_hit_rate=\[0.5, 0.5\]"),
        ("useful_range.baseline_hit_rate", [-0.1, 0.5], "decide.useful_range.baseline_hit_rate"),
        ("useful_range.baseline_hit_rate", [0.2, 1.1], "decide.useful_range.baseline_hit_rate"),
        ("useful_range.baseline_hit_rate", 0.5, "decide.useful_range.baseline_hit_rate=0.5"),
        ("hit_rate.max_deficit", -0.01, "decide.hit_rate.max_deficit=-0.01"),
        ("transfers.max_bytes_per_token", 0, "decide.transfers.max_bytes_per_token=0"),
        ("transfers.max_link_busy", -1, "decide.transfers.max_link_busy=-1"),
        ("workloads.required", "long_single", "decide.workloads.required='long_single'"),
        ("workloads.required", [], r"decide.workloads.required=\[\]"),
        ("workloads.required", ["ok", ""], r"decide.workloads.required\[1\]=''"),
        ("seed", -1, "decide.seed=-1"),
        ("mode", "fast", "decide.mode='fast'"),
        ("metric", "hit_rate", "decide.metric='hit_rate'"),
        ("candidates", [], r"decide.candidates=\[\]"),
        ("candidates", [{"params": {}}], r"decide.candidates\[0\].policy: missing"),
        ("candidates", [{"policy": "lfu", "params": [1]}], r"decide.candidates\[0\].params=\[1\]"),
        ("candidates", [{"policy": "lfu", "parms": {}}], r"decide.candidates\[0\].parms: unknown key"),
        ("candidates", [{"policy": "static_hindsight"}], r"decide.candidates\[0\]=.*is the baseline"),
        (
            "candidates",
            [{"policy": "lfu"}, {"policy": "lfu", "params": {}}],
            r"candidates\[1\].*listed twice",
        ),
        ("baseline", {"policy": ""}, "decide.baseline.policy=''"),
        ("bootstrap", {"resamples": 2000, "min_request": 8}, "decide.bootstrap.min_request: unknown key"),
        ("margn", 0.02, "decide.margn: unknown key"),
        ("predictive", {"policies": []}, "decide.predictive: unknown key"),
        ("candidates", [{"policy": "lruu"}], r"decide.candidates\[0\]: unknown policy 'lruu'"),
        (
            "candidates",
            [{"policy": "lfu", "params": {"x": 1}}],
            r"decide.candidates\[0\]: lfu .*unknown param",
        ),
        ("extensions.policies", "some", "decide.extensions.policies='some'"),
        ("extensions.policies", [], r"decide.extensions.policies=\[\]"),
        ("extensions.exclude", ["lru", "lru"], r"decide.extensions.exclude=.*twice"),
        ("extensions.preference", "lru", "decide.extensions.preference='lru'"),
        ("extensions.policies", ["lru", "lruu"], r"decide.extensions.policies\[1\]: unknown policy 'lruu'"),
        ("extensions.exclude", ["Belady"], r"decide.extensions.exclude\[0\]: unknown policy 'Belady'"),
        ("extensions.prefix_fraction", 1.0, "decide.extensions.prefix_fraction=1.0"),
        ("extensions", {"polices": "all"}, "decide.extensions.polices: unknown key"),
    ],
)
def test_bad_values_name_their_key(path, value, message):
    with pytest.raises(MoecacheError, match=message):
        Rule.from_dict(with_value(path, value))


def test_missing_required_keys():
    with pytest.raises(MoecacheError, match="decide.baseline: missing"):
        Rule.from_dict({"candidates": DEFAULT["candidates"]})
    with pytest.raises(MoecacheError, match="decide.candidates: missing"):
        Rule.from_dict({"baseline": DEFAULT["baseline"]})
    with pytest.raises(MoecacheError, match="must be a mapping"):
        Rule.from_dict(["baseline"])


def test_distinct_params_are_distinct_candidates():
    rule = Rule.from_dict(
        with_value(
            "candidates",
            [
                {"policy": "lfu_decay", "params": {"half_life_tokens": 64}},
                {"policy": "lfu_decay", "params": {}},
            ],
        )
    )
    # {} is the policy's default half-life (128), not 64
    assert [c.params for c in rule.candidates] == [{"half_life_tokens": 64}, {"half_life_tokens": 128}]
