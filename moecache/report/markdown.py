"""Markdown building blocks: number formatting and pipe tables.

Every number printed comes from an artifact; these helpers only format it (None and NaN print as "n/a").
"""

from __future__ import annotations

import math


def missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def num(value, digits: int = 4) -> str:
    """A number with `digits` significant digits (integers in full); "n/a" when missing.
    E.g. num(0.123456) -> "0.1235", num(12) -> "12", num(True) -> "true"."""
    if missing(value):
        return "n/a"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def pct(value, digits: int = 2, sign: bool = True) -> str:
    """A fraction as a percentage: pct(-0.0123) -> "-1.23%"; "n/a" when missing."""
    if missing(value):
        return "n/a"
    return f"{100 * value:{'+' if sign else ''}.{digits}f}%"


def interval(lo, hi) -> str:
    """A confidence interval of fractions as percentages: interval(-0.03, 0.01) -> "[-3.00%, +1.00%]"."""
    if missing(lo) or missing(hi):
        return "n/a"
    return f"[{pct(lo)}, {pct(hi)}]"


def cell(value) -> str:
    """Text safe inside a pipe-table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown pipe table with a header row."""
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def code(text) -> str:
    """Inline code, for labels and file names."""
    return f"`{text}`"
