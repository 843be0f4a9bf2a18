"""X-RateLimit-* and Retry-After headers, in the names and formats OpenAI uses."""

from __future__ import annotations

import math

from extproc.quota.base import CounterKind, CounterState, unit_of


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: ``850ms``, ``12s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s"


def ratelimit_headers(states: tuple[CounterState, ...]) -> list[tuple[str, str]]:
    """Headers for the tightest request counter and the tightest token counter (least
    remaining). Shadow counters are left out by the caller: they limit nothing."""
    headers: list[tuple[str, str]] = []
    requests = min(
        (s for s in states if unit_of(s.kind) == "requests"),
        key=lambda s: s.remaining,
        default=None,
    )
    tokens = min(
        (s for s in states if unit_of(s.kind) == "tokens"), key=lambda s: s.remaining, default=None
    )
    for suffix, state in (("requests", requests), ("tokens", tokens)):
        if state is None:
            continue
        headers.append((f"x-ratelimit-limit-{suffix}", str(state.limit)))
        headers.append((f"x-ratelimit-remaining-{suffix}", str(state.remaining)))
        headers.append((f"x-ratelimit-reset-{suffix}", format_reset(state.reset_s)))
    return headers


def retry_after(states: tuple[CounterState, ...], refused_by: CounterKind | None) -> str:
    """Whole seconds until the request would fit the counter that refused (its window's
    end; a sliding window's release of enough), at least 1."""
    state = next((s for s in states if s.kind == refused_by), None)
    if state is None:
        return "1"
    wait = state.reset_s if state.retry_s is None else state.retry_s
    return str(max(1, math.ceil(wait)))
