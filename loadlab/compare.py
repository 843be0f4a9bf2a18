"""Two runs side by side, as ratios B/A: two results folders (``extproc bench compare A B``),
or the routes of one run against its first (several ``--target``s, or ``compare A``).

Like is compared with like: a difference of scenario (other than names and target URLs)
or a level, route only one side has is said, never dropped silently."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape

METRICS = (
    "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p50", "itl_ms.p99", "tpot_ms.p50", "e2el_ms.p50",
    "e2el_ms.p99", "chunk_latency_ms.p50", "chunk_latency_ms.p99",
    "added_chunk_latency_ms.p50", "added_chunk_latency_ms.p99", "output_throughput",
    "request_throughput",
)  # fmt: skip
SHOWN = (
    "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p99", "tpot_ms.p50", "e2el_ms.p99",
    "chunk_latency_ms.p99", "output_throughput", "request_throughput",
)  # fmt: skip
HEADS = {
    "ttft_ms.p50": "TTFT p50", "ttft_ms.p99": "TTFT p99", "itl_ms.p99": "ITL p99",
    "tpot_ms.p50": "TPOT p50", "e2el_ms.p99": "E2EL p99", "chunk_latency_ms.p99": "chunk p99",
    "output_throughput": "out tok/s", "request_throughput": "req/s",
}  # fmt: skip
# What may differ between two runs of one comparison: what names them and where they went.
NOT_SCENARIO = {"name", "description", "targets", "target", "run"}


class CompareError(ValueError):
    pass


@dataclass
class Comparison:
    rows: list[dict[str, Any]]
    a: str  # what A is (a folder, a route)
    b: str
    warnings: list[str] = field(default_factory=list)


def load_results(folder: Path) -> dict[str, Any]:
    path = folder / "summary.json"
    try:
        doc = orjson.loads(path.read_bytes())
        if not isinstance(doc["results"], list):
            raise TypeError("results is not a list")
        return dict(doc)
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CompareError(f"{path}: not a results folder of extproc bench ({exc})") from exc


def _get(row: dict[str, Any], metric: str) -> float | None:
    value: Any = row
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def _flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out |= _flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def scenario_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``key: A's value vs B's`` for every scenario value that differs (names, target URLs
    and run details aside)."""
    fa = _flat({k: v for k, v in a.items() if k not in NOT_SCENARIO})
    fb = _flat({k: v for k, v in b.items() if k not in NOT_SCENARIO})
    return [
        f"{key}: {fa.get(key, '(unset)')} vs {fb.get(key, '(unset)')}"
        for key in sorted(set(fa) | set(fb))
        if fa.get(key) != fb.get(key)
    ]


def ratio_row(route: str, level: float, ra: dict[str, Any], rb: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"route": route, "level": level}
    row["completed.a"], row["completed.b"] = ra.get("completed"), rb.get("completed")
    for metric in METRICS:
        va, vb = _get(ra, metric), _get(rb, metric)
        row[f"{metric}.a"] = va
        row[f"{metric}.b"] = vb
        # Five significant figures, not four decimals: a ratio of 0.0258 keeps its precision.
        row[f"{metric}.ratio"] = (
            float(f"{vb / va:.5g}") if va is not None and vb is not None and va != 0 else None
        )
    return row


def _levels(levels: Sequence[float]) -> str:
    return ", ".join(f"{x:g}" for x in sorted(levels))


def compare_rows(
    rows_a: Sequence[dict[str, Any]], rows_b: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """A ratio row per (route, level) both have; when each side has one route, the two are
    paired whatever their names (two targets measured in two runs)."""
    warnings: list[str] = []
    routes_a = list(dict.fromkeys(r["route"] for r in rows_a))
    routes_b = list(dict.fromkeys(r["route"] for r in rows_b))
    pair_by_level = len(routes_a) == len(routes_b) == 1 and routes_a != routes_b

    def key(row: dict[str, Any]) -> tuple[str, float]:
        return ("*" if pair_by_level else row["route"], row["level"])

    by_a = {key(r): r for r in rows_a}
    by_b = {key(r): r for r in rows_b}
    if pair_by_level:
        warnings.append(f"comparing route {routes_a[0]} (A) with route {routes_b[0]} (B)")
    else:
        for side, mine, theirs in (("A", routes_a, routes_b), ("B", routes_b, routes_a)):
            only = [r for r in mine if r not in theirs]
            if only:
                warnings.append(f"routes only in {side}, not compared: {', '.join(only)}")
    for side, mine, theirs in (("A", by_a, by_b), ("B", by_b, by_a)):
        only = sorted({k[1] for k in mine if k not in theirs and any(t[0] == k[0] for t in theirs)})
        if only:
            warnings.append(f"levels only in {side}, not compared: {_levels(only)}")
    out = []
    for k in (k for k in by_a if k in by_b):
        route = routes_b[0] if pair_by_level else k[0]
        out.append(ratio_row(route, k[1], by_a[k], by_b[k]))
    return out, warnings


def compare(a: Path, b: Path) -> Comparison:
    """Two results folders: their common (route, level) rows as ratios B/A, and warnings."""
    doc_a, doc_b = load_results(a), load_results(b)
    rows, warnings = compare_rows(doc_a["results"], doc_b["results"])
    differences = scenario_differences(doc_a.get("scenario", {}), doc_b.get("scenario", {}))
    if differences:
        warnings.insert(0, "the two runs used different scenarios: " + "; ".join(differences))
    if not rows:

        def has(doc: dict[str, Any]) -> str:
            routes = ", ".join(dict.fromkeys(r["route"] for r in doc["results"])) or "none"
            return f"routes {routes} at levels {_levels({r['level'] for r in doc['results']})}"

        raise CompareError(
            f"{a} and {b} have no route and level in common (A: {has(doc_a)}; B: {has(doc_b)})"
        )
    return Comparison(rows, str(a), str(b), warnings)


def compare_routes(rows: Sequence[dict[str, Any]], baseline: str | None = None) -> Comparison:
    """One run's routes against its first (or ``baseline``), level by level: B/A with A the
    baseline, one ratio row per other route and level."""
    routes = list(dict.fromkeys(r["route"] for r in rows))
    if len(routes) < 2:
        raise CompareError(f"one route only ({', '.join(routes)}): nothing to compare it with")
    base = baseline or routes[0]
    if base not in routes:
        raise CompareError(f"no route {base!r} (routes: {', '.join(routes)})")
    by = {(r["route"], r["level"]): r for r in rows}
    out = []
    warnings = []
    for route in (r for r in routes if r != base):
        for row in (r for r in rows if r["route"] == route):
            theirs = by.get((base, row["level"]))
            if theirs is None:
                warnings.append(f"{route} @ {row['level']:g}: {base} has no such level")
                continue
            out.append(ratio_row(route, row["level"], theirs, row))
    return Comparison(out, base, ", ".join(r for r in routes if r != base), warnings)


def write_compare(rows: list[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "compare.json", out / "compare.csv"
    json_path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def compare_table(comparison: Comparison) -> tuple[str, list[str], list[list[str]]]:
    """Title, heads and cells of the ratio table (B/A: above 1 is B slower, or for the two
    throughputs B faster)."""
    shown = [m for m in SHOWN if any(r[f"{m}.ratio"] is not None for r in comparison.rows)]
    heads = ["route", "level", "ok A/B"] + [HEADS.get(m, m) for m in shown]
    cells = []
    for row in comparison.rows:
        line = [row["route"], f"{row['level']:g}", f"{row['completed.a']}/{row['completed.b']}"]
        for metric in shown:
            ratio = row[f"{metric}.ratio"]
            line.append("-" if ratio is None else f"{ratio:.2f}×")
        cells.append(line)
    title = f"B/A ratios — A: {comparison.a}  B: {comparison.b}"
    return title, heads, cells


def print_compare(comparison: Comparison, console: Console) -> None:
    from loadlab.tables import print_table

    for warning in comparison.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    title, heads, cells = compare_table(comparison)
    print_table(console, title, heads, cells)
    console.print(
        "B/A: latency above 1× is B slower, tok/s and req/s above 1× B faster; ok A/B: "
        "requests completed on each side; '-': a figure one side lacks."
    )
