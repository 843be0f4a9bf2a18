"""``extproc bench compare A B``: two result folders side by side, as ratios B/A."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table

METRICS = (
    "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p50", "itl_ms.p99", "tpot_ms.p50", "e2el_ms.p50",
    "e2el_ms.p99", "chunk_latency_ms.p50", "chunk_latency_ms.p99",
    "added_chunk_latency_ms.p50", "added_chunk_latency_ms.p99", "output_throughput",
    "request_throughput",
)  # fmt: skip


class CompareError(ValueError):
    pass


def _load(folder: Path) -> list[dict[str, Any]]:
    path = folder / "summary.json"
    try:
        doc = orjson.loads(path.read_bytes())
        return list(doc["results"])
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CompareError(f"{path}: not a results folder of extproc bench ({exc})") from exc


def _get(row: dict[str, Any], metric: str) -> float | None:
    value: Any = row
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def compare(a: Path, b: Path) -> list[dict[str, Any]]:
    """A row per (route, level) in both folders: each metric's A, B and B/A."""
    rows_a = {(r["route"], r["level"]): r for r in _load(a)}
    rows_b = {(r["route"], r["level"]): r for r in _load(b)}
    out = []
    for key in (k for k in rows_a if k in rows_b):
        row: dict[str, Any] = {"route": key[0], "level": key[1]}
        for metric in METRICS:
            va, vb = _get(rows_a[key], metric), _get(rows_b[key], metric)
            row[f"{metric}.a"] = va
            row[f"{metric}.b"] = vb
            row[f"{metric}.ratio"] = (
                round(vb / va, 4) if va is not None and vb is not None and va != 0 else None
            )
        out.append(row)
    if not out:
        raise CompareError(f"{a} and {b} have no route and level in common")
    return out


def write_compare(rows: list[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "compare.json", out / "compare.csv"
    json_path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def print_compare(rows: list[dict[str, Any]], console: Console, a: Path, b: Path) -> None:
    table = Table(title=escape(f"B/A ratios — A: {a}  B: {b}"))
    shown = (
        "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p99", "e2el_ms.p99", "chunk_latency_ms.p50",
        "chunk_latency_ms.p99", "output_throughput", "request_throughput",
    )  # fmt: skip
    table.add_column("route")
    table.add_column("level", justify="right")
    for metric in shown:
        table.add_column(metric.replace("_ms", "").replace("_latency", ""), justify="right")
    for row in rows:
        cells = [escape(row["route"]), f"{row['level']:g}"]
        for metric in shown:
            ratio = row[f"{metric}.ratio"]
            cells.append("-" if ratio is None else f"{ratio:.2f}×")
        table.add_row(*cells)
    console.print(table)
