"""Which swept labels the decision names, and in what role: the policies the report draws in colour.

A label is only a join key; a policy's identity is its (name, params) from the sweep's `policy` and
`params` columns (moecache/sim/policy_spec.py), so the report never parses a label. Roles, in order of
precedence (a label takes the first that applies): the selected policy, the first-part selection (the
reference of the second part), the best generic policy, the baseline, a first-part candidate, LRU, the
Belady bound (the warm Belady labels if swept, else every Belady label) and the other Belady variants.
"""

from __future__ import annotations

import pyarrow as pa

from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec

ROLES = ("selected", "first_part", "best_generic", "baseline", "candidate", "lru", "bound", "belady")
# Not drawn as policy curves: the bound is drawn as one dashed line; other Belady variants not at all (an
# offline optimum under other settings is no runnable policy and would read as one).
HIDDEN = frozenset({"bound", "belady"})
ROLE_NAMES = {
    "selected": "selected",
    "first_part": "first-part selection",
    "best_generic": "best generic",
    "baseline": "baseline",
    "candidate": "candidate",
    "lru": "LRU",
    "bound": "Belady bound",
    "belady": "Belady variant",
}
ROLE_COLORS = {
    "selected": "#d62728",
    "first_part": "#1f77b4",
    "best_generic": "#9467bd",
    "baseline": "#2ca02c",
    "candidate": "#17becf",
    "lru": "#ff7f0e",
    "bound": "#000000",
    "belady": "#000000",
}
ROLE_STYLES = {"baseline": "--", "candidate": ":"}  # line styles; "-" otherwise
OTHER_COLOR = "#c8c8c8"


def label_specs(sweep: pa.Table | None) -> dict[str, PolicySpec]:
    """label -> PolicySpec of every sweep row's label (the first row of a label decides)."""
    if sweep is None or sweep.num_rows == 0:
        return {}
    out: dict[str, PolicySpec] = {}
    for row in sweep.select(["label", "policy", "params"]).to_pylist():
        if row["label"] not in out:
            out[row["label"]] = PolicySpec.from_row(row, f"sweep.parquet (label {row['label']!r})")
    return out


def bound_labels(specs: dict[str, PolicySpec]) -> list[str]:
    """The Belady labels that make the bound: the warm ones if any, else every Belady label, sorted."""
    belady = sorted(x for x, s in specs.items() if s.name == "belady")
    warm = [x for x in belady if specs[x].params.get("warm") is True]
    return warm or belady


def _label_of(entry: dict | None, specs: dict[str, PolicySpec]) -> str | None:
    """The sweep label of a decision.json entry {policy, params, label}, matched by (name, params)."""
    if not entry or not entry.get("policy"):
        return None
    try:
        spec = PolicySpec.of(entry["policy"], entry.get("params") or {}, "decision.json")
    except MoecacheError:  # a policy this code no longer knows: fall back to the recorded label
        return entry.get("label")
    return next((x for x, s in specs.items() if s == spec), entry.get("label"))


def label_roles(decision: dict | None, specs: dict[str, PolicySpec]) -> dict[str, str]:
    """label -> role of every label the decision names (plus LRU and the bound), in ROLES order."""
    d = decision or {}
    named: list[tuple[str, str | None]] = [
        ("selected", _label_of(d.get("selected"), specs)),
        ("first_part", _label_of(d.get("first_part"), specs)),
        ("best_generic", _label_of(d.get("best_generic"), specs)),
        ("baseline", _label_of(d.get("baseline"), specs)),
    ]
    named += [("candidate", _label_of(c, specs)) for c in (d.get("rule") or {}).get("candidates") or []]
    named += [("lru", x) for x, s in sorted(specs.items()) if s.name == "lru"]
    named += [("bound", x) for x in bound_labels(specs)]
    named += [("belady", x) for x, s in sorted(specs.items()) if s.name == "belady"]
    out: dict[str, str] = {}
    for role, label in named:
        if label is not None and label in specs and label not in out:
            out[label] = role
    return out
