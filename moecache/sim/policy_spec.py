"""A policy's identity: its registered name and its full parameter set, as one small frozen value.

Every stage after the sweep (decide, report, the runtime's decision.json) refers to a policy by this pair,
never by parsing its label. The parameters are canonical: the policy class's defaults filled in, keys
sorted, values JSON-able, so `lfu {}` and `lfu {reset_per_request: false}` are the same policy (the sweep
replays exactly that) and two specs compare and hash by value.

`PolicySpec.from_row` is the one place that reads the `params` column (a JSON string) of the sweep's
tables; `label()` is the sweep's label (moecache/sim/policy.py, `Policy.label`), computed from the pair.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moecache.errors import MoecacheError


def _policy_class(name: str, where: str):
    import moecache.sim.policies  # noqa: F401  (registers every policy)
    from moecache.sim.policy import POLICIES

    if name not in POLICIES:
        raise MoecacheError(f"{where}: unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]


@dataclass(frozen=True, order=True)
class PolicySpec:
    """(name, params) of one policy; `params_json` is the canonical JSON of the full parameter set."""

    name: str
    params_json: str

    @classmethod
    def of(cls, name: str, params: Mapping[str, Any] | None = None, where: str = "policy") -> PolicySpec:
        """The spec of policy `name` with `params` over its defaults; an unknown policy or parameter, or a
        value that is not JSON, is an error naming `where` (e.g. "decide.candidates[0]")."""
        if not isinstance(name, str) or not name:
            raise MoecacheError(f"{where}.policy={name!r}: must be a non-empty policy name")
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise MoecacheError(f"{where}.params={params!r}: must be a mapping of {name}'s parameters")
        cls_ = _policy_class(name, where)
        unknown = sorted(set(params) - set(cls_.defaults))
        if unknown:
            raise MoecacheError(
                f"{where}: {name} {_dumps(dict(params))}: unknown parameter(s) {unknown};"
                f" {name} takes {sorted(cls_.defaults) or 'none'}"
            )
        full = {**cls_.defaults, **params}
        try:
            text = _dumps(full)
        except (TypeError, ValueError) as e:
            raise MoecacheError(f"{where}: params of {name} are not JSON-serialisable ({e})") from e
        return cls(name, text)

    @classmethod
    def from_dict(cls, d: Mapping, where: str) -> PolicySpec:
        """From `{policy: <name>, params: {...}}` (the layout of conf/decide and of decision.json)."""
        if not isinstance(d, Mapping):
            raise MoecacheError(f"{where}={d!r}: must be a mapping {{policy, params}}")
        for k in d:
            if k not in ("policy", "params", "label"):
                raise MoecacheError(f"{where}.{k}: unknown key (expected policy, params)")
        if "policy" not in d:
            raise MoecacheError(f"{where}.policy: missing")
        return cls.of(d["policy"], d.get("params") or {}, where)

    @classmethod
    def selected_in(cls, path) -> PolicySpec:
        """The `selected: {policy, params}` of a decide stage's decision.json (docs/decision.md): the one
        reader of it for the runtime, `moecache.offload(decision=...)` and `moecache validate`."""
        from pathlib import Path

        path = Path(path)
        try:
            decision = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MoecacheError(f"{path}: cannot read the decision ({' '.join(str(exc).split())})") from exc
        if not isinstance(decision, dict) or not isinstance(decision.get("selected"), dict):
            raise MoecacheError(f"{path}: no `selected: {{policy, params}}` object (not a decision.json?)")
        return cls.from_dict(decision["selected"], f"{path}: selected")

    @staticmethod
    def on_miss_in(path) -> str:
        """The `on_miss` a decision.json's selection was judged under (the sweep's sim.on_miss); "cpu"
        for a decision that does not say (made before the key existed)."""
        from pathlib import Path

        try:
            decision = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MoecacheError(f"{path}: cannot read the decision ({' '.join(str(exc).split())})") from exc
        from moecache.sim.miss_split import ON_MISS_CODES

        on_miss = decision.get("on_miss", "cpu") if isinstance(decision, dict) else "cpu"
        if on_miss not in ON_MISS_CODES:
            raise MoecacheError(f"{path}: on_miss={on_miss!r}: expected one of {', '.join(ON_MISS_CODES)}")
        return on_miss

    @classmethod
    def from_row(cls, row: Mapping, where: str = "sweep.parquet") -> PolicySpec:
        """From a table row with `policy` and `params` (a JSON object as text) columns."""
        text = row.get("params")
        try:
            params = json.loads(text) if text is not None else {}
        except (TypeError, ValueError) as e:
            raise MoecacheError(
                f"{where}: params={text!r} of policy {row.get('policy')!r} is not JSON ({e})"
            ) from e
        if not isinstance(params, dict):
            raise MoecacheError(
                f"{where}: params={text!r} of policy {row.get('policy')!r} is not a JSON object"
            )
        return cls.of(row.get("policy"), params, where)

    @property
    def params(self) -> dict:
        """The full parameter set (a fresh dict)."""
        return json.loads(self.params_json)

    @property
    def weighs_costs(self) -> bool:
        """Whether the policy reads measured costs (Policy.weighs_costs: the runtime needs a profile)."""
        return bool(_policy_class(self.name, "policy").weighs_costs)

    def label(self) -> str:
        """The sweep's label of this policy, e.g. `lfu_window(window_tokens=256)` (Policy.label)."""
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}({inner})" if inner else self.name

    def to_dict(self) -> dict:
        """{policy, params}: what decision.json holds and the runtime reads."""
        return {"policy": self.name, "params": self.params}

    def describe(self) -> str:
        return f"{self.name} {self.params_json}"


def _dumps(params: dict) -> str:
    return json.dumps(params, sort_keys=True, allow_nan=False)
