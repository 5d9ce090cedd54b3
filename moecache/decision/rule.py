"""The pre-registered decision rule (conf/decide/*.yaml, docs/decision.md) and the verdict of one cell.

The baseline and the candidates are PolicySpecs (name, params with the class's defaults filled in); the
second part (`extensions`) names policies only, their parameter sets are the sweep's.

`Rule.from_dict` validates every key of the rule and names it (`decide.<key>`) with the bad value; unknown
keys are errors too, so a misspelt setting cannot silently fall back to its default. Keys left out take
the defaults below (those of conf/decide/default.yaml); `Rule.to_dict` gives the fully resolved rule, the
one recorded in decision.json.

Verdict of a cell for a label X against the baseline, from the interval [lo, hi] of
r = metric_X / metric_baseline - 1 (lower is better) and the relative equivalence margin m:
  better        hi < 0
  equivalent    -m < lo and hi < m   (and not better)
  non_inferior  hi < m               (otherwise)
  worse         lo > 0 and hi >= m
  inconclusive  otherwise (also when lo or hi is undefined)
A cell with fewer than MIN_UNITS units has no estimable uncertainty and is judged inconclusive whatever
its interval (the caller applies MIN_UNITS; `classify` sees only the interval).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec

VERDICTS = ("better", "equivalent", "non_inferior", "worse", "inconclusive")
COMPETITIVE = frozenset({"better", "equivalent", "non_inferior"})
METRICS = ("est_ms_per_token",)
MODES = ("instant", "timed")
MIN_UNITS = 2  # fewer units: no uncertainty can be estimated, the cell is inconclusive


def classify(lo: float | None, hi: float | None, margin: float) -> str:
    """The verdict of an interval [lo, hi] of the relative difference (lower is better)."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "inconclusive"
    if hi < 0:
        return "better"
    if -margin < lo and hi < margin:
        return "equivalent"
    if hi < margin:
        return "non_inferior"
    if lo > 0 and hi >= margin:
        return "worse"
    return "inconclusive"


def _fail(key: str, value, why: str) -> MoecacheError:
    return MoecacheError(f"decide.{key}={value!r}: {why}")


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(key, value, "must be a finite number")
    return float(value)


def _integer(key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(key, value, f"must be an integer >= {minimum}")
    return int(value)


def _open_interval(key: str, value, lo: float, hi: float) -> float:
    x = _number(key, value)
    if not lo < x < hi:
        raise _fail(key, value, f"must be in ({lo:g}, {hi:g})")
    return x


def _mapping(key: str, value, allowed: Sequence[str]) -> Mapping:
    if not isinstance(value, Mapping):
        raise _fail(key, value, "must be a mapping")
    for k in value:
        if k not in allowed:
            raise MoecacheError(f"decide.{key}.{k}: unknown key (expected one of {list(allowed)})")
    return value


def _text(key: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, value, "must be a non-empty string")
    return value


@dataclass(frozen=True)
class Bootstrap:
    resamples: int = 2000
    min_requests: int = 8  # units are requests when a trace has at least this many, else blocks


@dataclass(frozen=True)
class Transfers:
    max_bytes_per_token: float | None = None  # None: no bound
    max_link_busy: float | None = 1.0  # None: no bound


ALL = "all"


@dataclass(frozen=True)
class Extensions:
    """The second part (decision/extensions.py): which policies are judged and how one is preferred."""

    policies: tuple[str, ...] | str = ALL  # "all": every swept policy but the baseline's and `exclude`
    exclude: tuple[str, ...] = ("belady",)  # never judged (the offline bound is not a runnable policy)
    prefix_fraction: float = 0.5  # parameters chosen on this share of each trace's tokens
    preference: tuple[str, ...] = ()  # among consistent policies, these first in this order

    def judged(self, swept: list[str], baseline: str) -> list[str]:
        """The policy names judged, given the names swept (sorted) and the baseline's name."""
        if self.policies == ALL:
            return [n for n in sorted(set(swept)) if n != baseline and n not in self.exclude]
        return list(self.policies)


@dataclass(frozen=True, kw_only=True)
class Rule:
    baseline: PolicySpec
    candidates: tuple[PolicySpec, ...]  # in order of preference
    mode: str = "timed"
    metric: str = "est_ms_per_token"
    margin: float = 0.02
    confidence: float = 0.90
    bootstrap: Bootstrap = Bootstrap()
    useful_range: tuple[float, float] = (0.2, 0.95)  # baseline hit rate, both ends included
    max_hit_rate_deficit: float = 0.05
    transfers: Transfers = Transfers()
    required_workloads: tuple[str, ...] | None = None  # None: the workloads present
    extensions: Extensions = Extensions()
    seed: int = 0

    @classmethod
    def from_dict(cls, d) -> Rule:
        top = (
            "baseline",
            "candidates",
            "mode",
            "metric",
            "margin",
            "confidence",
            "bootstrap",
            "useful_range",
            "hit_rate",
            "transfers",
            "workloads",
            "extensions",
            "seed",
        )
        if not isinstance(d, Mapping):
            raise MoecacheError(f"decide: the rule must be a mapping, got {type(d).__name__}")
        for k in d:
            if k not in top:
                raise MoecacheError(f"decide.{k}: unknown key (expected one of {list(top)})")
        if "baseline" not in d:
            raise MoecacheError("decide.baseline: missing")
        if "candidates" not in d:
            raise MoecacheError("decide.candidates: missing")
        kw: dict = {}
        kw["baseline"] = PolicySpec.from_dict(d["baseline"], "decide.baseline")

        cands = d["candidates"]
        if isinstance(cands, str | bytes) or not isinstance(cands, Sequence) or not cands:
            raise _fail("candidates", cands, "must be a non-empty list of {policy, params}")
        kw["candidates"] = tuple(
            PolicySpec.from_dict(c, f"decide.candidates[{i}]") for i, c in enumerate(cands)
        )
        seen = [kw["baseline"]]
        for i, c in enumerate(kw["candidates"]):
            if c in seen:  # equal policy and params
                what = "the baseline" if c == kw["baseline"] else "listed twice"
                raise _fail(f"candidates[{i}]", c.to_dict(), f"is {what}")
            seen.append(c)

        if "mode" in d:
            if d["mode"] not in MODES:
                raise _fail("mode", d["mode"], f"expected one of {list(MODES)}")
            kw["mode"] = d["mode"]
        if "metric" in d:
            if d["metric"] not in METRICS:
                raise _fail("metric", d["metric"], f"expected one of {list(METRICS)}")
            kw["metric"] = d["metric"]
        if "margin" in d:
            kw["margin"] = _open_interval("margin", d["margin"], 0.0, 1.0)
        if "confidence" in d:
            kw["confidence"] = _open_interval("confidence", d["confidence"], 0.5, 1.0)
        if "bootstrap" in d:
            b = _mapping("bootstrap", d["bootstrap"], ("resamples", "min_requests"))
            default = Bootstrap()
            kw["bootstrap"] = Bootstrap(
                resamples=_integer("bootstrap.resamples", b.get("resamples", default.resamples), 100),
                min_requests=_integer(
                    "bootstrap.min_requests", b.get("min_requests", default.min_requests), 1
                ),
            )
        if "useful_range" in d:
            u = _mapping("useful_range", d["useful_range"], ("baseline_hit_rate",))
            if "baseline_hit_rate" in u:
                kw["useful_range"] = _range("useful_range.baseline_hit_rate", u["baseline_hit_rate"])
        if "hit_rate" in d:
            h = _mapping("hit_rate", d["hit_rate"], ("max_deficit",))
            if "max_deficit" in h:
                x = _number("hit_rate.max_deficit", h["max_deficit"])
                if not 0 <= x <= 1:
                    raise _fail("hit_rate.max_deficit", h["max_deficit"], "must be in [0, 1]")
                kw["max_hit_rate_deficit"] = x
        if "transfers" in d:
            t = _mapping("transfers", d["transfers"], ("max_bytes_per_token", "max_link_busy"))
            default = Transfers()
            kw["transfers"] = Transfers(
                max_bytes_per_token=_bound(
                    "transfers.max_bytes_per_token", t.get("max_bytes_per_token", default.max_bytes_per_token)
                ),
                max_link_busy=_bound(
                    "transfers.max_link_busy", t.get("max_link_busy", default.max_link_busy)
                ),
            )
        if "workloads" in d:
            w = _mapping("workloads", d["workloads"], ("required",))
            req = w.get("required")
            if req is not None:
                if isinstance(req, str | bytes) or not isinstance(req, Sequence) or not req:
                    raise _fail(
                        "workloads.required", req, "must be a non-empty list of workload names or null"
                    )
                kw["required_workloads"] = tuple(
                    _text(f"workloads.required[{i}]", x) for i, x in enumerate(req)
                )
        if "extensions" in d:
            kw["extensions"] = _extensions(d["extensions"])
        if "seed" in d:
            kw["seed"] = _integer("seed", d["seed"], 0)
        return cls(**kw)

    def to_dict(self) -> dict:
        """The resolved rule, in the layout of the config file (JSON-serialisable)."""
        return {
            "baseline": self.baseline.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "mode": self.mode,
            "metric": self.metric,
            "margin": self.margin,
            "confidence": self.confidence,
            "bootstrap": {"resamples": self.bootstrap.resamples, "min_requests": self.bootstrap.min_requests},
            "useful_range": {"baseline_hit_rate": list(self.useful_range)},
            "hit_rate": {"max_deficit": self.max_hit_rate_deficit},
            "transfers": {
                "max_bytes_per_token": self.transfers.max_bytes_per_token,
                "max_link_busy": self.transfers.max_link_busy,
            },
            "workloads": {
                "required": list(self.required_workloads) if self.required_workloads is not None else None
            },
            "extensions": {
                "policies": ALL if self.extensions.policies == ALL else list(self.extensions.policies),
                "exclude": list(self.extensions.exclude),
                "prefix_fraction": self.extensions.prefix_fraction,
                "preference": list(self.extensions.preference),
            },
            "seed": self.seed,
        }

    def in_useful_range(self, baseline_hit_rate: float | None) -> bool:
        lo, hi = self.useful_range
        return baseline_hit_rate is not None and lo <= baseline_hit_rate <= hi


def _range(key: str, value) -> tuple[float, float]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != 2:
        raise _fail(key, value, "must be a pair [a, b] with 0 <= a < b <= 1")
    a, b = (_number(key, x) for x in value)
    if not 0 <= a < b <= 1:
        raise _fail(key, value, "must be a pair [a, b] with 0 <= a < b <= 1")
    return a, b


def _bound(key: str, value) -> float | None:
    if value is None:
        return None
    x = _number(key, value)
    if x <= 0:
        raise _fail(key, value, "must be a positive number or null")
    return x


def _names(key: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail(key, value, "must be a list of policy names")
    names = tuple(_text(f"{key}[{i}]", x) for i, x in enumerate(value))
    for i, n in enumerate(names):
        PolicySpec.of(n, {}, f"decide.{key}[{i}]")  # an unknown policy name is an error naming it
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _fail(key, list(value), f"lists {twice} twice")
    return names


def _extensions(value) -> Extensions:
    e = _mapping("extensions", value, ("policies", "exclude", "prefix_fraction", "preference"))
    default = Extensions()
    policies = e.get("policies", default.policies)
    if policies != ALL:
        policies = _names("extensions.policies", policies)
        if not policies:
            raise _fail("extensions.policies", value.get("policies"), f"must be {ALL!r} or a non-empty list")
    return Extensions(
        policies=policies,
        exclude=_names("extensions.exclude", e.get("exclude", list(default.exclude))),
        prefix_fraction=_open_interval(
            "extensions.prefix_fraction", e.get("prefix_fraction", default.prefix_fraction), 0.0, 1.0
        ),
        preference=_names("extensions.preference", e.get("preference", [])),
    )
