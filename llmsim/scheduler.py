"""Admission like an inference engine: ``max-num-seqs`` generate at once, the rest wait.

The waiting queue is FIFO and bounded by ``max-waiting-queue-length``; a request that finds
it full is refused with 429, as the real simulator does. A finishing request hands its slot
straight to the oldest waiter so nothing can overtake the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from llmsim.errors import ApiError


class Ticket:
    """A request's place: either running now or waiting for a slot."""

    __slots__ = ("_engine", "_future", "held")

    def __init__(self, engine: Engine, future: asyncio.Future[None] | None) -> None:
        self._engine = engine
        self._future = future
        self.held = future is None

    @property
    def waiting(self) -> bool:
        return not self.held

    async def wait(self) -> None:
        """Return once this request holds a slot; cancellation leaves the queue cleanly."""
        if self.held:
            return
        assert self._future is not None
        try:
            await self._future
        except asyncio.CancelledError:
            if self._future.done() and not self._future.cancelled():
                self._engine.release()  # the slot arrived together with the cancellation
            else:
                self._engine.forget(self._future)
            raise
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._engine.release()
        elif self._future is not None and not self._future.done():
            self._future.cancel()
            self._engine.forget(self._future)


class Engine:
    """Running and waiting counts of one simulated GPU."""

    def __init__(self, max_num_seqs: int, max_waiting: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def admit(self) -> Ticket:
        """A ticket now, or ApiError(429) when the waiting queue is full."""
        if self.running < self.max_num_seqs and not self._waiters:
            self.running += 1
            return Ticket(self, None)
        if len(self._waiters) >= self.max_waiting:
            raise ApiError(429, "Failed to enqueue request, waiting requests queue is full")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        return Ticket(self, future)

    def release(self) -> None:
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)  # the slot passes on; running stays the same
                return
        self.running -= 1

    def forget(self, future: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(future)
