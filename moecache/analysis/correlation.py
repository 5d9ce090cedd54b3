"""Correlation coefficients the analyses share (numpy only): Pearson, average ranks, Spearman.

Legend: N values.
"""

from __future__ import annotations

import numpy as np


def pearson(x_N: np.ndarray, y_N: np.ndarray) -> float | None:
    """Pearson correlation, clamped to [-1, 1] against rounding; None with fewer than 2 values or a
    constant side."""
    x_N, y_N = np.asarray(x_N, np.float64), np.asarray(y_N, np.float64)
    if x_N.size < 2:
        return None
    dx, dy = x_N - x_N.mean(), y_N - y_N.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return min(1.0, max(-1.0, float((dx * dy).sum() / denom))) if denom > 0 else None


def average_ranks(x_N: np.ndarray) -> np.ndarray:
    """float64 [N]: 1-based ranks of x ascending, tied values sharing the mean of their ranks."""
    _, inverse_N, count_U = np.unique(np.asarray(x_N), return_inverse=True, return_counts=True)
    last_rank_U = np.cumsum(count_U)  # a group of c ties occupies ranks last-c+1 .. last
    return (last_rank_U - 0.5 * (count_U - 1))[inverse_N.ravel()].astype(np.float64)


def spearman(x_N: np.ndarray, y_N: np.ndarray) -> float | None:
    """Spearman rank correlation (Pearson of average ranks); None when either side is constant."""
    x_N, y_N = np.asarray(x_N), np.asarray(y_N)
    if x_N.size < 2 or np.all(x_N == x_N[0]) or np.all(y_N == y_N[0]):
        return None
    return pearson(average_ranks(x_N), average_ranks(y_N))
