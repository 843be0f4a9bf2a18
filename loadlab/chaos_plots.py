"""PNG plots of a chaos run, the fault timeline marked as spans (matplotlib, Agg)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadlab.integrity import EXCUSED, MALFORMED, WELL_FORMED

CLASSES = (*WELL_FORMED, *EXCUSED, MALFORMED)
COLOURS = {
    "complete": "tab:green",
    "cut_clean": "tab:olive",
    "error_status": "tab:orange",
    "client_disconnect": "tab:blue",
    "reset_by_fault": "tab:purple",
    "reset_by_upstream": "tab:gray",
    "malformed_upstream": "tab:brown",
    "malformed": "tab:red",
}


FAULT_COLOUR = "tab:red"


def _span(f: dict[str, Any]) -> tuple[float, float]:
    end = f["until_s"] if f["until_s"] is not None else f["at_s"]
    return f["at_s"], max(end, f["at_s"] + 0.2)  # an instant fault: a visible sliver


def _figure(faults: Sequence[dict[str, Any]], title: str) -> tuple[Any, Any]:
    """A figure whose top strip is the fault timeline (one labelled bar per fault) above
    the main axes, which share its time axis and mark each fault's span."""
    rows = max(1, len(faults))
    fig, (strip, ax) = plt.subplots(
        2,
        1,
        figsize=(9.0, 4.6 + 0.25 * rows),
        sharex=True,
        gridspec_kw={"height_ratios": [0.35 * rows + 0.4, 4.0], "hspace": 0.05},
    )
    for i, f in enumerate(faults):
        start, end = _span(f)
        strip.broken_barh([(start, end - start)], (i - 0.4, 0.8), color=FAULT_COLOUR, alpha=0.8)
        strip.text(end + 0.15, i, f["fault"], va="center", ha="left", fontsize=8)
        ax.axvspan(start, end, color=FAULT_COLOUR, alpha=0.12, zorder=0, linewidth=0)
        for x in (start, end):
            ax.axvline(x, color=FAULT_COLOUR, linestyle="--", linewidth=1.0, zorder=3)
    strip.set_ylim(rows - 0.5, -0.5)
    strip.set_yticks([])
    strip.set_ylabel("faults", fontsize=8, rotation=0, ha="right", va="center")
    if not faults:
        strip.text(0.5, 0.5, "no faults applied", ha="center", va="center",
                   transform=strip.transAxes, fontsize=8)  # fmt: skip
    strip.set_title(title, fontsize=11)
    return fig, ax


def outcomes_over_time(
    records: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]], path: Path
) -> Path:
    """Requests per second by outcome class, by the second they ended in."""
    fig, ax = _figure(faults, "Requests by outcome, per second, with the faults applied")
    last = int(max((r["end_s"] for r in records), default=0)) + 1
    xs = list(range(last + 1))
    bottom = [0] * len(xs)
    for cls in CLASSES:
        per = Counter(int(max(0.0, r["end_s"])) for r in records if r["outcome"] == cls)
        ys = [per.get(x, 0) for x in xs]
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, width=1.0, align="edge", label=cls, color=COLOURS[cls],
                   alpha=0.85, zorder=2)  # fmt: skip
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_xlabel("s since the load started (by when each request ended)")
    ax.set_ylabel("requests per second")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def charged_per_window(
    windows: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]], tpm: int, path: Path
) -> Path:
    """Per tenant, tokens charged in each window (Redis) against the budget."""
    fig, ax = _figure(faults, "Tokens charged per window and tenant (Redis), against the budget")
    for tenant in sorted({w["tenant"] for w in windows}):
        mine = sorted((w for w in windows if w["tenant"] == tenant), key=lambda w: w["start_s"])
        if not mine:
            continue
        width = mine[0]["window_s"]
        xs = [w["start_s"] for w in mine] + [mine[-1]["start_s"] + width]
        ys = [w["charged"] for w in mine]
        ax.step(xs, [*ys, ys[-1]], where="post", label=f"{tenant}: charged", zorder=2)
    ax.axhline(tpm, color="black", linestyle=":", label=f"budget per window ({tpm:,})")
    ax.set_xlabel("s since the load started")
    ax.set_ylabel("tokens charged in the window")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def write_chaos_plots(
    records: Sequence[dict[str, Any]],
    faults: Sequence[dict[str, Any]],
    windows: Sequence[dict[str, Any]],
    tpm: int,
    folder: Path,
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        outcomes_over_time(records, faults, folder / "outcomes_over_time.png"),
        charged_per_window(windows, faults, tpm, folder / "charged_per_window.png"),
    ]
