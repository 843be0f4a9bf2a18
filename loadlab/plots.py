"""PNG plots of a run (matplotlib, Agg backend: no display needed).

Every plot has a title; a log axis of levels has a tick label at each level; a plot with
nothing to draw (no direct route: no added latency; no stamps: no chunk latency; no
budget) is not written, and ``Plots.skipped`` says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

from loadlab.engine import Phase
from loadlab.stats import delivered_tokens, trailing_sums


@dataclass
class Plots:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # file name → why

    def line(self) -> str:
        out = f"{len(self.written)} written"
        if self.skipped:
            out += " (" + "; ".join(f"{n} skipped: {why}" for n, why in self.skipped.items()) + ")"
        return out


def _plain(value: float, _: object = None) -> str:
    return f"{value:g}"


def level_axis(ax: Any, levels: Sequence[float]) -> None:
    """A log axis of levels with a plain label at every level and no other tick."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(NullLocator())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(list(levels))
    ax.set_xticklabels([_plain(x) for x in levels])
    if len(levels) == 1:
        ax.set_xlim(levels[0] / 2, levels[0] * 2)


def log_value_axis(ax: Any, low: float, high: float) -> None:
    """A log axis of values: labels at 1-2-5 steps when the range is short, fewer as it
    grows, so no two overlap; plain numbers, no minor labels."""
    decades = math.log10(high / low) if low > 0 and high > low else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 1.3 else (1.0, 3.0) if decades <= 2.5 else (1.0,)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, samples: Sequence[float], label: str) -> None:
    if not samples:
        return
    ordered = sorted(samples)
    n = len(ordered)
    ax.plot(ordered, [(i + 1) / n for i in range(n)], label=label, linewidth=1.2)


def _legend(ax: Any, outside: bool = False) -> None:
    """A legend when something was drawn (``outside``: right of the axes, for plots whose
    lines fill them); a panel of a level without data says so."""
    if ax.get_legend_handles_labels()[0] and outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _samples(phase: Phase, metric: str) -> list[float]:
    if metric == "chunk":
        return [v / 1000 for r in phase.records for v in r.chunk_latency_us]
    return [r.ttft_ms for r in phase.records if r.ttft_ms is not None]


def _level_label(mode: str) -> str:
    return "concurrent streams" if mode == "closed" else "request rate (req/s)"


CDF_TITLES = {
    "chunk": "Chunk one-way latency: client arrival − llmsim's send stamp, per level",
    "ttft": "Time to first token, per level",
}


def latency_cdfs(phases: Sequence[Phase], path: Path, metric: str, mode: str = "closed") -> Path:
    """One panel per level, one CDF line per route: chunk one-way latency or TTFT."""
    levels = sorted({p.level for p in phases})
    fig, axes = plt.subplots(1, len(levels), figsize=(4.4 * len(levels), 3.9), squeeze=False)
    unit = "streams" if mode == "closed" else "req/s"
    for ax, level in zip(axes[0], levels, strict=True):
        drawn: list[float] = []
        for phase in (p for p in phases if p.level == level):
            samples = _samples(phase, metric)
            _cdf(ax, samples, phase.route)
            drawn += samples
        ax.set_title(f"{level:g} {unit if level != 1 else unit.rstrip('s')}", fontsize=10)
        positive = [v for v in drawn if v > 0]
        if positive:
            log_value_axis(ax, min(positive), max(positive))
        ax.set_xlabel("chunk one-way latency (ms)" if metric == "chunk" else "TTFT (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(True, alpha=0.3)
        _legend(ax)
    fig.suptitle(CDF_TITLES[metric], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _value(row: dict[str, Any], metric: str) -> Any:
    value: Any = row
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def has_values(rows: Sequence[dict[str, Any]], metric: str, skip: str = "") -> bool:
    return any(_value(r, metric) is not None for r in rows if r["route"] != skip)


def by_level(
    rows: Sequence[dict[str, Any]],
    path: Path,
    mode: str,
    metric: str,
    ylabel: str,
    title: str,
    skip: str = "",
) -> Path:
    """``metric`` (a dotted path into a summary row) against the level, one line per route
    (``skip``: a route left out, e.g. direct against itself)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for route in dict.fromkeys(r["route"] for r in rows if r["route"] != skip):
        points = []
        for row in (r for r in rows if r["route"] == route):
            value = _value(row, metric)
            if value is not None:
                points.append((row["level"], value))
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=route)
    if metric.startswith("added_"):
        ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel(_level_label(mode))
    ax.set_ylabel(ylabel)
    level_axis(ax, sorted({r["level"] for r in rows}))
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=11)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def budget_use(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per window of each processor phase: tokens charged (Redis) and delivered (client),
    against the budget; time runs on from phase to phase."""
    fig, ax = plt.subplots(figsize=(8.0, 4.4))
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
    ax.set_title("Tokens per fixed window: charged (Redis) and delivered (clients)", fontsize=11)
    ax.grid(True, alpha=0.3)
    _legend(ax, outside=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def sliding_use(phases: Sequence[Phase], rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per processor phase with a budget: tokens delivered in the trailing window at each
    delivery, against the budget (a fixed window's burst across its boundary rises above it;
    a sliding window's stays under)."""
    fig, ax = plt.subplots(figsize=(8.0, 4.4))
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
    ax.set_title("Tokens delivered in the trailing window, against the budget", fontsize=11)
    ax.grid(True, alpha=0.3)
    _legend(ax, outside=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


ADDED = "added chunk latency {q} vs direct (ms)"


def write_plots(
    phases: Sequence[Phase], rows: Sequence[dict[str, Any]], folder: Path, mode: str, budget: bool
) -> Plots:
    """The run's plots; one with nothing to show is skipped, with the reason."""
    folder.mkdir(parents=True, exist_ok=True)
    out = Plots()

    def plot(name: str, why_not: str | None, draw: Any) -> None:
        if why_not is not None:
            out.skipped[f"{name}.png"] = why_not
        else:
            out.written.append(draw(folder / f"{name}.png"))

    stamped = any(_samples(p, "chunk") for p in phases)
    no_stamps = "no token event carried a send stamp (llmsim --ext-stamp-events)"
    plot(
        "chunk_latency_cdf",
        None if stamped else no_stamps,
        lambda path: latency_cdfs(phases, path, "chunk", mode),
    )
    plot(
        "ttft_cdf",
        None if any(_samples(p, "ttft") for p in phases) else "no TTFT measured",
        lambda path: latency_cdfs(phases, path, "ttft", mode),
    )
    direct = any(r["route"] == "direct" for r in rows)
    for q, name in (("p50", "added_latency"), ("p99", "added_latency_p99")):
        metric = f"added_chunk_latency_ms.{q}"
        why = None
        if not direct:
            why = "no direct route to subtract"
        elif not has_values(rows, metric, skip="direct"):
            why = "no other route with chunk latency"
        plot(
            name,
            why,
            lambda path, m=metric, q=q: by_level(
                rows,
                path,
                mode,
                m,
                ADDED.format(q=q),
                f"Chunk latency each route adds to direct's ({q})",
                skip="direct",
            ),
        )
    plot(
        "output_throughput",
        None if has_values(rows, "output_throughput") else "no request measured",
        lambda path: by_level(
            rows,
            path,
            mode,
            "output_throughput",
            "output tokens/s",
            "Output throughput (tokens/s) by level",
        ),
    )
    if budget:
        plot(
            "budget_use",
            None
            if any(r.get("budget", {}).get("windows") for r in rows)
            else "no window with tokens",
            lambda path: budget_use(rows, path),
        )
        plot(
            "sliding_use",
            None if any(delivered_tokens(p.records) for p in phases) else "no tokens delivered",
            lambda path: sliding_use(phases, rows, path),
        )
    return out
