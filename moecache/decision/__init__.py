"""The pre-registered statistical decision: which policy to select from a sweep (docs/decision.md).

rule.py: the rule and the verdict of a cell; bootstrap.py: the paired bootstrap; decide.py: the first
part (candidates against the baseline); extensions.py: the second part (every other swept policy,
parameters chosen on a prefix, judged on held-out tokens and other workloads).
"""

from moecache.decision.bootstrap import paired_ratio_bootstrap, resample_counts
from moecache.decision.decide import VERDICT_SCHEMA, cell_seed, decide
from moecache.decision.rule import COMPETITIVE, MIN_UNITS, VERDICTS, Rule, classify

__all__ = [
    "COMPETITIVE",
    "MIN_UNITS",
    "VERDICTS",
    "VERDICT_SCHEMA",
    "Rule",
    "cell_seed",
    "classify",
    "decide",
    "paired_ratio_bootstrap",
    "resample_counts",
]
