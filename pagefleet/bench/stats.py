"""The statistics every benchmark reports, defined once.

`percentile` is the only percentile in the bench package: the q-quantile with linear
interpolation between order statistics, numpy's default (`numpy.percentile(x, 100 * q)`,
method "linear"). A p99 in one report is the same statistic as a p99 in another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (q in 0..1) with linear interpolation between order statistics
    (numpy's default); NaN for no values.

    Sorted values x[0..n-1]: the quantile sits at position q * (n - 1), between
    x[floor(pos)] and the next one, in proportion. p50 is the median (the mean of the
    two middle values for an even n).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs; NaN with fewer than 3 points or no spread in xs."""
    if len(xs) < 3:
        return math.nan
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
