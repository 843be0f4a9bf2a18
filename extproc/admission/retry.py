"""Calls that must reach the backend, retried until it answers.

A lost admission's cancel, a block's return and a request's record out of a block are each
idempotent, and leaving one undone loses a refund or a record: they are asked again with
backoff for about two minutes (an outage longer than that is logged and counted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

ATTEMPTS = 30
BACKOFF_MAX_S = 5.0


class NoAnswer(Exception):
    """The backend did not answer in ``ATTEMPTS`` tries."""


async def until_answered(
    call: Callable[[], Awaitable[T]], on_error: Callable[[int, Exception], None]
) -> T:
    """``call()``'s result, once it returns; ``on_error(attempt, exc)`` after each failure."""
    for attempt in range(ATTEMPTS):
        try:
            return await call()
        except Exception as exc:
            on_error(attempt, exc)
            await asyncio.sleep(min(0.1 * 2**attempt, BACKOFF_MAX_S))
    raise NoAnswer
