"""Intervals over repeated runs (`python -m minipd bench --repeats N`): a percentile bootstrap.

A point (workload x rate x mode) run N times with seeds seed..seed+N-1 gives N values of each
metric (one per run: its TTFT p90, its goodput, ...). `bootstrap_ci` resamples those N values with
replacement, computes the statistic (the median) of each resample, and takes the middle
`confidence` of the resampled statistics as the interval: it says how much the median could move
with other seeds (other requests, other arrival times) on this machine, not how the mode would do
on another. `ratio_ci` does the same for a paired A/B ratio: mode A and mode B ran on the same N
seeds, so repeat i of A and repeat i of B saw the same requests; the repeat indices are resampled
jointly and each resample gives stat(A) / stat(B).

With one value there is no interval (lo = hi = None). With few values (under 5) the interval is
rough: the resampled medians can only take values among the ones measured, so it can be no wider
than their range, and it covers the true median less often than `confidence` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

ROUGH_BELOW = 5  # fewer repeats than this: the report calls the interval rough


def bootstrap_ci(values: Sequence[float], stat: Callable = np.median, n_resamples: int = 2000,
                 confidence: float = 0.95, seed: int = 0) -> tuple[float | None, float | None, float | None]:  # fmt: skip
    """(stat(values), lo, hi): the percentile bootstrap interval of `stat` over `values` (one per
    repeat). No values: (None, None, None); one value: (that value's stat, None, None)."""
    x = _array(values)
    if x.size == 0:
        return None, None, None
    point = float(stat(x))
    if x.size == 1:
        return point, None, None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    boots = _stat_rows(stat, x[idx])
    lo, hi = _bounds(boots, confidence)
    return point, lo, hi


def ratio_ci(a_values: Sequence[float], b_values: Sequence[float], stat: Callable = np.median, n_resamples: int = 2000,
             confidence: float = 0.95, seed: int = 0) -> tuple[float | None, float | None, float | None]:  # fmt: skip
    """(stat(a) / stat(b), lo, hi) for paired samples: a_values[i] and b_values[i] come from the same
    repeat (the same seed). The repeat indices are resampled jointly. The ratio is inf where only
    the denominator is 0 and None where both are; resamples with 0 / 0 are left out of the interval.
    No pairs: (None, None, None); one pair: (the ratio, None, None)."""
    a, b = _array(a_values), _array(b_values)
    if a.size != b.size:
        raise ValueError(f"ratio_ci needs paired samples: {a.size} values against {b.size}")
    if a.size == 0:
        return None, None, None
    point = _ratio(float(stat(a)), float(stat(b)))
    if a.size == 1 or point is None:
        return point, None, None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_resamples, a.size))
    num, den = _stat_rows(stat, a[idx]), _stat_rows(stat, b[idx])
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = np.where(den != 0, num / np.where(den != 0, den, 1.0), np.where(num > 0, np.inf, np.nan))
    boots = boots[~np.isnan(boots)]
    if boots.size == 0:
        return point, None, None
    lo, hi = _bounds(boots, confidence)
    return point, lo, hi


def is_rough(n: int) -> bool:
    """An interval from n repeats is rough (see the module's doc)."""
    return 1 < n < ROUGH_BELOW


def _array(values: Sequence[float]) -> np.ndarray:
    return np.asarray([float(v) for v in values], dtype=float)


def _stat_rows(stat: Callable, rows: np.ndarray) -> np.ndarray:
    """stat of each row: along axis 1 where stat takes `axis` (numpy's do), else row by row."""
    try:
        out = np.asarray(stat(rows, axis=1), dtype=float)
        if out.shape == (rows.shape[0],):
            return out
    except TypeError:
        pass
    return np.asarray([float(stat(row)) for row in rows], dtype=float)


def _bounds(boots: np.ndarray, confidence: float) -> tuple[float, float]:
    """The (1 - confidence) / 2 and (1 + confidence) / 2 quantiles; with infinities among them the
    nearest order statistics (interpolating between inf and inf gives nan)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    q = [(1 - confidence) / 2, (1 + confidence) / 2]
    method = "linear" if np.isfinite(boots).all() else "nearest"
    lo, hi = np.quantile(boots, q, method=method)
    return float(lo), float(hi)


def _ratio(a: float, b: float) -> float | None:
    if math.isnan(a) or math.isnan(b):
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b
