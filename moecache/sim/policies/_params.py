"""Checks of the policies' parameters, shared by their constructors.

Every check reads `policy.params[key]` and raises a MoecacheError that names the policy, the parameter,
what it must be and what it got, e.g. `policy lfu_decay: half_life_tokens must be a positive number,
got 0`. A bool is never taken for a number (Python's True is an int): it is refused as one.
`trace_file` resolves a parameter that names a trace (lfu's `init_counts`, profile_static's `profile`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moecache.errors import MoecacheError


def is_int(x) -> bool:
    """Whether x is an integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def is_number(x) -> bool:
    """Whether x is a finite real number (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_) and math.isfinite(x)


def require(policy, key: str, ok: bool, what: str) -> None:
    """Raise unless `ok`: the parameter `key` of `policy` must be `what` (in words)."""
    if not ok:
        raise MoecacheError(f"policy {policy.name}: {key} must be {what}, got {policy.params[key]!r}")


def require_ints(policy, **lows: int) -> None:
    """Every parameter named in `lows` must be an integer >= its bound there."""
    for key, low in lows.items():
        x = policy.params[key]
        require(policy, key, is_int(x) and x >= low, f"an integer >= {low}")


def require_number(policy, key: str, within: Callable[[float], bool], what: str) -> None:
    """The parameter `key` must be a finite real number for which `within` holds (`what`: in words)."""
    x = policy.params[key]
    require(policy, key, is_number(x) and within(x), what)


def trace_file(path, what: str) -> Path:
    """The trace Parquet file a policy parameter names (the file, or an artifact folder holding
    trace.parquet); one line naming the parameter (`what`) where there is none."""
    p = Path(path)
    if not p.exists():
        raise MoecacheError(f"{what}={path}: no such file or folder")
    if p.is_dir():
        p = p / "trace.parquet"
        if not p.is_file():
            raise MoecacheError(f"{what}={path}: the folder holds no trace.parquet")
    return p
