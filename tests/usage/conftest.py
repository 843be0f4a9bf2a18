"""A redis-server of the usage tests' own (they FLUSHALL), and a ledger filled by settling
real requests through the Redis backend."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator

import pytest
import redis

from extproc.quota.base import AdmitRequest, Counter, UsageTags
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer

TENANTS = ("acme", "beta corp", "gamma")
MODELS = ("gpt-4.1", "mini")
REASONS = ("completed", "cutoff", "disconnect", "upstream_error", "timeout", "shutdown")
_ids = itertools.count()


@pytest.fixture(scope="session")
def usage_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path_factory.mktemp("usage-redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def plain(usage_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=usage_redis.port, decode_responses=True)
    client.flushall()
    try:
        yield client
    finally:
        client.close()


async def _fill(url: str, count: int, seed: int) -> None:
    backend = RedisQuotaBackend.from_url(url)
    rng = random.Random(seed)
    try:

        async def one() -> None:
            tenant, model = rng.choice(TENANTS), rng.choice(MODELS)
            tpm = Counter("tpm", counter_key(tenant, "tpm", model, 60), 10**12, 60)
            key = reservation_key(tenant, f"req-{next(_ids)}")
            prompt = rng.randrange(1, 500)
            await backend.admit(
                AdmitRequest(
                    key, (), (tpm,), prompt + 32, usage=UsageTags("pro", model, "c", prompt)
                )
            )
            output = rng.randrange(0, 100)
            await backend.settle(
                key, (tpm,), prompt + output, reason=rng.choice(REASONS), output_tokens=output
            )

        for start in range(0, count, 100):
            await asyncio.gather(*(one() for _ in range(min(100, count - start))))
    finally:
        await backend.close()


def fill_ledger(server: RedisServer, count: int, seed: int = 1) -> None:
    """Settle ``count`` requests over the tenants and models: one ledger entry each."""
    asyncio.run(_fill(server.url, count, seed))


def all_entries(client: redis.Redis) -> dict[tuple[str, str], dict[str, str]]:
    found = {}
    for stream in client.scan_iter(match="tq:{*}:usage", _type="stream"):
        for entry_id, fields in client.xrange(stream):
            found[(stream, entry_id)] = fields
    return found
