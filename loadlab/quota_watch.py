"""What the processor charged per window, read from Redis while a phase runs.

The processor's counters are epoch-aligned fixed windows (Redis ``TIME``) that expire two
seconds after their window ends, so they are read every ``interval_s`` during the phase —
the current window and the one before — and the last value read of each window is what was
charged in it (refunds only reach live windows). Same host: the client's clock and Redis's
agree on where a window starts. Fixed windows only: a sliding counter is one hash of
buckets with no per-window figure (``extproc bench`` starts no watch for one; its check is
the busiest interval of what clients received, ``loadlab.stats.busiest_interval``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis

from extproc.quota.keys import counter_key


class BudgetWatch:
    def __init__(
        self, redis_url: str, tenant: str, model: str, window_s: int, interval_s: float = 0.2
    ) -> None:
        self.redis_url = redis_url
        self.prefix = counter_key(tenant, "tpm", model, window_s)
        self.window_s = window_s
        self.interval_s = interval_s
        self.charged: dict[int, int] = {}  # window start (epoch s) → tokens charged
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _read(self, client: aioredis.Redis) -> None:
        now = int(time.time())
        current = now - now % self.window_s
        for start in (current - self.window_s, current):
            value = await client.get(f"{self.prefix}:{start}")
            if value is not None:
                self.charged[start] = int(value)

    async def _loop(self) -> None:
        client = aioredis.from_url(self.redis_url)
        try:
            while not self._stop.is_set():
                await self._read(client)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
            await self._read(client)  # settlements of the phase's last streams
        finally:
            await client.aclose()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[int, int]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return dict(sorted(self.charged.items()))
