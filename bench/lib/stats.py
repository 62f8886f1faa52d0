"""Statistics every driver reports the same way."""

from __future__ import annotations

import math


def percentile(values, p: float) -> float | None:
    """Nearest rank: the smallest value with at least p % of the values at
    or below it (p in percent); None without values. Every table reports
    its percentiles this way, so a p99 means one thing across studies."""
    xs = sorted(values)
    if not xs:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(xs)))
    return xs[rank - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where it has no meaning (a missing value, b zero, NaN)."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b

