"""Paired percentile bootstrap of ratio-of-sums statistics, relative to a baseline label.

Legend: P labels (policies of one cell; one of them the baseline), U units (requests or blocks, the
independent pieces of evidence), B resamples.

The statistic of label p is a ratio of sums over the units, stat_p = sum_u num[p, u] / sum_u den[p, u]
(e.g. total microseconds / tokens), and the compared quantity is r_p = stat_p / stat_baseline - 1.
One set of resamples is shared by every label (paired: a resample takes the same units for all labels),
so the noise common to all labels (a long request, a slow block) cancels in r_p. A resample is a row of
counts_BU (how often each unit was drawn; U draws with replacement, i.e. a multinomial), so the resampled
sums are the matrix products counts_BU @ num_PU.T.

Undefined values are NaN: a label whose total denominator is zero, or whose baseline statistic is zero,
has no r. A resample whose r is undefined (every drawn unit has a zero denominator) is left out of that
label's percentiles; a label with no defined resample gets a NaN interval.

With a single unit nothing about the uncertainty can be learnt: every resample is the data itself and
the interval collapses to the point estimate. The decision rule refuses to judge such cells
(moecache/decision/rule.py, MIN_UNITS).
"""

from __future__ import annotations

import warnings

import numpy as np

from moecache.errors import MoecacheError

Seed = int | np.random.SeedSequence


def resample_counts(units: int, resamples: int, seed: Seed) -> np.ndarray:
    """counts_BU (float64): row b holds how often each of the U units is drawn in resample b (U draws
    with replacement from `np.random.default_rng(seed)`; every row sums to U)."""
    if units < 1:
        raise MoecacheError(f"bootstrap: units={units}: need at least one unit")
    if resamples < 1:
        raise MoecacheError(f"bootstrap: resamples={resamples}: need at least one resample")
    rng = np.random.default_rng(seed)
    return rng.multinomial(units, np.full(units, 1.0 / units), size=resamples).astype(np.float64)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den elementwise; NaN where it is not a finite number (zero denominator)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.asarray(num / den, dtype=np.float64)
    out[~np.isfinite(out)] = np.nan
    return out


def paired_ratio_bootstrap(
    num_PU, den_PU, baseline: int, resamples: int, seed: Seed, confidence: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rel_P, lo_P, hi_P): the relative difference r_p = stat_p / stat_baseline - 1 on the data, and the
    two-sided percentile interval of r_p at `confidence` over `resamples` paired resamples of the units.

    rel/lo/hi of the baseline row are 0. NaN marks an undefined value (see the module docstring).
    With U == 1 the interval is the point estimate (lo = hi = rel).
    """
    num_PU = np.asarray(num_PU, dtype=np.float64)
    den_PU = np.asarray(den_PU, dtype=np.float64)
    if num_PU.ndim != 2 or num_PU.shape != den_PU.shape:
        raise MoecacheError(
            f"bootstrap: numerator {num_PU.shape} and denominator {den_PU.shape} must be the same (P, U)"
        )
    P, U = num_PU.shape
    if P < 1 or U < 1:
        raise MoecacheError(f"bootstrap: need at least one label and one unit, got (P, U) = ({P}, {U})")
    if not 0 <= baseline < P:
        raise MoecacheError(f"bootstrap: baseline={baseline} is not a label index in [0, {P})")
    if not 0 < confidence < 1:
        raise MoecacheError(f"bootstrap: confidence={confidence} must be in (0, 1)")

    stat_P = _ratio(num_PU.sum(axis=1), den_PU.sum(axis=1))
    rel_P = _ratio(stat_P, stat_P[baseline]) - 1.0
    if U == 1:
        return rel_P, rel_P.copy(), rel_P.copy()

    counts_BU = resample_counts(U, resamples, seed)
    stat_BP = _ratio(counts_BU @ num_PU.T, counts_BU @ den_PU.T)
    rel_BP = _ratio(stat_BP, stat_BP[:, baseline : baseline + 1]) - 1.0
    alpha = (1.0 - confidence) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: undefined labels
        lo_P, hi_P = np.nanquantile(rel_BP, [alpha, 1.0 - alpha], axis=0)
    return rel_P, np.asarray(lo_P, np.float64), np.asarray(hi_P, np.float64)
