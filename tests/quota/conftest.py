"""Fixtures: one harness per backend so the conformance suite runs unchanged on both.

A harness hides the only two things that differ between backends in a test: how to read
the stored counters (a plain Redis client vs the memory backend's own view) and how time
passes (real waiting on Redis ``TIME`` vs an injected clock).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from extproc.quota.base import Counter, QuotaBackend
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import TEST_CLOCK_ENV, RedisQuotaBackend
from loadlab.redis_server import RedisServer


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    name: str
    backend: QuotaBackend

    async def now(self) -> float:
        raise NotImplementedError

    async def windows(self, counter: Counter) -> dict[int, int]:
        """Stored windows of a counter: window start -> value."""
        raise NotImplementedError

    async def advance_to_next_window(self, window_s: int) -> int:
        """Let time pass into the next window of ``window_s``; returns its start."""
        raise NotImplementedError

    async def ledger(self, stream_key: str) -> list[tuple[str, dict[str, str]]]:
        """A tenant's usage ledger entries (``keys.usage_stream_key``), oldest first."""
        raise NotImplementedError

    async def open_set(self, key: str) -> set[str]:
        """Members of an owner's open set of a tenant (``keys.open_set_key``)."""
        raise NotImplementedError

    async def total(self, counter: Counter) -> int:
        return sum((await self.windows(counter)).values())

    async def ensure_room(self, window_s: int, need_s: float) -> None:
        """Make sure ``need_s`` seconds remain in the current window, so a test's calls
        cannot straddle a boundary by accident."""
        now = await self.now()
        if window_s - now % window_s < need_s:
            await self.advance_to_next_window(window_s)


class MemoryHarness(Harness):
    name = "memory"

    def __init__(self) -> None:
        # Not window-aligned on purpose: windows must come from arithmetic, not luck.
        self.clock = FakeClock(1_700_000_000.25)
        self.memory = MemoryQuotaBackend(clock=self.clock)
        self.backend = self.memory

    async def now(self) -> float:
        return self.clock.now

    async def windows(self, counter: Counter) -> dict[int, int]:
        head = counter.key + ":"
        return {
            int(k[len(head) :]): v
            for k, v in self.memory.counters().items()
            if k.startswith(head) and k[len(head) :].isdigit()
        }

    async def ledger(self, stream_key: str) -> list[tuple[str, dict[str, str]]]:
        return self.memory.ledger_entries(stream_key)

    async def open_set(self, key: str) -> set[str]:
        return self.memory.open_set(key)

    async def advance_to_next_window(self, window_s: int) -> int:
        start = (math.floor(self.clock.now) // window_s + 1) * window_s
        self.clock.now = start + 0.05
        return start


class RedisHarness(Harness):
    name = "redis"

    def __init__(self, server: RedisServer, plain: aioredis.Redis) -> None:
        self.server = server
        self.plain = plain  # reads what the scripts stored, bypassing the backend
        self.backend = RedisQuotaBackend.from_url(server.url, max_connections=64)

    async def now(self) -> float:
        seconds, micros = await self.plain.time()
        return seconds + micros / 1_000_000

    async def windows(self, counter: Counter) -> dict[int, int]:
        head = counter.key + ":"
        found: dict[int, int] = {}
        for key in await self.plain.keys("*"):
            if key.startswith(head) and key[len(head) :].isdigit():
                found[int(key[len(head) :])] = int(await self.plain.get(key) or 0)
        return found

    async def ledger(self, stream_key: str) -> list[tuple[str, dict[str, str]]]:
        return list(await self.plain.xrange(stream_key))

    async def open_set(self, key: str) -> set[str]:
        return set(await self.plain.smembers(key))

    async def advance_to_next_window(self, window_s: int) -> int:
        now = await self.now()
        start = (math.floor(now) // window_s + 1) * window_s
        while now < start + 0.02:
            await asyncio.sleep(start + 0.02 - now)
            now = await self.now()
        return start


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server of the quota suite's own: its tests FLUSHALL, which others must not see."""
    server = RedisServer.start(tmp_path_factory.mktemp("quota-redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def plain_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port, decode_responses=True)
    await client.flushall()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    plain: aioredis.Redis | None = None
    if request.param == "memory":
        h: Harness = MemoryHarness()
    else:
        # Only the Redis half of the suite starts (once) the session's redis-server.
        server: RedisServer = request.getfixturevalue("redis_server")
        plain = aioredis.Redis(port=server.port, decode_responses=True)
        await plain.flushall()
        h = RedisHarness(server, plain)
    try:
        yield h
    finally:
        await h.backend.close()
        if plain is not None:
            await plain.aclose()


CLOCK_KEY = "test:clock"


class Clocked:
    """A backend and a clock the test moves by whole seconds."""

    def __init__(self, name: str, backend: MemoryQuotaBackend | RedisQuotaBackend) -> None:
        self.name = name
        self.backend = backend
        self.plain: aioredis.Redis | None = None
        self.clock: FakeClock | None = None

    async def now(self) -> float:
        if self.clock is not None:
            return self.clock.now
        assert self.plain is not None
        seconds, micros = await self.plain.time()
        shift = int(await self.plain.get(CLOCK_KEY) or 0)
        return seconds + shift + micros / 1e6

    async def shift(self, seconds: int) -> None:
        if self.clock is not None:
            self.clock.now += seconds
        else:
            assert self.plain is not None
            await self.plain.incrby(CLOCK_KEY, seconds)

    async def travel_to(self, target: float) -> None:
        """Move the clock to ``target`` give or take the sub-second part (Redis keeps its
        real microseconds): to ``floor(target) + 0.x``."""
        now = await self.now()
        await self.shift(int(target) - int(now))

    async def room_in_second(self, need: float = 0.6) -> None:
        """Redis's own microseconds move on: keep a test's calls inside one second."""
        if self.clock is None and (await self.now()) % 1 > 1 - need:
            await self.shift(1)
            now = await self.now()
            while now % 1 > 1 - need:  # real time: wait out the rest of this second
                await asyncio.sleep(0.02)
                now = await self.now()


@pytest.fixture(params=["memory", "redis"])
async def clocked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Clocked]:
    if request.param == "memory":
        clock = FakeClock(1_700_000_000.25)
        c = Clocked("memory", MemoryQuotaBackend(clock=clock))
        c.clock = clock
        yield c
        await c.backend.close()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    plain = aioredis.Redis(port=server.port, decode_responses=True)
    await plain.flushall()
    await plain.set(CLOCK_KEY, 0)
    monkeypatch.setenv(TEST_CLOCK_ENV, CLOCK_KEY)
    c = Clocked("redis", RedisQuotaBackend.from_url(server.url))
    c.plain = plain
    try:
        yield c
    finally:
        await c.backend.close()
        await plain.aclose()
