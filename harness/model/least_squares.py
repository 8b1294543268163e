"""Non-negative linear least squares for the model's fits: every cost term (a start-up, a
per-byte time) is ≥ 0, and a negative coefficient from a plain least squares is noise, not a
cost. Small problems only (a handful of terms): every subset of the columns is tried."""

from __future__ import annotations

import itertools

import numpy as np


def nonneg_lstsq(a, b) -> tuple[np.ndarray, float]:
    """(c ≥ 0 minimizing |a·c − b|², that squared residual): the best over every subset of
    ``a``'s columns whose own least-squares solution is non-negative (the rest 0). Columns
    that are copies of each other leave the later ones 0."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    best, best_res = np.zeros(a.shape[1]), float(b @ b)
    for n in range(1, a.shape[1] + 1):
        for keep in itertools.combinations(range(a.shape[1]), n):
            sub = a[:, keep]
            if np.linalg.matrix_rank(sub) < n:
                continue
            coef = np.linalg.lstsq(sub, b, rcond=None)[0]
            if (coef < 0).any():
                continue
            residual = sub @ coef - b
            res = float(residual @ residual)
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = np.zeros(a.shape[1]), res
                best[list(keep)] = coef
    return best, best_res


def relative_fit(columns: list, y) -> list[float]:
    """Coefficients ≥ 0 of y ≈ Σ c_i·columns_i, least squares relative to y (so a 70 KiB point
    weighs as much as a 256 MiB one)."""
    y = np.asarray(y, dtype=float)
    a = np.column_stack([np.asarray(c, dtype=float) / y for c in columns])
    coef, _ = nonneg_lstsq(a, np.ones(len(y)))
    return [float(c) for c in coef]
