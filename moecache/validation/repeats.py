"""validate.repeats: each offloaded run measured more than once, the repeat of median time kept (the
same alternating rounds drive benchmarks/bench_decode.py --rounds).

A shared machine's speed drifts over minutes (docs/benchmarks.md, "Simulator fidelity": the CPU probe timed
before each run moved by -39% to +62% within one validate of the Qwen3.6 shape on an H100), so one timed run
per strategy and capacity carries whatever window it fell in. With N repeats the plan's runs go N times
over, every other round last to first, so that no run is always early or always late in the workload's
sequence; each (strategy, capacity) keeps the repeat of median time per token (the lower middle of an even
N): its row, trace and prediction, with every repeat's time beside it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")


def rounds(plan: Sequence[Item], repeats: int) -> Iterator[tuple[int, int, Item]]:
    """(round, index in plan, item) for `repeats` rounds over `plan`: even rounds in order, odd ones
    reversed."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected at least 1")
    order = list(enumerate(plan))
    for r in range(repeats):
        for i, item in order if r % 2 == 0 else reversed(order):
            yield r, i, item


def kept(times: Sequence[float]) -> int:
    """Which repeat to keep: the index of the median of `times` (the lower middle of an even count;
    among equal times the earliest repeat)."""
    if not times:
        raise ValueError("kept: no repeat")
    ranked = sorted(range(len(times)), key=lambda i: (times[i], i))
    return ranked[(len(times) - 1) // 2]
