"""The resilient wrapper on a real redis-server: breaker, fail-open allowance, queue.

Each test has a server of its own (it is killed, paused or restarted). A paused server
(SIGSTOP) keeps its data and answers nothing; a killed one (SIGKILL) is restarted empty on
the same port. Every pause is undone by SIGCONT in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from extproc.admission.policy import PolicyBook
from extproc.config import parse_config
from extproc.metrics import Metrics
from extproc.quota.base import AdmitRequest, Counter, QuotaUnavailable, UsageTags
from extproc.quota.keys import block_key, counter_key, reservation_key, usage_stream_key
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.resilience.backend import CircuitOpen, ResilientQuotaBackend, absorb_key
from loadlab.redis_server import RedisServer

WINDOW_S = 3600
DEADLINE_S = 0.5  # short for paused servers, long enough for a loaded machine
# A closed plan's counters, and a fail-open plan's with a tenth of each limit as allowance.
RPM = Counter("rpm", counter_key("shut", "rpm", "m", WINDOW_S), 1000, WINDOW_S)
TPM = Counter("tpm", counter_key("shut", "tpm", "m", WINDOW_S), 1_000_000, WINDOW_S)
OPEN_RPM = Counter("rpm", counter_key("open", "rpm", "m", WINDOW_S), 100, WINDOW_S, 10)
OPEN_TPM = Counter("tpm", counter_key("open", "tpm", "m", WINDOW_S), 10_000, WINDOW_S, 1000)


def closed_request(request_id: str, tokens: int = 100) -> AdmitRequest:
    return AdmitRequest(reservation_key("shut", request_id), (RPM,), (TPM,), tokens)


def open_request(request_id: str, tokens: int = 100) -> AdmitRequest:
    return AdmitRequest(reservation_key("open", request_id), (OPEN_RPM,), (OPEN_TPM,), tokens)


class TcpProxy:
    """A loopback TCP proxy in front of Redis, in a thread of its own; ``accepted`` counts
    every connection made to it, i.e. every connection attempt that reached 'Redis'."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer.start(tmp_path / "redis")
    try:
        yield s
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.pid, signal.SIGCONT)
        s.stop()


@pytest.fixture
async def plain(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=server.port, decode_responses=True)
    yield client
    await client.aclose()


def wrapped(url: str, **options: object) -> ResilientQuotaBackend:
    metrics = Metrics()
    return ResilientQuotaBackend(
        RedisQuotaBackend.from_url(url, socket_timeout_s=None, command_timeout_s=DEADLINE_S),
        metrics=metrics,
        **options,  # type: ignore[arg-type]
    )


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def total(client: aioredis.Redis, counter: Counter) -> int:
    keys = [k async for k in client.scan_iter(match=counter.key + ":*")]
    return sum([int(await client.get(k) or 0) for k in keys])


def kill(server: RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    server.process.proc.wait(10)


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.mark.timeout(120)
async def test_an_open_breaker_lets_only_its_probes_reach_a_dead_redis(
    server: RedisServer, tmp_path: Path
) -> None:
    interval = 0.05
    with TcpProxy(server.port) as proxy:
        backend = wrapped(proxy.url, failures=3, probe_interval_s=interval)
        metrics = backend.metrics
        revived: RedisServer | None = None
        try:
            assert (await backend.admit(closed_request("warm"))).admitted
            kill(server)
            for i in range(3):  # three consecutive failures open it
                assert not backend.breaker_open
                with pytest.raises(QuotaUnavailable) as info:
                    await backend.admit(closed_request(f"fail-{i}"))
                assert not isinstance(info.value, CircuitOpen)
            assert backend.breaker_open and metrics.quota_breaker_opened_total == 1
            assert metrics.quota_breaker_open == 1

            attempts_before, probes_before = proxy.accepted, metrics.quota_breaker_probes_total
            started = time.monotonic()
            calls = local = 0
            while metrics.quota_breaker_probes_total < probes_before + 5:
                for i in range(20):
                    calls += 2
                    with pytest.raises(CircuitOpen):
                        await backend.admit(closed_request(f"open-{calls}"))
                    # Nothing reached Redis: the cancel a caller sends has nothing to undo.
                    await backend.cancel(reservation_key("shut", f"open-{calls}"), (TPM,))
                    with contextlib.suppress(QuotaUnavailable):  # local allowance: 10 RPM
                        verdict = await backend.admit(open_request(f"open-{calls}-{i}", 10))
                        local += verdict.local
                await asyncio.sleep(0.01)
            elapsed = time.monotonic() - started
            attempts = proxy.accepted - attempts_before
            probes = metrics.quota_breaker_probes_total - probes_before
            print(
                f"breaker open {elapsed:.2f}s: {calls} calls, {probes} probes, "
                f"{attempts} connection attempts reached Redis, {local} admitted locally"
            )
            # Each probe is one PING: a connection and its one retry at most. The probe in
            # flight when counting started or stopped may add its own.
            assert attempts <= 2 * (probes + 1)
            assert probes <= elapsed / interval + 2
            assert attempts < calls
            assert local == 10 and metrics.fail_open_admissions_total == 10
            assert metrics.quota_short_circuited_total >= calls
            assert backend.pending == 0  # no cancel was queued for a call never sent

            revived = RedisServer.start(tmp_path / "revived", port=server.port)
            assert await until(lambda: not backend.breaker_open)
            assert metrics.quota_breaker_open == 0
            verdict = await backend.admit(closed_request("after"))
            assert verdict.admitted and not verdict.local
        finally:
            await backend.close()
            if revived is not None:
                revived.stop()


@pytest.mark.timeout(120)
async def test_what_a_fail_open_plan_is_served_while_redis_is_down_is_absorbed_once(
    server: RedisServer, tmp_path: Path
) -> None:
    backend = wrapped(server.url, failures=3, probe_interval_s=0.05)
    metrics = backend.metrics
    revived: RedisServer | None = None
    try:
        assert (await backend.admit(closed_request("warm"))).admitted
        kill(server)
        admitted: list[str] = []
        for i in range(30):
            try:
                verdict = await backend.admit(open_request(f"r{i}", tokens=50))
            except QuotaUnavailable:  # the allowance (10 requests per window) is used up
                continue
            assert verdict.admitted and verdict.local and verdict.states == ()
            admitted.append(open_request(f"r{i}").reservation_key)
        assert len(admitted) == 10 and metrics.fail_open_refusals_total == 20
        # Admissions that reached Redis and failed (unknown outcome) queued a cancel each;
        # with the queue's own tries they opened the breaker after at most three.
        sent = metrics.quota_queued_total
        assert 1 <= sent <= 3 and backend.breaker_open

        used = {key: 30 + i for i, key in enumerate(admitted)}
        for key, n in used.items():
            settlement = await backend.settle(key, (OPEN_TPM,), n)
            assert settlement.queued and settlement.reserved == 50
        # The local allowance keeps only what was used.
        local_tpm = sum(v for k, v in backend.local.counters().items() if "tpm" in k)
        assert local_tpm == sum(used.values())
        assert backend.pending == 10 + sent  # one absorb each, one cancel per unknown outcome

        revived = RedisServer.start(tmp_path / "revived", port=server.port)
        plain = aioredis.Redis(port=revived.port, decode_responses=True)
        try:
            assert await until(lambda: backend.pending == 0)
            assert await total(plain, OPEN_TPM) == sum(used.values())
            # RPM is absorbed for admissions Redis never saw; the others were cancelled.
            assert await total(plain, OPEN_RPM) == 10 - sent
            assert metrics.reconciled_reservations_total == 10
            assert metrics.reconciled_tokens_total == sum(used.values())
            for key in admitted:
                assert await plain.hget(absorb_key(key), "st") is not None
            # Settled once: a second settlement finds nothing to charge.
            again = await backend.settle(admitted[0], (OPEN_TPM,), 999)
            assert again.reserved == 0 and not again.queued
            assert await total(plain, OPEN_TPM) == sum(used.values())
        finally:
            await plain.aclose()
    finally:
        await backend.close()
        if revived is not None:
            revived.stop()


@pytest.mark.timeout(60)
async def test_a_fail_open_admission_whose_reply_is_lost_is_cancelled_and_charged_once(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=100)  # the breaker stays closed
    key = open_request("lost").reservation_key
    try:
        assert (await backend.admit(open_request("warm", tokens=0))).admitted
        with paused(server):
            verdict = await backend.admit(open_request("lost", tokens=100))  # times out
            assert verdict.local
            grant = await backend.reserve(key, 1, (OPEN_TPM,), 32)
            assert grant.granted == 32 and grant.local
            await backend.settle(key, (OPEN_TPM,), 70)
            assert backend.pending == 2  # the cancel and the absorb
        # The admission queued in the paused server may run before or after the cancel:
        # either way only the absorb's 70 stay charged.
        assert await until(lambda: backend.pending == 0)
        assert await total(plain, OPEN_TPM) == 70
        # The warm-up's attempt, and the lost admission's if it ran before the cancel.
        assert await total(plain, OPEN_RPM) in (1, 2)
        assert await plain.hget(key, "c") == "1"
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_redis_admitted_stream_leases_locally_during_a_pause_and_settles_split(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=100)
    key = open_request("split").reservation_key
    try:
        assert (await backend.admit(open_request("split", tokens=100))).admitted
        first = await backend.reserve(key, 1, (OPEN_TPM,), 32)
        assert first.granted == 32 and not first.local
        with paused(server):
            # Both time out (and may still apply when the server resumes): both local.
            for seq in (2, 3):
                grant = await backend.reserve(key, seq, (OPEN_TPM,), 32)
                assert grant.granted == 32 and grant.local
        after = await backend.reserve(key, 4, (OPEN_TPM,), 32)
        assert after.granted == 32 and not after.local
        used = 100 + 32 + 32 + 32 + 10
        await backend.settle(key, (OPEN_TPM,), used)
        assert await until(lambda: backend.pending == 0)
        # Redis settles what it reserved (164; a late grant of seq 2 or 3 is refunded) and
        # the absorb charges the rest: the whole request is charged once.
        assert await total(plain, OPEN_TPM) == used
        assert backend.metrics.reconciled_tokens_total == used - (100 + 32 + 32)
        local_tpm = sum(v for k, v in backend.local.counters().items() if "tpm" in k)
        assert local_tpm == used - (100 + 32 + 32)
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_closed_plans_lease_fails_while_redis_is_down(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=1)
    key = closed_request("cut").reservation_key
    try:
        assert (await backend.admit(closed_request("cut"))).admitted
        with paused(server):
            with pytest.raises(QuotaUnavailable):
                await backend.reserve(key, 1, (TPM,), 32)
            with pytest.raises(CircuitOpen):
                await backend.reserve(key, 2, (TPM,), 32)
            assert (await backend.settle(key, (TPM,), 60)).queued
        assert await until(lambda: backend.pending == 0)
        assert await total(plain, TPM) == 60
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_settlements_during_an_outage_are_applied_once_when_redis_returns(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=3, probe_interval_s=0.05)
    metrics = backend.metrics
    keys = [closed_request(f"s{i}").reservation_key for i in range(6)]
    try:
        for i in range(6):
            assert (await backend.admit(closed_request(f"s{i}"))).admitted
        with paused(server):
            for key in keys:
                settlement = await backend.settle(key, (TPM,), 40)
                assert settlement.queued
            assert backend.breaker_open and metrics.quota_breaker_opened_total == 1
            assert not await backend.flush(0.3)  # nothing can be applied while paused
            assert backend.pending == 6
        assert await backend.flush(30)
        assert metrics.quota_queued_total == 6 and metrics.quota_queue_applied_total == 6
        for key in keys:
            assert await plain.hget(key, "st") == "100,40,60"
        assert await total(plain, TPM) == 6 * 40
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_full_queue_drops_and_counts_what_it_cannot_hold(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=1, queue_max=2)
    keys = [closed_request(f"q{i}").reservation_key for i in range(4)]
    try:
        for i in range(4):
            assert (await backend.admit(closed_request(f"q{i}"))).admitted
        with paused(server):
            for key in keys:
                await backend.settle(key, (TPM,), 10)
            assert backend.pending == 2 and backend.metrics.quota_queue_dropped_total == 2
        assert await until(lambda: backend.pending == 0)
        settled = [await plain.hget(key, "st") for key in keys]
        assert settled[:2] == ["100,10,90"] * 2 and settled[2:] == [None, None]
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_tokens_served_in_a_window_that_has_ended_go_to_the_current_window(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    # The local allowance's clock says two hours ago: its window is over by the time the
    # absorb runs in Redis, so the tokens are charged to the current window, not dropped.
    backend = wrapped(
        server.url, failures=1, probe_interval_s=0.05, clock=lambda: time.time() - 7200
    )
    key = open_request("late").reservation_key
    try:
        assert (await backend.admit(open_request("warm", tokens=0))).admitted
        with paused(server):
            assert (await backend.admit(open_request("late", tokens=100))).local
            await backend.settle(key, (OPEN_TPM,), 55)
        assert await until(lambda: backend.pending == 0)
        now_s = int((await plain.time())[0])
        current = now_s - now_s % WINDOW_S
        assert await total(plain, OPEN_TPM) == 55
        assert int(await plain.get(f"{OPEN_TPM.key}:{current}") or 0) == 55
        assert await plain.hget(absorb_key(key), "st") == "0,55"
    finally:
        await backend.close()


def test_a_fail_open_plan_puts_a_rounded_up_share_of_each_limit_on_its_counters() -> None:
    plan = {
        "limits": {"*": {"rpm": 30, "tpm": 1001}},
        "daily_tokens": 99,
        "on_backend_failure": "open",
    }
    tenants = {
        "tenth": {},
        "half": {"overrides": {"fail_open_fraction": 0.5}},
        "shut": {"overrides": {"on_backend_failure": "closed"}},
    }
    config = parse_config(
        {
            "models": {"m": {"tokenizer": "o200k_base"}},
            "plans": {"p": plan},
            "tenants": {
                name: {"plan": "p", "key_sha256": [f"{i:064x}"], **spec}
                for i, (name, spec) in enumerate(tenants.items())
            },
        }
    )
    book = PolicyBook("tq")

    def allowances(tenant: str) -> list[int | None]:
        policy = book.policy(config.tenants[tenant], "m")
        return [c.fail_open_limit for c in policy.request_counters + policy.token_counters]

    assert allowances("tenth") == [3, 101, 10]  # 10 % of 30 RPM, 1001 TPM, 99 a day
    assert allowances("half") == [15, 501, 50]
    assert allowances("shut") == [None, None, None]
    for tenant, fails_open in (("tenth", True), ("half", True), ("shut", False)):
        policy = book.policy(config.tenants[tenant], "m")
        assert policy.fail_open is fails_open
        request = AdmitRequest("k", policy.request_counters, policy.token_counters, 1)
        assert request.fail_open is fails_open
    normal = config.normalised["tenants"]["half"]["plan"]
    assert (normal["on_backend_failure"], normal["fail_open_fraction"]) == ("open", 0.5)


@pytest.mark.timeout(60)
async def test_what_is_served_locally_gets_its_ledger_entry_so_counters_equal_the_ledger(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=100)
    tags = UsageTags("open-plan", "m", "client-9", 100)
    split = replace(open_request("split", tokens=100), usage=tags)
    alone = replace(open_request("alone", tokens=60), usage=tags)
    try:
        assert (await backend.admit(split)).admitted
        assert not (await backend.reserve(split.reservation_key, 1, (OPEN_TPM,), 32)).local
        with paused(server):
            # A lease and a whole admission served from the allowance while Redis is away.
            grant = await backend.reserve(split.reservation_key, 2, (OPEN_TPM,), 32)
            assert grant.local
            assert (await backend.admit(alone)).local
        used, output = 100 + 32 + 32 + 5, 69
        await backend.settle(
            split.reservation_key, (OPEN_TPM,), used, reason="cutoff", output_tokens=output
        )
        await backend.settle(
            alone.reservation_key, (OPEN_TPM,), 75, reason="disconnect", output_tokens=15
        )
        assert await until(lambda: backend.pending == 0)

        stream = usage_stream_key(split.reservation_key)
        entries = [fields for _, fields in await plain.xrange(stream)]
        net: dict[str, int] = {}
        for fields in entries:
            for part in filter(None, fields["windows"].split(";")):
                kind, window_s, start, n = part.split(":")
                assert (kind, int(window_s)) == ("tpm", WINDOW_S)
                net[f"{OPEN_TPM.key}:{start}"] = net.get(f"{OPEN_TPM.key}:{start}", 0) + int(n)
        stored = {
            k: int(await plain.get(k) or 0) async for k in plain.scan_iter(OPEN_TPM.key + ":*")
        }
        assert {k: v for k, v in net.items() if v} == {k: v for k, v in stored.items() if v}
        assert sum(stored.values()) == used + 75

        by_request: dict[str, list[dict[str, str]]] = {}
        for fields in entries:
            by_request.setdefault(fields["request_id"], []).append(fields)
        # Redis's part and the absorbed part of the split stream; the prompt counted first.
        parts = by_request["split"]
        assert len(parts) == 2 and {p["reason"] for p in parts} == {"cutoff"}
        assert sum(int(p["used"]) for p in parts) == used
        assert sum(int(p["output_tokens"]) for p in parts) == output
        assert sum(int(p["prompt_tokens"]) for p in parts) == used - output
        # The local admission: its absorbed usage, and (if Redis ran the paused admission)
        # the cancel that gave back what Redis had charged for it.
        served = [p for p in by_request["alone"] if p["reason"] == "disconnect"]
        assert len(served) == 1 and (served[0]["used"], served[0]["output_tokens"]) == ("75", "15")
        assert {p["reason"] for p in by_request["alone"]} <= {"disconnect", "cancelled"}
        assert all(p["plan"] == "open-plan" and p["tenant"] == "open" for p in entries)
    finally:
        await backend.close()


@pytest.mark.timeout(120)
async def test_admission_blocks_pass_straight_through_and_fail_without_a_fallback(
    server: RedisServer, plain: aioredis.Redis
) -> None:
    backend = wrapped(server.url, failures=1)
    owner = backend.primary.owner_id
    # A fail-open plan's block still never comes from the local allowance.
    block = AdmitRequest(block_key("open", owner, 1), (OPEN_RPM,), (OPEN_TPM,), 500)
    try:
        taken = await backend.take_block(block, 3)
        assert taken.verdict.admitted and taken.amounts == (500,)
        moved = await backend.admit_from_block(block.reservation_key, open_request("b1", 100))
        assert moved.from_block
        with paused(server):
            with pytest.raises(QuotaUnavailable):
                await backend.take_block(
                    AdmitRequest(block_key("open", owner, 2), (OPEN_RPM,), (OPEN_TPM,), 500), 3
                )
            with pytest.raises(CircuitOpen):
                await backend.admit_from_block(block.reservation_key, open_request("b2"))
            with pytest.raises(CircuitOpen):
                await backend.return_block(block.reservation_key, (OPEN_RPM,), (OPEN_TPM,))
            assert backend.pending == 0 and not backend.allowance.tracked
        deadline = time.monotonic() + 20
        while True:  # the caller's retry: return_block is idempotent
            try:
                returned = await backend.return_block(
                    block.reservation_key, (OPEN_RPM,), (OPEN_TPM,)
                )
                break
            except CircuitOpen:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert returned.refunded == 400
        # The paused take_block ran once the server went on: return its key too (a no-op
        # or its refund, whichever happened).
        await backend.return_block(block_key("open", owner, 2), (OPEN_RPM,), (OPEN_TPM,))
        assert await total(plain, OPEN_TPM) == 100
        assert await total(plain, OPEN_RPM) == 1
    finally:
        await backend.close()
