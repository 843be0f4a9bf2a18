"""Orphaned reservations (a processor that died mid-stream), reconciled by a live peer.

Two ``RedisQuotaBackend`` instances are two processors (their ``owner_id``). A "crash" is a
processor whose tasks never run again: its heartbeat expires on Redis's clock (short TTLs
here), and a peer's sweep settles what it had registered with ``used`` = what it reserved.
Sweeps are called directly, so every test asserts counts, never timings.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from extproc.config import ConfigError, parse_config
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import SETTLED_TTL_S, AdmitRequest, Counter
from extproc.quota.orphans import (
    Liveness,
    OpenReservations,
    find_orphan_backend,
    register_interval,
)
from extproc.quota.redis_backend import RedisQuotaBackend
from extproc.runtime import Runtime
from loadlab.redis_server import RedisServer
from tests.quota.conftest import FakeClock

TPM = Counter("tpm", keys.counter_key("acme", "tpm", "m", 3600), 1_000_000, 3600)
RPM = Counter("rpm", keys.counter_key("acme", "rpm", "m", 3600), 1000, 3600)
_ids = itertools.count()


def new_key() -> str:
    return keys.reservation_key("acme", f"req-{next(_ids)}")


def admission(key: str, tokens: int = 100) -> AdmitRequest:
    return AdmitRequest(key, (RPM,), (TPM,), tokens)


async def charged(plain: aioredis.Redis) -> int:
    found = [k for k in await plain.keys(TPM.key + ":*")]
    return sum([int(await plain.get(k) or 0) for k in found])


@pytest.fixture
async def processors(
    redis_server: RedisServer, plain_redis: aioredis.Redis
) -> AsyncIterator[tuple[RedisQuotaBackend, RedisQuotaBackend]]:
    a = RedisQuotaBackend.from_url(redis_server.url, owner_id="proc-a")
    b = RedisQuotaBackend.from_url(redis_server.url, owner_id="proc-b")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def liveness(backend: RedisQuotaBackend, ttl_s: float, clock: FakeClock | None = None) -> Liveness:
    return Liveness(
        backend,
        Metrics(),
        heartbeat_ttl_s=ttl_s,
        sweep_interval_s=60,
        **({"clock": clock} if clock is not None else {}),
    )


async def ready_sweeper(backend: RedisQuotaBackend) -> Liveness:
    """A peer whose own beats have gone through for a whole TTL (its clock says so)."""
    clock = FakeClock(1000.0)
    peer = liveness(backend, ttl_s=30, clock=clock)
    await peer.beat()
    clock.now += 30
    assert peer.may_sweep
    return peer


async def die(plain: aioredis.Redis, processor_id: str) -> None:
    """What a crash leaves once the heartbeat TTL has run out: everything but the heartbeat."""
    assert await plain.delete(keys.heartbeat_key(processor_id)) == 1


def command_calls(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """Calls per command since CONFIG RESETSTAT, without the test's own CONFIG/INFO/CLIENT."""
    out = {}
    for name, stat in stats.items():
        command = name.removeprefix("cmdstat_")
        if command.split("|")[0] not in ("config", "info", "client", "hello"):
            out[command] = stat["calls"]
    return out


async def test_admit_records_its_owner_and_stays_one_round_trip(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    a.track_open_reservations()
    warm = new_key()  # loads both scripts and opens a connection
    await a.admit(admission(warm, tokens=0))
    await a.settle(warm, (TPM,), used=0)
    await plain_redis.config_resetstat()
    key = new_key()
    verdict = await a.admit(admission(key))
    assert key in a.open_reservations  # type: ignore[operator]
    await a.settle(key, (TPM,), used=50)

    sent = command_calls(await plain_redis.info("commandstats"))
    # admit + settle: tracking adds no call (commandstats also counts what scripts run;
    # a call of the client's own would be a pipeline, a SADD or a SET, which no script runs)
    assert sent["evalsha"] == 2
    assert not {"eval", "sadd", "set", "exists", "multi", "exec"} & sent.keys()
    assert verdict.admitted and await plain_redis.hget(key, "o") == "proc-a"
    refused = new_key()
    assert not (await a.admit(AdmitRequest(refused, (), (TPM,), 2_000_000))).admitted
    assert await plain_redis.hget(refused, "o") is None  # a refusal holds nothing


async def test_a_peer_settles_an_orphan_at_what_it_reserved_never_less(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    key = new_key()
    await a.admit(admission(key, tokens=132))
    assert (await a.reserve(key, 1, (TPM,), 32)).granted == 32
    assert await charged(plain_redis) == 164

    status, settlement = await b.settle_orphan(key, "proc-a")
    assert status == "settled" and settlement is not None
    assert (settlement.reserved, settlement.used, settlement.refunded) == (164, 164, 0)
    assert await charged(plain_redis) == 164  # nothing refunded, nothing more charged
    assert await plain_redis.hget(key, "orphan") == "1"
    assert 0 < await plain_redis.ttl(key) <= SETTLED_TTL_S

    again, first = await b.settle_orphan(key, "proc-a")
    assert again == "already_settled" and first is not None and first.used == 164
    # Whatever the owner would still do with it changes nothing.
    assert (await a.reserve(key, 2, (TPM,), 32)).granted == 0
    late = await a.settle(key, (TPM,), used=10)
    assert late.already_settled and late.used == 164
    assert await charged(plain_redis) == 164


async def test_an_orphan_settlement_leaves_other_owners_settled_and_missing_records_alone(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    theirs, settled, missing = new_key(), new_key(), new_key()
    await a.admit(admission(theirs))
    await a.admit(admission(settled))
    await a.settle(settled, (TPM,), used=40)
    before = await plain_redis.hgetall(theirs)

    assert (await b.settle_orphan(theirs, "proc-x"))[0] == "not_owned"
    assert await plain_redis.hgetall(theirs) == before  # not finalised, TTL untouched
    assert await plain_redis.ttl(theirs) > SETTLED_TTL_S
    status, first = await b.settle_orphan(settled, "proc-a")
    assert status == "already_settled" and first is not None and first.used == 40
    assert (await b.settle_orphan(missing, "proc-a"))[0] == "no_record"
    assert not await plain_redis.exists(missing)  # no tombstone: its admission had run
    assert await charged(plain_redis) == 100 + 40


async def test_registration_sends_opened_keys_and_removes_settled_ones(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    me = liveness(a, ttl_s=30)
    owned = keys.owned_key("proc-a")
    k1, k2, brief = new_key(), new_key(), new_key()
    for key in (k1, k2, brief):
        await a.admit(admission(key))
    await a.settle(brief, (TPM,), used=10)  # admitted and settled between two beats
    rpm_only = new_key()
    await a.admit(AdmitRequest(rpm_only, (RPM,), (), 0))  # settled too: the ledger records it

    await plain_redis.config_resetstat()
    await me.beat()
    stats = await plain_redis.info("commandstats")
    # One pipeline: heartbeat (EXISTS + SET), index, owner set (SADD, EXPIRE).
    assert command_calls(stats) == {"exists": 1, "set": 1, "sadd": 2, "expire": 1}
    assert await plain_redis.smembers(owned) == {k1, k2, rpm_only}
    assert await plain_redis.sismember(keys.processor_index_key(), "proc-a")
    assert 0 < await plain_redis.pttl(keys.heartbeat_key("proc-a")) <= 30_000

    await a.settle(k1, (TPM,), used=10)
    await a.settle(rpm_only, (), used=3)
    await me.beat()
    assert await plain_redis.smembers(owned) == {k2}
    assert len(me.open) == 1 and k2 in me.open


async def test_a_dead_processors_registered_reservations_are_settled_by_a_peer(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    dead = liveness(a, ttl_s=30)
    streaming, finished = new_key(), new_key()
    await a.admit(admission(streaming, tokens=132))
    await a.reserve(streaming, 1, (TPM,), 32)
    await a.admit(admission(finished))
    await dead.beat()  # both registered
    await a.settle(finished, (TPM,), used=60)  # settled, but dies before the next beat
    assert await charged(plain_redis) == 164 + 60

    peer = await ready_sweeper(b)
    assert await peer.sweep() == 0  # its heartbeat is still there: alive
    assert await plain_redis.hget(streaming, "st") is None
    await die(plain_redis, "proc-a")
    assert await peer.sweep() == 1
    assert peer.metrics.orphan_settlements_total == 1

    assert await plain_redis.hget(streaming, "st") == "164,164"
    assert await charged(plain_redis) == 164 + 60  # the orphan keeps its whole reservation
    assert not await plain_redis.exists(keys.owned_key("proc-a"))
    assert not await plain_redis.sismember(keys.processor_index_key(), "proc-a")
    assert await peer.sweep() == 0 and peer.metrics.orphan_settlements_total == 1


async def test_no_sweep_before_the_sweepers_own_beats_have_run_for_a_ttl(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    dead = liveness(a, ttl_s=30)
    key = new_key()
    await a.admit(admission(key))
    await dead.beat()
    await die(plain_redis, "proc-a")

    clock = FakeClock(1000.0)
    peer = Liveness(b, Metrics(), heartbeat_ttl_s=30, call_timeout_s=0.2, clock=clock)
    assert await peer.sweep() == 0  # never beaten: Redis may just have come back
    await peer.beat()
    clock.now += 29
    assert await peer.sweep() == 0
    # A beat that gets no answer (writes paused) restarts the wait.
    await plain_redis.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    try:
        with pytest.raises(TimeoutError):
            await peer.beat()
    finally:
        await plain_redis.execute_command("CLIENT", "UNPAUSE")
    clock.now += 30
    assert not peer.may_sweep and await peer.sweep() == 0
    await peer.beat()
    clock.now += 30
    assert await peer.sweep() == 1


async def test_a_lapsed_heartbeat_is_counted(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    me = liveness(a, ttl_s=30)
    await me.beat()
    await me.beat()
    assert me.metrics.heartbeat_lapses_total == 0
    await plain_redis.delete(keys.heartbeat_key("proc-a"))  # as if it had expired
    await me.beat()
    assert me.metrics.heartbeat_lapses_total == 1


async def test_a_graceful_stop_hands_what_is_still_open_to_peers_at_once(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend],
    plain_redis: aioredis.Redis,
    redis_server: RedisServer,
) -> None:
    a, b = processors
    me = liveness(a, ttl_s=30)
    me.start()
    left_open, done = new_key(), new_key()
    await a.admit(admission(left_open))
    await a.admit(admission(done))
    await a.settle(done, (TPM,), used=5)
    await me.stop()  # a drain that timed out left one request open

    assert not await plain_redis.exists(keys.heartbeat_key("proc-a"))
    assert await plain_redis.smembers(keys.owned_key("proc-a")) == {left_open}
    peer = await ready_sweeper(b)
    assert await peer.sweep() == 1
    assert await plain_redis.hget(left_open, "st") == "100,100"

    c = RedisQuotaBackend.from_url(redis_server.url)
    try:
        clean = liveness(c, ttl_s=30)
        clean.start()
        key = new_key()
        await c.admit(admission(key))
        await c.settle(key, (TPM,), used=5)
        await clean.stop()  # nothing open: it leaves nothing behind
        assert not await plain_redis.exists(keys.heartbeat_key(c.owner_id))
        assert not await plain_redis.exists(keys.owned_key(c.owner_id))
        assert not await plain_redis.sismember(keys.processor_index_key(), c.owner_id)
    finally:
        await c.close()


def test_open_reservations_unregister_what_settles_while_its_registration_is_sent() -> None:
    clock = FakeClock(0.0)
    tracked = OpenReservations(clock=clock, max_age_s=100)
    tracked.opened("k1")
    tracked.opened("k2")
    adds, removes = tracked.changes()
    assert sorted(adds) == ["k1", "k2"] and removes == []
    tracked.closed("k1")  # settled while the pipeline was on the wire
    tracked.applied(adds, removes)
    assert tracked.changes() == ([], ["k1"])
    tracked.applied([], ["k1"])
    assert tracked.changes() == ([], [])

    tracked.opened("k3")
    adds, _ = tracked.changes()
    tracked.closed("k3")
    tracked.failed(adds)  # it may have been added: remove it to be sure
    assert tracked.changes() == ([], ["k3"])

    clock.now = 200  # k2 has been open longer than a record lives: its record is gone
    adds, removes = tracked.changes()
    assert adds == [] and sorted(removes) == ["k2", "k3"]
    assert len(tracked) == 0


def test_processor_keys_share_one_hash_tag_no_tenant_can_have() -> None:
    def tag(key: str) -> str:
        found = re.search(r"\{([^}]+)\}", key)
        assert found is not None
        return found.group(1)

    processor_keys = [
        keys.processor_index_key(),
        keys.heartbeat_key("host-1-abc"),
        keys.owned_key("host:1 {x}"),
    ]
    assert {tag(k) for k in processor_keys} == {"~p"}
    assert tag(keys.reservation_key("~p", "r")) == "%7Ep"
    assert keys.owned_key("host:1 {x}").count("{") == 1
    with pytest.raises(ValueError):
        keys.heartbeat_key("")
    assert register_interval(30) == 2.0 and register_interval(2) == 0.5


async def test_the_runtime_runs_liveness_for_redis_and_stops_it_on_close(
    redis_server: RedisServer, plain_redis: aioredis.Redis
) -> None:
    doc = {
        "redis_url": redis_server.url,
        "heartbeat_ttl_s": 5,
        "orphan_sweep_s": 1,
        "models": {"m": {"tokenizer": "estimator"}},
        "plans": {"p": {"limits": {"*": {"tpm": 1000}}}},
        "tenants": {"t": {"plan": "p", "key_sha256": ["0" * 64]}},
    }
    runtime = Runtime(parse_config(doc))
    try:
        assert runtime.liveness is not None
        target = find_orphan_backend(runtime.backend)
        assert target is not None and target is runtime.liveness.backend
        heartbeat = keys.heartbeat_key(target.owner_id)
        for _ in range(400):
            if await plain_redis.exists(heartbeat):
                break
            await asyncio.sleep(0.025)
        assert await plain_redis.sismember(keys.processor_index_key(), target.owner_id)
    finally:
        await runtime.close()
    assert not await plain_redis.exists(heartbeat)
    memory = Runtime(parse_config({**doc, "redis_url": "memory://"}))
    assert memory.liveness is None
    await memory.close()


def test_heartbeat_and_sweep_settings_are_validated_and_normalised() -> None:
    doc = {
        "models": {"m": {"tokenizer": "estimator"}},
        "plans": {"p": {"limits": {"*": {"tpm": 1000}}}},
        "tenants": {"t": {"plan": "p", "key_sha256": ["0" * 64]}},
    }
    default = parse_config(doc)
    assert (default.heartbeat_ttl_s, default.orphan_sweep_s) == (30.0, 10.0)
    assert default.normalised["heartbeat_ttl_s"] == 30.0
    assert default.normalised["orphan_sweep_s"] == 10.0
    short = parse_config({**doc, "heartbeat_ttl_s": 3, "orphan_sweep_s": 0.5})
    assert (short.heartbeat_ttl_s, short.orphan_sweep_s) == (3.0, 0.5)
    assert short.hash != default.hash
    for field, bad in (
        ("heartbeat_ttl_s", 0.5),
        ("heartbeat_ttl_s", 7200),
        ("heartbeat_ttl_s", True),
        ("orphan_sweep_s", 0),
        ("orphan_sweep_s", "10"),
    ):
        with pytest.raises(ConfigError, match=field):
            parse_config({**doc, field: bad})
