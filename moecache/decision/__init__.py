"""The pre-registered statistical decision: which policy to select from a sweep (rule.py: the rule and the
verdict of a cell; bootstrap.py: the paired bootstrap; decide.py: both applied to a sweep)."""

from moecache.decision.bootstrap import paired_ratio_bootstrap, resample_counts
from moecache.decision.decide import VERDICT_SCHEMA, cell_seed, decide
from moecache.decision.rule import COMPETITIVE, MIN_UNITS, VERDICTS, PolicyRef, Rule, classify

__all__ = [
    "COMPETITIVE",
    "MIN_UNITS",
    "VERDICTS",
    "VERDICT_SCHEMA",
    "PolicyRef",
    "Rule",
    "cell_seed",
    "classify",
    "decide",
    "paired_ratio_bootstrap",
    "resample_counts",
]
