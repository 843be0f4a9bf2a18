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


def _faults(ax: Any, faults: Sequence[dict[str, Any]]) -> None:
    for i, f in enumerate(faults):
        end = f["until_s"] if f["until_s"] is not None else f["at_s"]
        ax.axvspan(f["at_s"], max(end, f["at_s"] + 0.2), color=f"C{i % 10}", alpha=0.15)
        ax.text(
            f["at_s"],
            0.98,
            f["fault"],
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            transform=ax.get_xaxis_transform(),
        )


def outcomes_over_time(
    records: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]], path: Path
) -> Path:
    """Requests per second by outcome class, by the second they ended in."""
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    last = int(max((r["end_s"] for r in records), default=0)) + 1
    xs = list(range(last + 1))
    bottom = [0] * len(xs)
    for cls in CLASSES:
        per = Counter(int(max(0.0, r["end_s"])) for r in records if r["outcome"] == cls)
        ys = [per.get(x, 0) for x in xs]
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, width=1.0, align="edge", label=cls, color=COLOURS[cls])
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    _faults(ax, faults)
    ax.set_xlabel("s since the load started (by when each request ended)")
    ax.set_ylabel("requests per second")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def charged_per_window(
    windows: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]], tpm: int, path: Path
) -> Path:
    """Per tenant, tokens charged in each window (Redis) against the budget."""
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    for tenant in sorted({w["tenant"] for w in windows}):
        mine = sorted((w for w in windows if w["tenant"] == tenant), key=lambda w: w["start_s"])
        if not mine:
            continue
        width = mine[0]["window_s"]
        xs = [w["start_s"] for w in mine] + [mine[-1]["start_s"] + width]
        ys = [w["charged"] for w in mine]
        ax.step(xs, [*ys, ys[-1]], where="post", label=f"{tenant}: charged")
    ax.axhline(tpm, color="red", linestyle="--", label=f"budget per window ({tpm:,})")
    _faults(ax, faults)
    ax.set_xlabel("s since the load started")
    ax.set_ylabel("tokens charged in the window")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
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
