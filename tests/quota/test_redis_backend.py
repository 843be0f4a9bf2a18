"""What only the Redis backend has: server time, key expiry, AUTH, TLS, db index, NOSCRIPT."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import AuthenticationError

from extproc.quota.base import AdmitRequest, Counter, QuotaTimeout, QuotaUnavailable
from extproc.quota.factory import backend_from_url
from extproc.quota.keys import counter_key, reservation_key, usage_stream_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.windows import EXPIRY_MARGIN_S
from loadlab.redis_server import RedisServer


def tpm(limit: int = 1000, window_s: int = 60, tenant: str = "acme") -> Counter:
    return Counter("tpm", counter_key(tenant, "tpm", "gpt-4.1", window_s), limit, window_s)


def request(request_id: str, tokens: int = 100, *counters: Counter) -> AdmitRequest:
    return AdmitRequest(
        reservation_key=reservation_key("acme", request_id),
        request_counters=(),
        token_counters=counters or (tpm(),),
        tokens=tokens,
    )


@pytest.fixture
async def plain(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port, decode_responses=True)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def backend(redis_server: RedisServer) -> AsyncIterator[RedisQuotaBackend]:
    b = RedisQuotaBackend.from_url(redis_server.url)
    yield b
    await b.close()


async def redis_now(client: aioredis.Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1_000_000


async def test_window_start_comes_from_redis_time_not_the_processor_clock(
    backend: RedisQuotaBackend, plain: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = tpm(window_s=60)
    before = int(await redis_now(plain))
    # A processor clock a day and a half behind: any window taken from it would show.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 129_600)
    await backend.admit(request("r1", 100, counter))
    monkeypatch.undo()
    after = int(await redis_now(plain))

    keys = [k for k in await plain.keys("*") if k.startswith(counter.key + ":")]
    assert len(keys) == 1
    suffix = int(keys[0].rsplit(":", 1)[1])
    assert suffix in {before - before % 60, after - after % 60}


async def test_counter_keys_expire_just_after_their_window_and_records_after_their_ttl(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    counter = tpm(window_s=60)
    admit = request("r1", 100, counter)
    await backend.admit(admit)
    now = await redis_now(plain)

    (key,) = [k for k in await plain.keys("*") if k.startswith(counter.key + ":")]
    window_end = int(key.rsplit(":", 1)[1]) + 60
    ttl_ms = await plain.pttl(key)
    assert 0 < ttl_ms <= (window_end + EXPIRY_MARGIN_S - now) * 1000 + 5
    assert ttl_ms >= (window_end + EXPIRY_MARGIN_S - now) * 1000 - 1000
    assert admit.record_ttl_s - 2 <= await plain.ttl(admit.reservation_key) <= admit.record_ttl_s


async def test_a_tombstone_lives_tombstone_ttl_s_and_a_cancel_keeps_a_record_ttl(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    await backend.cancel(reservation_key("acme", "never"), (tpm(),), tombstone_ttl_s=120)
    assert 118 <= await plain.ttl(reservation_key("acme", "never")) <= 120
    admitted = request("r1", 100)
    await backend.admit(admitted)
    await backend.cancel(admitted.reservation_key, (tpm(),), tombstone_ttl_s=5)
    ttl = await plain.ttl(admitted.reservation_key)
    assert admitted.record_ttl_s - 2 <= ttl <= admitted.record_ttl_s


async def test_all_keys_of_a_request_land_in_one_cluster_slot(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    tenant = "te:n{a}nt%"
    rpm = Counter("rpm", counter_key(tenant, "rpm", "m", 60), 10, 60)
    counters = (
        Counter("tpm", counter_key(tenant, "tpm", "m", 60), 1000, 60),
        Counter("tenant_tpm", counter_key(tenant, "tenant_tpm", None, 60), 5000, 60),
        Counter("daily", counter_key(tenant, "daily", None, 86400), 99999, 86400),
    )
    key = reservation_key(tenant, "req/1")
    await backend.admit(AdmitRequest(key, (rpm,), counters, 100))
    await backend.reserve(key, 1, counters, 32)
    await backend.settle(key, counters, used=10)

    keys = await plain.keys("*")
    assert len(keys) == 6  # 4 windows, the record, the usage ledger (no open request left)
    assert usage_stream_key(key) in keys
    assert len({key_slot(k.encode()) for k in keys}) == 1


async def test_scripts_are_reloaded_after_the_server_forgets_them(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    assert (await backend.admit(request("r1"))).admitted
    await plain.script_flush()
    assert (await backend.admit(request("r2"))).admitted
    assert (await backend.reserve(reservation_key("acme", "r2"), 1, (tpm(),), 10)).granted == 10
    assert (await backend.settle(reservation_key("acme", "r2"), (tpm(),), 5)).refunded == 105


async def test_database_index_in_the_url_selects_the_database(
    redis_server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = RedisQuotaBackend.from_url(f"redis://127.0.0.1:{redis_server.port}/3")
    try:
        await backend.admit(request("r1"))
    finally:
        await backend.close()
    db3 = aioredis.Redis(port=redis_server.port, db=3, decode_responses=True)
    try:
        # counter, record, the open count, the processor's open set of the tenant
        assert len(await db3.keys("*")) == 4
        assert await plain.keys("*") == []
    finally:
        await db3.flushdb()
        await db3.aclose()


async def test_auth_with_password_in_url_or_option(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path, password="s3cret") as server:
        in_url = RedisQuotaBackend.from_url(server.auth_url)
        as_option = RedisQuotaBackend.from_url(server.url, password="s3cret")
        without = RedisQuotaBackend.from_url(server.url)
        wrong = RedisQuotaBackend.from_url(server.url, password="nope")
        try:
            assert await in_url.ping()
            assert (await in_url.admit(request("r1"))).admitted
            assert await as_option.ping()
            assert (await as_option.admit(request("r1"))).replayed
            assert not await without.ping()
            assert not await wrong.ping()
            with pytest.raises(QuotaUnavailable) as refused:
                await wrong.admit(request("r2"))
            assert isinstance(refused.value.__cause__, AuthenticationError)
            assert not isinstance(refused.value, QuotaTimeout)
        finally:
            for b in (in_url, as_option, without, wrong):
                await b.close()


async def test_rediss_url_speaks_tls(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path, password="tls-pass", tls=True) as server:
        assert server.ca_path is not None
        backend = backend_from_url(server.auth_url, ssl_ca_certs=str(server.ca_path))
        plain_text = RedisQuotaBackend.from_url(
            f"redis://default:tls-pass@127.0.0.1:{server.port}/0",
            connect_timeout_s=1,
            socket_timeout_s=1,
        )
        try:
            assert isinstance(backend, RedisQuotaBackend)
            assert await backend.ping()
            assert (await backend.admit(request("r1"))).admitted
            assert not await plain_text.ping()  # the port really requires TLS
        finally:
            await backend.close()
            await plain_text.close()


async def test_ping_reports_a_dead_server_instead_of_raising(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path)
    backend = RedisQuotaBackend.from_url(server.url, connect_timeout_s=0.5)
    try:
        assert await backend.ping()
        server.stop()
        assert not await backend.ping()
    finally:
        server.stop()
        await backend.close()


async def test_factory_picks_the_backend_from_the_url_scheme(redis_server: RedisServer) -> None:
    memory = backend_from_url("memory://")
    redis_backend = backend_from_url(redis_server.url)
    try:
        assert isinstance(memory, MemoryQuotaBackend)
        assert isinstance(redis_backend, RedisQuotaBackend)
        assert await redis_backend.ping()
    finally:
        await memory.close()
        await redis_backend.close()
    with pytest.raises(ValueError, match="memory://"):
        backend_from_url("memory://somewhere")
    with pytest.raises(ValueError, match="not a Redis URL"):
        backend_from_url("http://127.0.0.1:6379")
