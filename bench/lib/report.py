"""Markdown tables and the formats of their cells, one way for every driver."""

from __future__ import annotations

import math


def table(headers: list[str], rows: list[list], numeric: bool = False) -> str:
    """A Markdown table; `numeric` right-aligns every column but the first."""
    rule = "|" + "|".join("---:" if numeric and i else "---" for i in range(len(headers))) + "|"
    lines = ["| " + " | ".join(headers) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def missing(x) -> bool:
    return x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x)))


def cell(v, unit: str = "", fmt: str = "") -> str:
    """A value with its unit, or a dash where there is none."""
    return "–" if missing(v) else f"{v:{fmt}}{unit}"


def fmt_ratio(x: float | None) -> str:
    return "–" if missing(x) else f"{x:.2f}×"


def times(a, b) -> str:
    """a against b as a factor: a dash when either is missing or both are
    zero, ∞ when only b is."""
    if missing(a) or missing(b):
        return "–"
    if b == 0:
        return "–" if a == 0 else "∞"
    return f"{a / b:.2f}×"


def fmt_time(ms: float | None) -> str:
    """Seconds with three significant digits from 1 s up, else milliseconds."""
    if missing(ms):
        return "–"
    if ms >= 1000:
        s = ms / 1000.0
        return f"{s:.3g} s" if s < 100 else f"{s:.0f} s"
    return f"{ms:.0f} ms"
