"""validate.repeats' schedule and choice (moecache/validation/repeats.py)."""

from __future__ import annotations

import pytest

from moecache.validation.repeats import kept, rounds


def test_every_other_round_runs_the_plan_last_to_first():
    assert list(rounds(["a", "b", "c"], 3)) == [
        (0, 0, "a"), (0, 1, "b"), (0, 2, "c"),
        (1, 2, "c"), (1, 1, "b"), (1, 0, "a"),
        (2, 0, "a"), (2, 1, "b"), (2, 2, "c"),
    ]  # fmt: skip
    assert list(rounds(["a", "b"], 1)) == [(0, 0, "a"), (0, 1, "b")]


def test_fewer_than_one_round_is_refused():
    with pytest.raises(ValueError, match="repeats=0"):
        list(rounds(["a"], 0))


@pytest.mark.parametrize(
    ("times", "index"),
    [
        ([5.0], 0),
        ([7.0, 5.0], 1),  # even: the lower middle
        ([5.0, 7.0], 0),
        ([9.0, 5.0, 7.0], 2),
        ([6.0, 6.0, 1.0, 9.0], 0),  # among equal times the earliest
        ([4.0, 8.0, 6.0, 2.0, 10.0], 2),
    ],
)
def test_the_repeat_of_median_time_is_kept(times, index):
    assert kept(times) == index


def test_no_repeat_is_refused():
    with pytest.raises(ValueError, match="no repeat"):
        kept([])
