"""Figures per route and level, named as ``vllm bench serve`` and guidellm name them.

ttft_ms, itl_ms, tpot_ms, e2el_ms (p50/p90/p99/mean), output_throughput (tok/s),
request_throughput (req/s); chunk_latency_ms is the one-way latency of each token event
(client arrival − the simulator's ``ext_sent_ns``, one host clock) and
added_chunk_latency_ms its percentile minus the direct route's at the same level.
Percentiles are nearest-rank: every figure is a real sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from loadlab.engine import Phase, Record
from loadlab.figures import percentile
from loadlab.scenario import Scenario

QUANTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "chunk_latency_ms")


def distribution(samples: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        f"p{q}": _round(percentile(samples, q)) if samples else None for q in QUANTILES
    }
    out["mean"] = _round(sum(samples) / len(samples)) if samples else None
    out["count"] = len(samples)
    return out


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _pooled(records: Iterable[Record], attr: str, scale: float = 1.0) -> list[float]:
    return [v * scale for r in records for v in getattr(r, attr)]


def delivered_tokens(records: Iterable[Record]) -> list[tuple[float, int]]:
    """(wall-clock s, tokens) of everything that reached clients, in time order: a request's
    prompt when it was sent, each token event's share of the output when it arrived (the
    finest timing a record holds; whole tokens, so sums are exact: event k of n carries
    ``⌊(k+1)·out/n⌋ − ⌊k·out/n⌋``)."""
    points: list[tuple[float, int]] = []
    for r in records:
        if r.status != 200:
            continue
        start_s = r.start_ns / 1e9
        points.append((start_s, r.prompt_tokens))
        n = len(r.chunk_arrival_ms)
        for k, arrived_ms in enumerate(r.chunk_arrival_ms):
            share = (k + 1) * r.output_tokens // n - k * r.output_tokens // n
            points.append((start_s + arrived_ms / 1000, share))
    points.sort()
    return points


def busiest_interval(points: Sequence[tuple[float, int]], window_s: float) -> tuple[int, float]:
    """The most tokens any interval ``[t, t + window_s)`` holds, and its start. A busiest
    interval can always start at a point (move it right until one is at its left edge: it
    loses none), so two pointers over the sorted points find it in one pass."""
    best, best_start, held, right = 0, points[0][0] if points else 0.0, 0, 0
    for left, (start, _) in enumerate(points):
        while right < len(points) and points[right][0] < start + window_s:
            held += points[right][1]
            right += 1
        if held > best:
            best, best_start = held, start
        held -= points[left][1]
    return best, best_start


def trailing_sums(points: Sequence[tuple[float, int]], window_s: float) -> list[tuple[float, int]]:
    """The tokens in ``(t − window_s, t]`` as t runs: a (t, tokens) step at every delivery
    and at every delivery's leaving, ``window_s`` later (its maximum is
    ``busiest_interval``'s)."""
    steps = sorted([*points, *((at + window_s, -tokens) for at, tokens in points)])
    out: list[tuple[float, int]] = []
    held = 0
    for at, change in steps:
        held += change
        if out and out[-1][0] == at:
            out[-1] = (at, held)  # one step per instant: what holds once all of it applied
        else:
            out.append((at, held))
    return out


def budget_windows(points: Sequence[tuple[float, int]], window_s: int) -> list[dict[str, Any]]:
    """Tokens delivered per epoch-aligned window (the processor's fixed windows, Redis TIME
    on the same host)."""
    per: Counter[int] = Counter()
    for at, tokens in points:
        per[int(at // window_s)] += tokens
    return [{"window_start_s": w * window_s, "delivered_tokens": per[w]} for w in sorted(per)]


def budget_figures(phase: Phase, tpm: int, window_s: int, window: str = "fixed") -> dict[str, Any]:
    """Per fixed window: what the processor charged (Redis; None under a sliding budget,
    whose counter has no fixed windows) and what reached the client, against the budget;
    over the phase: the busiest ``window_s`` interval of delivered tokens, streams cut,
    429s, charged − delivered."""
    points = delivered_tokens(phase.records)
    delivered = {w["window_start_s"]: w["delivered_tokens"] for w in
                 budget_windows(points, window_s)}  # fmt: skip
    charged = phase.charged or {}
    windows = []
    for start in sorted(set(delivered) | set(charged)):
        used = charged.get(start) if phase.charged is not None else delivered.get(start, 0)
        windows.append(
            {
                "window_start_s": start,
                "charged_tokens": charged.get(start) if phase.charged is not None else None,
                "delivered_tokens": delivered.get(start, 0),
                "budget_tokens": tpm,
                "utilisation": round((used or 0) / tpm, 4),
            }
        )
    busiest, busiest_start = busiest_interval(points, window_s)
    outcomes = Counter(r.outcome for r in phase.records)
    delivered_total = sum(delivered.values())
    charged_total = sum(charged.values()) if phase.charged is not None else None
    basis = "charged" if phase.charged is not None else "delivered"
    return {
        "tpm": tpm,
        "window_s": window_s,
        "window": window,
        "utilisation_basis": basis,
        "windows": windows,
        "max_utilisation": max((w["utilisation"] for w in windows), default=None),
        "windows_over_budget": sum(1 for w in windows if w["utilisation"] > 1),
        "busiest_sliding_window_tokens": busiest,
        "busiest_sliding_window_start_s": round(busiest_start, 6) if points else None,
        "busiest_sliding_ratio": round(busiest / tpm, 4),
        "delivered_tokens": delivered_total,
        "charged_tokens": charged_total,
        "charged_minus_delivered": None
        if charged_total is None
        else charged_total - delivered_total,
        "streams_cut": outcomes.get("cut", 0),
        "refused_429": outcomes.get("refused", 0),
    }


def summarize_phase(phase: Phase, scenario: Scenario) -> dict[str, Any]:
    records = phase.records
    outcomes = Counter(r.outcome for r in records)
    served = [r for r in records if r.status == 200 and r.events]
    ok = [r for r in records if r.outcome == "ok"]
    tokens = sum(r.output_tokens for r in served)
    row: dict[str, Any] = {
        "route": phase.route,
        "level": phase.level,
        "mode": scenario.mode,
        "requests": len(records),
        "completed": len(ok),
        "outcomes": dict(sorted(outcomes.items())),
        "duration_s": round(phase.wall_s, 3),
        "total_output_tokens": tokens,
        "output_throughput": round(tokens / phase.wall_s, 2) if phase.wall_s > 0 else None,
        "request_throughput": round(len(ok) / phase.wall_s, 3) if phase.wall_s > 0 else None,
        "ttft_ms": distribution([r.ttft_ms for r in served if r.ttft_ms is not None]),
        "itl_ms": distribution(_pooled(served, "itl_ms")),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2el_ms": distribution([r.e2el_ms for r in ok if r.e2el_ms is not None]),
        "chunk_latency_ms": distribution(_pooled(served, "chunk_latency_us", 1e-3)),
        "added_chunk_latency_ms": {"p50": None, "p99": None},
        "cpu_share": {k: round(v, 3) for k, v in phase.cpu_share.items()},
    }
    variant = scenario.variant_of(phase.route)
    if scenario.budget is not None and variant is not None:
        b = scenario.budget
        row["budget"] = budget_figures(phase, b.tpm, b.window_s, variant.window)
    return row


def add_relative(rows: list[dict[str, Any]]) -> None:
    """``added_chunk_latency_ms``: each route's percentile − the direct route's, same level."""
    direct = {r["level"]: r for r in rows if r["route"] == "direct"}
    for row in rows:
        base = direct.get(row["level"])
        if base is None:
            continue
        for q in ("p50", "p99"):
            mine, theirs = row["chunk_latency_ms"][q], base["chunk_latency_ms"][q]
            if mine is not None and theirs is not None:
                row["added_chunk_latency_ms"][q] = round(mine - theirs, 4)


def summarize(phases: Sequence[Phase], scenario: Scenario) -> list[dict[str, Any]]:
    rows = [summarize_phase(p, scenario) for p in phases]
    add_relative(rows)
    return rows


CSV_COLUMNS = [
    "route", "level", "mode", "requests", "completed", "duration_s", "total_output_tokens",
    "output_throughput", "request_throughput",
    *(f"{m}_{q}" for m in LATENCIES for q in ("p50", "p90", "p99", "mean")),
    "added_chunk_latency_ms_p50", "added_chunk_latency_ms_p99",
    "failed", "streams_cut", "refused_429", "budget_max_utilisation",
    "budget_busiest_sliding_window_tokens", "budget_busiest_sliding_ratio",
    "cpu_client", "cpu_simulator", "cpu_envoy", "cpu_processor", "cpu_machine",
]  # fmt: skip


def csv_row(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: row.get(k) for k in CSV_COLUMNS if k in row}
    for m in LATENCIES:
        for q in ("p50", "p90", "p99", "mean"):
            out[f"{m}_{q}"] = row[m][q]
    for q in ("p50", "p99"):
        out[f"added_chunk_latency_ms_{q}"] = row["added_chunk_latency_ms"][q]
    out["failed"] = row["requests"] - row["completed"]
    out["streams_cut"] = row["outcomes"].get("cut", 0)
    out["refused_429"] = row["outcomes"].get("refused", 0)
    for name in ("max_utilisation", "busiest_sliding_window_tokens", "busiest_sliding_ratio"):
        out[f"budget_{name}"] = row.get("budget", {}).get(name)
    for role in ("client", "simulator", "envoy", "processor", "machine"):
        out[f"cpu_{role}"] = row["cpu_share"].get(role)
    return out
