"""Figures for any benchmark: the one percentile (nearest rank), ratios, numbers and the
plain-text tables the scripts in benchmarks/ print."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], p: float) -> float:
    """Nearest-rank percentile, ``p`` in 0..100 (no interpolation: every figure is a real
    sample); NaN of no sample, which ``fmt`` shows as n/a."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def fmt(value: float, digits: int = 2) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns (the first left-aligned), a rule under the header."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(w) for cell, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"
