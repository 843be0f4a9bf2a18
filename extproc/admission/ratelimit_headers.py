"""X-RateLimit-* and Retry-After headers, in the names and formats OpenAI uses."""

from __future__ import annotations

import math

from extproc.quota.base import TOKEN_KINDS, CounterKind, CounterState


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
    """Headers for the request counter and the tightest token counter (least remaining)."""
    headers: list[tuple[str, str]] = []
    requests = next((s for s in states if s.kind == "rpm"), None)
    tokens = min(
        (s for s in states if s.kind in TOKEN_KINDS), key=lambda s: s.remaining, default=None
    )
    for suffix, state in (("requests", requests), ("tokens", tokens)):
        if state is None:
            continue
        headers.append((f"x-ratelimit-limit-{suffix}", str(state.limit)))
        headers.append((f"x-ratelimit-remaining-{suffix}", str(state.remaining)))
        headers.append((f"x-ratelimit-reset-{suffix}", format_reset(state.reset_s)))
    return headers


def retry_after(states: tuple[CounterState, ...], refused_by: CounterKind | None) -> str:
    """Whole seconds until the window of the counter that refused ends (at least 1)."""
    state = next((s for s in states if s.kind == refused_by), None)
    return str(max(1, math.ceil(state.reset_s))) if state is not None else "1"
