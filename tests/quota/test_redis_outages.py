"""The Redis backend when its server stalls or restarts: deadlines, reconnection, cancel.

A paused server (SIGSTOP) accepts connections and bytes into its socket buffers but answers
nothing, which is how a lost reply looks: the call runs into ``command_timeout_s`` while its
script may still run once the server resumes. Every test resumes the server in ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from extproc.quota.base import AdmitRequest, Counter, QuotaTimeout, QuotaUnavailable, Settlement
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer

DEADLINE_S = 0.2
RPM = Counter("rpm", counter_key("acme", "rpm", "m", 3600), 1000, 3600)
TPM = Counter("tpm", counter_key("acme", "tpm", "m", 3600), 1_000_000, 3600)


def admission(request_id: str, tokens: int = 100) -> AdmitRequest:
    return AdmitRequest(reservation_key("acme", request_id), (RPM,), (TPM,), tokens)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own: pausing the suite's shared one would stall the others."""
    with RedisServer.start(tmp_path / "redis") as s:
        yield s


@pytest.fixture
async def plain(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=server.port, decode_responses=True)
    yield client
    await client.aclose()


async def total(plain: aioredis.Redis, counter: Counter) -> int:
    keys = [k for k in await plain.keys("*") if k.startswith(counter.key + ":")]
    return sum([int(await plain.get(k) or 0) for k in keys])


async def warm_up(
    backend: RedisQuotaBackend, connections: int, plain: aioredis.Redis | None = None
) -> None:
    """Open ``connections`` pooled connections and load the scripts on the server: with
    ``plain`` beforehand, not by the calls' own NOSCRIPT and EVAL (eight first calls
    compiling admit.lua at once can take longer than DEADLINE_S on a busy machine)."""
    if plain is not None:
        for name in ("admit.lua", "reserve.lua", "settle.lua"):
            await plain.script_load(backend.script_source(name))
    verdicts = await asyncio.gather(
        *(backend.admit(admission(f"warm-{i}", tokens=0)) for i in range(connections))
    )
    assert all(v.admitted for v in verdicts)
    await backend.settle(reservation_key("acme", "warm-0"), (TPM,), used=0)
    await backend.reserve(reservation_key("acme", "warm-0"), 1, (TPM,), 1)


def paused_backend(server: RedisServer, connections: int) -> RedisQuotaBackend:
    # No socket timeout: only the per-call deadline can end a call to a paused server, so a
    # deadline that did not work would hang the test instead of passing it.
    return RedisQuotaBackend.from_url(
        server.url,
        max_connections=connections,
        socket_timeout_s=None,
        command_timeout_s=DEADLINE_S,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel_queued_first", [False, True])
async def test_admit_to_a_paused_server_times_out_and_cancel_reconciles_it(
    server: RedisServer, plain: aioredis.Redis, cancel_queued_first: bool
) -> None:
    """The admission is queued in the paused server, its call times out, the caller cancels
    until it gets an answer. Every call is written to one connection, in order: a cancel
    written after the admission runs after it (the admission is refunded; the cancels
    that follow find it settled), one written before it leaves a tombstone and the
    admission charges nothing. Whatever the order, no tokens stay charged."""
    backend = paused_backend(server, connections=8 if cancel_queued_first else 1)
    key = admission("lost-reply").reservation_key
    try:
        await warm_up(backend, 8 if cancel_queued_first else 1, plain)
        before_rpm = await total(plain, RPM)
        attempts: list[type[BaseException]] = []
        failed_while_paused = asyncio.Event()

        async def cancel_until_answered() -> Settlement:
            while True:  # what the processor does: cancel is idempotent, retry it
                try:
                    return await backend.cancel(key, (TPM,))
                except QuotaUnavailable as exc:
                    attempts.append(type(exc))
                    if len(attempts) >= 2:
                        failed_while_paused.set()

        os.kill(server.pid, signal.SIGSTOP)
        try:
            canceller: asyncio.Task[Settlement] | None = None
            if cancel_queued_first:
                canceller = asyncio.create_task(cancel_until_answered())
                await asyncio.sleep(0)  # its first EVALSHA is written, then it waits
            started = time.monotonic()
            with pytest.raises(QuotaTimeout):
                await backend.admit(admission("lost-reply"))
            timed_out_after = time.monotonic() - started
            if canceller is None:
                canceller = asyncio.create_task(cancel_until_answered())
            await failed_while_paused.wait()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        settlement = await canceller
        print(f"admit -> QuotaTimeout after {timed_out_after:.3f}s (deadline {DEADLINE_S}s)")

        assert set(attempts) == {QuotaTimeout}
        replay = await backend.admit(admission("lost-reply"))
        admission_ran_first = replay.replayed
        print(f"admission ran before the cancel: {admission_ran_first}")
        assert replay.cancelled and not replay.admitted
        assert await total(plain, TPM) == 0  # nothing left charged for the request
        # The attempt counts only if the admission ran before the cancel (then refunded).
        assert await total(plain, RPM) - before_rpm == (1 if admission_ran_first else 0)
        assert settlement.reserved == (100 if admission_ran_first else 0)
        assert admission_ran_first != cancel_queued_first  # one connection: written order
        assert (await backend.reserve(key, 1, (TPM,), 10)).granted == 0
        assert (await backend.settle(key, (TPM,), used=10)).already_settled
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_call_cut_off_by_the_deadline_leaves_no_stale_reply_behind(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    """One pooled connection: if the cut-off admit's reply stayed unread on it, the next
    call would read that reply as its own."""
    backend = paused_backend(server, connections=1)
    try:
        await warm_up(backend, 1, plain)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(QuotaTimeout):
                await backend.admit(admission("cut-off", tokens=100))
        finally:
            os.kill(server.pid, signal.SIGCONT)

        # The cut-off admission ran once the server resumed; each reply below is its own.
        grant = await backend.reserve(reservation_key("acme", "cut-off"), 1, (TPM,), 10)
        assert (grant.granted, grant.replayed) == (10, False)
        after = await backend.admit(admission("next", tokens=7))
        assert after.admitted and not after.replayed
        assert after.states[1].remaining == TPM.limit - 117
        settled = await backend.settle(reservation_key("acme", "cut-off"), (TPM,), used=5)
        assert (settled.reserved, settled.used, settled.refunded) == (110, 5, 105)
        assert await backend.ping()
        assert await total(plain, TPM) == 12
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_every_call_kind_times_out_on_a_paused_server(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = paused_backend(server, connections=4)
    key = reservation_key("acme", "stalled")
    try:
        await warm_up(backend, 4, plain)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            calls = [
                backend.admit(admission("stalled")),
                backend.reserve(key, 1, (TPM,), 10),
                backend.settle(key, (TPM,), used=1),
                backend.cancel(key, (TPM,)),
            ]
            for call in calls:
                with pytest.raises(QuotaTimeout):
                    await call
            assert not await backend.ping()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await backend.ping()
    finally:
        await backend.close()


async def restarted(server: RedisServer, tmp_path: Path, name: str) -> RedisServer:
    """Stop the server and start a new, empty one on its port. Blocking on purpose: the
    event loop does not run in between, so the pool cannot notice the closed connections
    before they are used (as when a command races the server's FIN)."""
    port = server.port
    server.stop()
    return RedisServer.start(tmp_path / name, port=port)


async def test_pooled_connections_survive_a_server_restart(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "first")
    backend = RedisQuotaBackend.from_url(server.url, max_connections=8, command_timeout_s=5)
    try:
        await warm_up(backend, 8)
        server = await restarted(server, tmp_path, "second")

        # The first call, on a connection that sat through the restart, gets its answer.
        first = await backend.admit(admission("after-restart"))
        assert first.admitted and not first.replayed
        # So do calls on each of the other stale connections, and every kind of call.
        verdicts = await asyncio.gather(*(backend.admit(admission(f"after-{i}")) for i in range(8)))
        assert all(v.admitted and not v.replayed for v in verdicts)
        key = reservation_key("acme", "after-restart")
        assert (await backend.reserve(key, 1, (TPM,), 10)).granted == 10
        assert (await backend.settle(key, (TPM,), used=20)).refunded == 90
        assert (await backend.cancel(reservation_key("acme", "after-0"), (TPM,))).refunded == 100
    finally:
        await backend.close()
        server.stop()


async def test_without_the_retry_a_stale_connection_fails_once(tmp_path: Path) -> None:
    """Control for the test above: the restart really leaves failing connections behind."""
    server = RedisServer.start(tmp_path / "first")
    backend = RedisQuotaBackend.from_url(server.url, connection_retries=0)
    try:
        await warm_up(backend, 2)
        server = await restarted(server, tmp_path, "second")
        with pytest.raises(QuotaUnavailable) as failed:
            await backend.admit(admission("after-restart"))
        assert not isinstance(failed.value, QuotaTimeout)
        assert (await backend.admit(admission("after-restart"))).admitted
    finally:
        await backend.close()
        server.stop()


async def test_a_server_that_is_down_is_unavailable_not_an_unhandled_error(
    tmp_path: Path,
) -> None:
    server = RedisServer.start(tmp_path / "gone")
    backend = RedisQuotaBackend.from_url(server.url, command_timeout_s=5)
    try:
        await warm_up(backend, 1)
        server.stop()
        for call in (
            backend.admit(admission("down")),
            backend.cancel(reservation_key("acme", "down"), (TPM,)),
        ):
            with pytest.raises(QuotaUnavailable) as failed:
                await call
            assert not isinstance(failed.value, QuotaTimeout)
    finally:
        await backend.close()
        server.stop()
