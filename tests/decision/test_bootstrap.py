"""The paired ratio-of-sums bootstrap (moecache/decision/bootstrap.py) on hand-computable cases."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.decision.bootstrap import paired_ratio_bootstrap, resample_counts
from moecache.errors import MoecacheError


def noisy(seed: int, units: int = 40):
    """A baseline row and a candidate row 5% slower on average, with independent unit noise."""
    rng = np.random.default_rng(seed)
    den_U = rng.integers(1, 50, size=units).astype(float)  # tokens
    base_U = den_U * rng.uniform(0.5, 2.0, size=units)  # us: very different speeds per unit
    cand_U = base_U * 1.05 * (1 + rng.uniform(-0.1, 0.1, size=units))
    return np.stack([base_U, cand_U]), np.stack([den_U, den_U])


def test_resample_counts_are_seeded_draws_with_replacement():
    counts_BU = resample_counts(7, 500, seed=3)
    assert counts_BU.shape == (500, 7)
    assert np.all(counts_BU.sum(axis=1) == 7)  # U draws per resample
    assert np.all(counts_BU >= 0) and counts_BU.max() > 1  # with replacement: some unit drawn twice
    assert abs(counts_BU.mean() - 1.0) < 1e-12  # 7 draws over 7 units: mean count exactly 1
    np.testing.assert_array_equal(counts_BU, resample_counts(7, 500, seed=3))
    assert not np.array_equal(counts_BU, resample_counts(7, 500, seed=4))


def test_same_seed_same_result_different_seed_different():
    num_PU, den_PU = noisy(0)
    a = paired_ratio_bootstrap(num_PU, den_PU, 0, 500, seed=1, confidence=0.9)
    b = paired_ratio_bootstrap(num_PU, den_PU, 0, 500, seed=1, confidence=0.9)
    c = paired_ratio_bootstrap(num_PU, den_PU, 0, 500, seed=2, confidence=0.9)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a[0], c[0])  # the point estimate does not depend on the seed
    assert a[1][1] != c[1][1] and a[2][1] != c[2][1]


def test_identical_labels_give_zero_and_a_zero_interval():
    num_PU = np.array([[3.0, 5.0, 11.0], [3.0, 5.0, 11.0]])
    den_PU = np.array([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    rel, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 0, 1000, seed=0, confidence=0.9)
    # every resample: the same sums for both rows -> r = 1 - 1 = 0 exactly
    np.testing.assert_array_equal(rel, [0.0, 0.0])
    np.testing.assert_array_equal(lo, [0.0, 0.0])
    np.testing.assert_array_equal(hi, [0.0, 0.0])


def test_ten_percent_slower_on_every_unit():
    num_PU = np.array([[3.0, 5.0, 11.0, 7.0], [3.3, 5.5, 12.1, 7.7], [3.0, 5.0, 11.0, 7.0]])
    den_PU = np.array([[1.0, 2.0, 4.0, 3.0]] * 3)
    rel, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 2, 1000, seed=0, confidence=0.9)
    # baseline row 2: stat = 26 / 10 = 2.6; row 1: 28.6 / 10 = 2.86 -> r = 2.86 / 2.6 - 1 = 0.1.
    # Any resample scales both sums alike (paired), so every resampled r is 0.1 too: CI [0.1, 0.1].
    np.testing.assert_allclose(rel, [0.0, 0.1, 0.0], atol=1e-12)
    np.testing.assert_allclose(lo, [0.0, 0.1, 0.0], atol=1e-12)
    np.testing.assert_allclose(hi, [0.0, 0.1, 0.0], atol=1e-12)


def test_two_units_hand_enumerated():
    # baseline num [1, 3], candidate num [2, 3], den [1, 1]. The point estimate: 5/2 / (4/2) - 1 = 0.25.
    # Resamples of 2 units: counts (2,0) p=1/4 -> r = 2/1 - 1 = 1; (1,1) p=1/2 -> 0.25; (0,2) p=1/4 -> 3/3 - 1 = 0.
    # 90% percentile interval: the 5% quantile lies in the 0-mass (25%), the 95% one in the 1-mass: [0, 1].
    num_PU = np.array([[1.0, 3.0], [2.0, 3.0]])
    den_PU = np.ones((2, 2))
    rel, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 0, 4000, seed=5, confidence=0.9)
    assert rel[1] == pytest.approx(0.25)
    assert lo[1] == pytest.approx(0.0) and hi[1] == pytest.approx(1.0)
    # a 40% interval: quantiles 0.30 and 0.70 both fall in the middle (1,1)-mass [0.25, 0.75]: [0.25, 0.25]
    _, lo40, hi40 = paired_ratio_bootstrap(num_PU, den_PU, 0, 4000, seed=5, confidence=0.4)
    assert lo40[1] == pytest.approx(0.25) and hi40[1] == pytest.approx(0.25)


def test_interval_covers_the_truth_about_as_often_as_promised():
    # truth r = 1.05 * E[sum base (1 + eps)] / sum base - 1 = 0.05 (eps has mean 0)
    covered = 0
    reps = 200
    for seed in range(reps):
        num_PU, den_PU = noisy(1000 + seed)
        _, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 0, 400, seed=seed, confidence=0.9)
        covered += lo[1] <= 0.05 <= hi[1]
    assert 0.8 <= covered / reps <= 0.97  # 90% nominal; binomial sd over 200 reps ~ 0.02


def test_interval_narrows_with_confidence_and_contains_the_estimate():
    num_PU, den_PU = noisy(7)
    rel, lo90, hi90 = paired_ratio_bootstrap(num_PU, den_PU, 0, 2000, seed=0, confidence=0.9)
    _, lo60, hi60 = paired_ratio_bootstrap(num_PU, den_PU, 0, 2000, seed=0, confidence=0.6)
    assert lo90[1] < lo60[1] < rel[1] < hi60[1] < hi90[1]


def test_one_unit_collapses_to_the_point_estimate():
    # 4.4 / 2 / (4 / 2) - 1 = 0.1; one unit: every resample is the data itself
    rel, lo, hi = paired_ratio_bootstrap([[4.0], [4.4]], [[2.0], [2.0]], 0, 100, seed=0, confidence=0.9)
    np.testing.assert_allclose([rel[1], lo[1], hi[1]], [0.1, 0.1, 0.1])


def test_zero_denominators_are_undefined_not_errors():
    # label 1 has no tokens at all: stat 0/0 undefined -> NaN everywhere.
    # label 2 has tokens only on unit 0: resamples drawing unit 1 twice (0/0) are dropped; every other
    # resample gives (2 c0) / c0 = 2 vs the baseline's (1 c0 + 0) / c0 = 1 (unit 1 also has no baseline
    # tokens) -> r = 1 exactly.
    num_PU = np.array([[1.0, 0.0], [1.0, 2.0], [2.0, 0.0]])
    den_PU = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    rel, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 0, 500, seed=0, confidence=0.9)
    assert rel[0] == 0.0 and np.isnan(rel[1]) and rel[2] == 1.0
    assert np.isnan(lo[1]) and np.isnan(hi[1])
    assert lo[2] == 1.0 and hi[2] == 1.0


def test_zero_baseline_statistic_makes_every_ratio_undefined():
    rel, lo, hi = paired_ratio_bootstrap([[0.0, 0.0], [1.0, 2.0]], np.ones((2, 2)), 0, 200, 0, 0.9)
    assert np.isnan(rel).all() and np.isnan(lo).all() and np.isnan(hi).all()


@pytest.mark.parametrize(
    "num, den, baseline, confidence, match",
    [
        (np.ones((2, 3)), np.ones((2, 2)), 0, 0.9, "same"),
        (np.ones(3), np.ones(3), 0, 0.9, "same"),
        (np.ones((2, 3)), np.ones((2, 3)), 2, 0.9, "baseline=2"),
        (np.ones((2, 3)), np.ones((2, 3)), 0, 1.0, "confidence=1.0"),
        (np.ones((2, 0)), np.ones((2, 0)), 0, 0.9, "at least one"),
    ],
)
def test_bad_input_is_named(num, den, baseline, confidence, match):
    with pytest.raises(MoecacheError, match=match):
        paired_ratio_bootstrap(num, den, baseline, 100, 0, confidence)
