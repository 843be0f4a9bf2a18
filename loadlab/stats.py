"""Figures per route and level, named as ``vllm bench serve`` and guidellm name them.

ttft_ms, itl_ms, tpot_ms, e2el_ms (p50/p90/p99/mean), output_throughput (tok/s),
request_throughput (req/s); chunk_latency_ms is the one-way latency of each token event
(client arrival − the simulator's ``ext_sent_ns``, one host clock) and
added_chunk_latency_ms its percentile minus the direct route's at the same level.
Percentiles are nearest-rank: every figure is a real sample.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from loadlab.engine import Phase, Record
from loadlab.scenario import Scenario

QUANTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "chunk_latency_ms")


def percentile(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def distribution(samples: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": _round(percentile(samples, q)) for q in QUANTILES}
    out["mean"] = _round(sum(samples) / len(samples)) if samples else None
    out["count"] = len(samples)
    return out


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _pooled(records: Iterable[Record], attr: str, scale: float = 1.0) -> list[float]:
    return [v * scale for r in records for v in getattr(r, attr)]


def budget_windows(records: Sequence[Record], window_s: int) -> list[dict[str, Any]]:
    """Tokens delivered per epoch-aligned window (the processor's windows, Redis TIME on the
    same host): a request's prompt in the window it was sent in, each token event's tokens in
    the window it arrived in."""
    per: Counter[int] = Counter()
    for r in records:
        if r.status != 200:
            continue
        start_s = r.start_ns / 1e9
        per[int(start_s // window_s)] += r.prompt_tokens
        if r.events:
            per_event = r.output_tokens / r.events
            for arrived_ms in r.chunk_arrival_ms:
                per[int((start_s + arrived_ms / 1000) // window_s)] += per_event
    return [
        {"window_start_s": w * window_s, "delivered_tokens": round(per[w])} for w in sorted(per)
    ]


def budget_figures(phase: Phase, tpm: int, window_s: int) -> dict[str, Any]:
    """Per window: what the processor charged (Redis) and what reached the client, against
    the budget; and over the phase: streams cut, 429s, charged − delivered."""
    delivered = {w["window_start_s"]: w["delivered_tokens"] for w in
                 budget_windows(phase.records, window_s)}  # fmt: skip
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
    outcomes = Counter(r.outcome for r in phase.records)
    delivered_total = sum(delivered.values())
    charged_total = sum(charged.values()) if phase.charged is not None else None
    basis = "charged" if phase.charged is not None else "delivered"
    return {
        "tpm": tpm,
        "window_s": window_s,
        "utilisation_basis": basis,
        "windows": windows,
        "max_utilisation": max((w["utilisation"] for w in windows), default=None),
        "windows_over_budget": sum(1 for w in windows if w["utilisation"] > 1),
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
    if scenario.budget is not None and phase.route.startswith("processor"):
        row["budget"] = budget_figures(phase, scenario.budget.tpm, scenario.budget.window_s)
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
    out["budget_max_utilisation"] = row.get("budget", {}).get("max_utilisation")
    for role in ("client", "simulator", "envoy", "processor", "machine"):
        out[f"cpu_{role}"] = row["cpu_share"].get(role)
    return out
