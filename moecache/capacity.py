"""One capacity syntax for every stage that sizes an expert cache (simulate, sweep, the runtime).

A capacity is the number of GPU expert slots, written one of three ways:

- a slot count: a non-negative integer (`16`, or the string `"16"`), at most the number of experts;
- a percentage of all (layer, expert) keys: `"25%"`, `"12.5%"`, from 0% to 100%;
- a memory budget, where the size of one expert is known: `"12GiB"`, `"512MiB"`, `"1.5GB"` (binary
  units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB, or B).

Rounding rule (the same for percentages and budgets): slots = floor(exact amount), computed in exact
decimal arithmetic, so `25%` of 1664 keys is 416 and `10%` of 24 keys is 2 (2.4 rounded down). Rounding
down never gives the cache more than it was given, which is what a budget means. A memory budget larger
than every expert together means "everything fits": it gives every key a slot. A slot count or a
percentage above the total is refused, since it cannot mean what it says.

Refused, each with one line naming `key` and the value: floats (`3.7`, even `4.0`: a slot count is
whole), booleans, empty lists, nested lists, negative numbers, unknown units and anything else.

The syntax is checked without the trace (`capacity_spec`), so a stage refuses a malformed value before it
reads anything; resolving to slots (`CapacitySpec.slots`) needs the trace's key count and expert size.
Independent of Hydra: `moecache.offload(capacity="25%")` will use the same functions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from moecache.errors import MoecacheError

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_PERCENT_RE = re.compile(rf"^{_NUMBER}\s*%$")
_BYTES_RE = re.compile(rf"^{_NUMBER}\s*([A-Za-z]+)$")
_INT_RE = re.compile(r"^\d+$")
HELP = "an integer slot count (16), a percentage of all experts ('25%') or a memory budget ('12GiB')"


@dataclass(frozen=True)
class CapacitySpec:
    """A parsed capacity, not yet resolved to slots: kind is 'slots', 'percent' or 'bytes'."""

    kind: str
    amount: int | Decimal
    text: str  # as the user wrote it, for messages

    def slots(self, *, key: str, num_keys: int, expert_bytes: int | None) -> int:
        """The slot count for a model (or trace) of `num_keys` experts of `expert_bytes` bytes each."""
        if self.kind == "slots":
            if self.amount > num_keys:
                raise MoecacheError(
                    f"{key}={self.text}: more slots than experts ({num_keys} in all); "
                    f"use at most {num_keys} or '100%'"
                )
            return int(self.amount)
        if self.kind == "percent":
            return math.floor(self.amount * num_keys / 100)
        if not expert_bytes:
            raise MoecacheError(
                f"{key}={self.text}: a memory budget needs the expert size, which is unknown here; "
                "give a slot count or a percentage"
            )
        return min(num_keys, math.floor(self.amount / expert_bytes))


def capacity_spec(value, *, key: str) -> CapacitySpec:
    """Check the syntax of one capacity value (see the module docstring); refuse anything else."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise MoecacheError(f"{key}={_show(value)}: expected {HELP}")
    if isinstance(value, int):
        if value < 0:
            raise MoecacheError(f"{key}={value}: a slot count cannot be negative")
        return CapacitySpec("slots", value, str(value))
    text = value.strip()
    if _INT_RE.match(text):
        return CapacitySpec("slots", int(text), text)
    if m := _PERCENT_RE.match(text):
        percent = _decimal(m.group(1), key, value)
        if percent > 100:
            raise MoecacheError(f"{key}={value}: a percentage of all experts must be from 0% to 100%")
        return CapacitySpec("percent", percent, text)
    if m := _BYTES_RE.match(text):
        unit = m.group(2)
        if unit not in UNITS:
            raise MoecacheError(f"{key}={value}: unknown unit {unit!r}; use one of {', '.join(UNITS)}")
        return CapacitySpec("bytes", _decimal(m.group(1), key, value) * UNITS[unit], text)
    raise MoecacheError(f"{key}={_show(value)}: expected {HELP}")


def capacity_specs(value, *, key: str) -> list[CapacitySpec]:
    """The list form: one capacity or a non-empty list of them."""
    if isinstance(value, list | tuple):
        if not value:
            raise MoecacheError(f"{key}=[]: an empty list names no capacity; expected {HELP}, or a list")
        return [capacity_spec(v, key=f"{key}[{i}]") for i, v in enumerate(value)]
    return [capacity_spec(value, key=key)]


def parse_capacity(value, *, key: str, num_keys: int, expert_bytes: int | None) -> int:
    """One capacity value as a slot count for `num_keys` experts of `expert_bytes` bytes each."""
    return capacity_spec(value, key=key).slots(key=key, num_keys=num_keys, expert_bytes=expert_bytes)


def parse_capacities(value, *, key: str, num_keys: int, expert_bytes: int | None) -> list[int]:
    """One capacity or a list of them as slot counts, in the order given; two entries that come to the
    same slot count are refused (they would be the same replay twice)."""
    slots = []
    for i, spec in enumerate(capacity_specs(value, key=key)):
        where = f"{key}[{i}]" if isinstance(value, list | tuple) else key
        n = spec.slots(key=where, num_keys=num_keys, expert_bytes=expert_bytes)
        if n in slots:
            raise MoecacheError(
                f"{where}={spec.text}: comes to {n} slots, like an earlier entry of {key}; list each once"
            )
        slots.append(n)
    return slots


def _decimal(text: str, key: str, value) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:  # the regular expressions admit only plain decimals; kept for safety
        raise MoecacheError(f"{key}={_show(value)}: expected {HELP}") from None


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)
