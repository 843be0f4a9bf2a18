"""What a user reads: summary tables whole in a narrow terminal (dealt into tables that fit)
and in a pipe (one table, whatever COLUMNS says), parsed back to the figures of
summary.json; notes where a figure needs one; plot axes a reader can read."""

from __future__ import annotations

import fcntl
import itertools
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import matplotlib.pyplot as plt
import orjson
import pytest

from loadlab.plots import level_axis, log_value_axis
from loadlab.report import budget_notes, summary_notes
from tests.tools.conftest import ROOT
from tests.tools.openai_server import openai_server

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
FIGURES = {
    "ok/req": None, "TTFT p50": ("ttft_ms", "p50"), "TTFT p99": ("ttft_ms", "p99"),
    "ITL p50": ("itl_ms", "p50"), "ITL p99": ("itl_ms", "p99"), "TPOT p50": ("tpot_ms", "p50"),
    "E2EL p50": ("e2el_ms", "p50"), "E2EL p99": ("e2el_ms", "p99"),
    "out tok/s": ("output_throughput",), "req/s": ("request_throughput",),
}  # fmt: skip


def bench_argv(url: str, key: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "extproc", "bench", "--target", url, "--api-key", key,
        "--levels", "1,2", "--requests", "3", "--rounds", "1", "--output-tokens", "6",
        "--warmup-requests", "0", "--out", str(out), "--quiet",
    ]  # fmt: skip


def in_terminal(argv: list[str], columns: int) -> str:
    """``argv`` with its standard output on a terminal ``columns`` wide (a pty)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(120) == 0, proc.stderr.read() if proc.stderr else ""
    return ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every rich table in ``text``: (title, heads, rows of cells), as a reader sees them."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        title = lines[i - 1].strip() if i else ""
        heads = [c.strip() for c in lines[i + 1].strip("┃").split("┃")]
        rows = []
        for row in lines[i + 3 :]:
            if not row.startswith("│"):
                break
            rows.append([c.strip() for c in row.strip("│").split("│")])
        out.append((title, heads, rows))
    return out


def figures(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """The summary tables' cells by (route, level) and head, their parts put together."""
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for title, heads, rows in tables(text):
        if title.startswith("extproc bench: per route and level"):
            for row in rows:
                cells.setdefault((row[0], row[1]), {}).update(zip(heads, row, strict=True))
    return cells


def check_against_summary(cells: dict, out: Path) -> None:
    rows = orjson.loads((out / "summary.json").read_bytes())["results"]
    assert set(cells) == {(r["route"], f"{r['level']:g}") for r in rows}
    for r in rows:
        mine = cells[(r["route"], f"{r['level']:g}")]
        assert set(FIGURES) <= set(mine), sorted(mine)  # every column, none cut
        assert mine["ok/req"] == f"{r['completed']}/{r['requests']}"
        for head, path in FIGURES.items():
            if path is None:
                continue
            value = r
            for part in path:
                value = value[part]
            cell = mine[head].replace(",", "")
            digits = len(cell.split(".")[1]) if "." in cell else 0
            assert float(cell) == pytest.approx(value, abs=0.51 * 10**-digits), head


@pytest.mark.slow
def test_a_narrow_terminal_gets_tables_that_fit_and_every_figure(tmp_path: Path) -> None:
    with openai_server() as server:
        text = in_terminal(bench_argv(server.url, server.key, tmp_path / "r"), 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    parts = [t for t in tables(text) if t[0].startswith("extproc bench: per route")]
    assert len(parts) > 1 and all(h[:2] == ["route", "level"] for _, h, _ in parts)
    check_against_summary(figures(text), tmp_path / "r")


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["pipe", "file"])
def test_a_pipe_or_a_file_gets_one_whole_table_whatever_columns_says(
    sink: str, tmp_path: Path
) -> None:
    log = tmp_path / "out.txt"
    with openai_server() as server, open(log, "w") as f:
        done = subprocess.run(
            bench_argv(server.url, server.key, tmp_path / "r"), cwd=ROOT,
            stdout=subprocess.PIPE if sink == "pipe" else f, stderr=subprocess.PIPE,
            text=True, timeout=120, env={**os.environ, "COLUMNS": "40"},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = done.stdout if sink == "pipe" else log.read_text()
    parts = [t for t in tables(text) if t[0].startswith("extproc bench: per route")]
    assert len(parts) == 1 and "…" not in text
    check_against_summary(figures(text), tmp_path / "r")


def row(route: str, level: float, chunk: float | None, added: float | None) -> dict:
    return {
        "route": route, "level": level,
        "chunk_latency_ms": {"p50": chunk, "p99": chunk},
        "added_chunk_latency_ms": {"p50": added, "p99": added},
    }  # fmt: skip


def test_a_negative_added_latency_is_explained() -> None:
    notes = summary_notes([row("direct", 1, 0.2, 0.0), row("envoy", 1, 0.1, -0.1)])
    assert any("+chunk: the route's chunk-latency percentile minus" in n for n in notes)
    (why,) = [n for n in notes if "Below 0" in n]
    assert "envoy @ 1: p50 -0.100 ms" in why and "not a speed-up" in why
    quiet = summary_notes([row("direct", 1, 0.2, 0.0), row("envoy", 1, 0.3, 0.1)])
    assert not any("Below 0" in n for n in quiet)
    assert any("No chunk latency" in n for n in summary_notes([row("target", 1, None, None)]))


def test_max_use_next_to_a_busiest_interval_over_the_budget_is_explained() -> None:
    def budget(window: str, busiest: float) -> dict:
        return {"budget": {"window": window, "busiest_sliding_ratio": busiest}}

    notes = budget_notes([budget("fixed", 1.745)])
    (why,) = [n for n in notes if "A fixed window" in n]
    assert "up to 2× (here 1.745×)" in why and "max use ≤ 1.000" in why
    assert not any("A fixed window" in n for n in budget_notes([budget("sliding", 1.0)]))
    assert budget_notes([]) == []


def label_boxes(ax) -> list:
    ax.figure.canvas.draw()
    labels = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
    lo, hi = ax.get_xlim()
    inside = [t for t in labels if lo <= t.get_position()[0] <= hi]
    return [t.get_window_extent() for t in inside], [t.get_text() for t in inside]


def test_a_log_axis_of_levels_labels_every_level() -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([1, 10, 50, 200], [1, 2, 3, 4])
    level_axis(ax, [1, 10, 50, 200])
    _, texts = label_boxes(ax)
    assert texts == ["1", "10", "50", "200"]
    plt.close(fig)


@pytest.mark.parametrize(("low", "high"), [(3.2, 25.0), (0.04, 3.9), (0.05, 900.0), (6.0, 9.0)])
def test_log_value_ticks_never_overlap(low: float, high: float) -> None:
    fig, ax = plt.subplots(figsize=(4.4, 3.9))  # one CDF panel
    ax.plot([low, high], [0, 1])
    log_value_axis(ax, low, high)
    boxes, texts = label_boxes(ax)
    assert len(texts) >= 2, texts  # something to read the scale by
    for a, b in itertools.pairwise(boxes):
        assert a.x1 < b.x0, texts
    assert all(re.fullmatch(r"[0-9.]+", t) for t in texts), texts  # plain numbers
    plt.close(fig)
