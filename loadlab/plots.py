"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadlab.engine import Phase
from loadlab.stats import delivered_tokens, trailing_sums


def _cdf(ax: Any, samples: Sequence[float], label: str) -> None:
    if not samples:
        return
    ordered = sorted(samples)
    n = len(ordered)
    ax.plot(ordered, [(i + 1) / n for i in range(n)], label=label, linewidth=1.2)


def _legend(ax: Any) -> None:
    """A legend when something was drawn; else say so (a route set without direct has no
    added latency, a run without stamps no chunk latency)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _level_label(mode: str) -> str:
    return "concurrent streams" if mode == "closed" else "request rate (req/s)"


def latency_cdfs(phases: Sequence[Phase], path: Path, metric: str) -> Path:
    """One panel per level, one CDF line per route: chunk one-way latency or TTFT."""
    levels = sorted({p.level for p in phases})
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.6), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=True):
        for phase in (p for p in phases if p.level == level):
            if metric == "chunk":
                samples = [v / 1000 for r in phase.records for v in r.chunk_latency_us]
            else:
                samples = [r.ttft_ms for r in phase.records if r.ttft_ms is not None]
            _cdf(ax, samples, phase.route)
        ax.set_title(f"level {level:g}")
        ax.set_xscale("log")
        ax.set_xlabel("chunk one-way latency (ms)" if metric == "chunk" else "TTFT (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(True, alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def by_level(
    rows: Sequence[dict[str, Any]], path: Path, mode: str, metric: str, ylabel: str
) -> Path:
    """``metric`` (a dotted path into a summary row) against the level, one line per route."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for route in dict.fromkeys(r["route"] for r in rows):
        points = []
        for row in (r for r in rows if r["route"] == route):
            value: Any = row
            for part in metric.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                points.append((row["level"], value))
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=route)
    ax.set_xlabel(_level_label(mode))
    ax.set_ylabel(ylabel)
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def budget_use(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per window of each processor phase: tokens charged (Redis) and delivered (client),
    against the budget; time runs on from phase to phase."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    budget_rows = [r for r in rows if r.get("budget", {}).get("windows")]
    origin = min((r["budget"]["windows"][0]["window_start_s"] for r in budget_rows), default=0)
    for row in budget_rows:
        windows = row["budget"]["windows"]
        width = row["budget"]["window_s"]
        # One more point at the last window's end, so every window is drawn its full width.
        xs = [w["window_start_s"] - origin for w in windows]
        xs.append(xs[-1] + width)
        label = f"{row['route']} @ {row['level']:g}"
        line = None
        if windows[0]["charged_tokens"] is not None:
            charged = [w["charged_tokens"] for w in windows]
            (line,) = ax.step(xs, [*charged, charged[-1]], where="post",
                              label=f"{label}: charged")  # fmt: skip
        delivered = [w["delivered_tokens"] for w in windows]
        ax.step(xs, [*delivered, delivered[-1]], where="post",
                linestyle=":", color=None if line is None else line.get_color(),
                label=f"{label}: delivered")  # fmt: skip
    if budget_rows:
        tpm = budget_rows[0]["budget"]["tpm"]
        ax.axhline(tpm, color="red", linestyle="--", label=f"budget per window ({tpm:,})")
    ax.set_xlabel("window start (s since the first window)")
    ax.set_ylabel("tokens in the window")
    ax.grid(True, alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sliding_use(phases: Sequence[Phase], rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per processor phase with a budget: tokens delivered in the trailing window at each
    delivery, against the budget (a fixed window's burst across its boundary rises above it;
    a sliding window's stays under)."""
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    budgets = {(r["route"], r["level"]): r["budget"] for r in rows if "budget" in r}
    for phase in phases:
        budget = budgets.get((phase.route, phase.level))
        points = delivered_tokens(phase.records)
        if budget is None or not points:
            continue
        steps = trailing_sums(points, budget["window_s"])
        ax.step([at - points[0][0] for at, _ in steps], [held for _, held in steps],
                where="post", linewidth=1.0,
                label=f"{phase.route} @ {phase.level:g} ({budget['window']} budget)")  # fmt: skip
    if budgets:
        budget = next(iter(budgets.values()))
        ax.axhline(budget["tpm"], color="red", linestyle="--", label=f"budget ({budget['tpm']:,})")
        ax.set_ylabel(f"tokens delivered in the last {budget['window_s']} s")
    ax.set_xlabel("s since the phase's first delivery")
    ax.grid(True, alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(
    phases: Sequence[Phase], rows: Sequence[dict[str, Any]], folder: Path, mode: str, budget: bool
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = [
        latency_cdfs(phases, folder / "chunk_latency_cdf.png", "chunk"),
        latency_cdfs(phases, folder / "ttft_cdf.png", "ttft"),
        by_level(rows, folder / "added_latency.png", mode, "added_chunk_latency_ms.p50",
                 "added chunk latency p50 vs direct (ms)"),
        by_level(rows, folder / "added_latency_p99.png", mode, "added_chunk_latency_ms.p99",
                 "added chunk latency p99 vs direct (ms)"),
        by_level(rows, folder / "output_throughput.png", mode, "output_throughput",
                 "output tokens/s"),
    ]  # fmt: skip
    if budget:
        out.append(budget_use(rows, folder / "budget_use.png"))
        out.append(sliding_use(phases, rows, folder / "sliding_use.png"))
    return out
