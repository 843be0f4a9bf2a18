"""Orphaned reservations (a processor that died mid-stream), reconciled by a live peer.

Two ``RedisQuotaBackend`` instances are two processors (their ``owner_id``). A "crash" is a
processor whose tasks never run again: its heartbeat expires on Redis's clock (short TTLs
here), and a peer's sweep settles what it had registered with ``used`` = what it reserved.
Sweeps are called directly, so every test asserts counts, never timings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import socket
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from extproc.app.runtime import Runtime
from extproc.config import ConfigError, parse_config
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import SETTLED_TTL_S, AdmitRequest, Counter
from extproc.quota.liveness.orphans import (
    Liveness,
    LuaScript,
    Registrations,
    beat_interval,
    find_orphan_backend,
    settle_bound_s,
)
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.redis.resp import RespConnection
from loadlab.procs import free_port
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


async def test_admit_records_its_owner_in_the_tenants_open_set_in_one_round_trip(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    liveness(a, ttl_s=30)  # its registrations: the first admission in a tenant lists it
    warm = new_key()  # loads the scripts, opens a connection, lists acme's open set
    await a.admit(admission(warm, tokens=0))
    await a.settle(warm, (TPM,), used=0)
    await plain_redis.config_resetstat()
    key = new_key()
    verdict = await a.admit(admission(key))
    sent = command_calls(await plain_redis.info("commandstats"))
    assert await plain_redis.smembers(keys.open_set_key(key, "proc-a")) == {key}
    await plain_redis.config_resetstat()
    await a.settle(key, (TPM,), used=50)
    for command, calls in command_calls(await plain_redis.info("commandstats")).items():
        sent[command] = sent.get(command, 0) + calls
    assert not await plain_redis.exists(keys.open_set_key(key, "proc-a"))

    # admit + settle, nothing else: the open set is written by the scripts themselves
    # (commandstats also counts what scripts run; a beat would be one more EVALSHA and its
    # EXISTS and SET, which neither admit nor settle runs).
    assert sent["evalsha"] == 2
    assert not {"eval", "set", "exists", "multi", "exec"} & sent.keys()
    assert sent["sadd"] == 1 and sent["srem"] == 1
    assert verdict.admitted and await plain_redis.hget(key, "o") == "proc-a"
    refused = new_key()
    assert not (await a.admit(AdmitRequest(refused, (), (TPM,), 2_000_000))).admitted
    assert await plain_redis.hget(refused, "o") is None  # a refusal holds nothing
    assert not await plain_redis.exists(keys.open_set_key(refused, "proc-a"))


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


async def test_the_first_admission_in_a_tenant_lists_its_open_set_before_charging(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    me = liveness(a, ttl_s=30)  # never started: no beat but the ones admissions ask for
    index = keys.registries_key("proc-a")
    acme = keys.open_set_key(new_key(), "proc-a")
    await plain_redis.config_resetstat()
    await a.admit(admission(new_key()))
    # One beat before the charge: heartbeat, the processor's id, the index lists acme's set.
    assert await plain_redis.smembers(index) == {acme}
    assert await plain_redis.sismember(keys.processor_index_key(), "proc-a")
    assert 0 < await plain_redis.pttl(keys.heartbeat_key("proc-a")) <= 30_000
    assert command_calls(await plain_redis.info("commandstats"))["evalsha"] == 2
    for _ in range(3):
        await a.admit(admission(new_key()))
    assert command_calls(await plain_redis.info("commandstats"))["evalsha"] == 5  # no beat
    other = keys.reservation_key("beta", "r-1")
    await a.admit(AdmitRequest(other, (), (), 0))
    assert await plain_redis.smembers(index) == {acme, keys.open_set_key(other, "proc-a")}
    assert me.registrations.fresh(acme) and len(me.registrations.known) == 2


async def test_concurrent_first_admissions_of_a_tenant_share_one_beat(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, _ = processors
    liveness(a, ttl_s=30)
    await a.ping()
    await plain_redis.config_resetstat()
    await asyncio.gather(*(a.admit(admission(new_key())) for _ in range(20)))
    stats = command_calls(await plain_redis.info("commandstats"))
    assert stats["evalsha"] == 21 and stats["set"] == 1  # 20 admissions, one beat


async def test_a_failing_index_never_blocks_admissions_and_the_next_beat_lists_it(
    redis_server: RedisServer, plain_redis: aioredis.Redis
) -> None:
    # The {~p} slot unreachable (here: the client the beats use points at no server) while
    # the tenant's slot answers: the admission goes ahead, registered in its open set.
    broken = aioredis.Redis(port=free_port(), decode_responses=True, socket_connect_timeout=1)
    a = RedisQuotaBackend(broken, RespConnection.from_url(redis_server.url), owner_id="proc-a")
    working = aioredis.Redis(port=redis_server.port, decode_responses=True)
    try:
        me = liveness(a, ttl_s=30)
        beats: list[None] = []

        async def counted() -> None:
            beats.append(None)
            await me.beat()

        me.registrations.send = counted
        key = new_key()
        open_set = keys.open_set_key(key, "proc-a")
        assert (await a.admit(admission(key))).admitted
        assert await plain_redis.smembers(open_set) == {key}
        assert me.registrations.pending == {open_set} and len(beats) == 1
        assert (await a.admit(admission(new_key()))).admitted
        assert len(beats) == 1  # quiet for a beat interval: admissions don't wait on it
        # The index is reachable again: the next beat lists the open set.
        me._client = working
        me._beat = LuaScript(working, me._beat.script)
        await me.beat()
        assert await plain_redis.smembers(keys.registries_key("proc-a")) == {open_set}
        assert me.registrations.pending == set() and me.registrations.fresh(open_set)
    finally:
        await a.close()
        await working.aclose()


async def test_an_admission_waits_for_a_hanging_index_no_longer_than_for_its_own_call(
    redis_server: RedisServer, plain_redis: aioredis.Redis
) -> None:
    # The {~p} slot accepts connections and never answers (a master SIGSTOPped).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    hanging = aioredis.Redis(port=silent.getsockname()[1], decode_responses=True)
    scripts = RespConnection.from_url(redis_server.url)
    a = RedisQuotaBackend(hanging, scripts, command_timeout_s=0.5, owner_id="proc-a")
    try:
        me = Liveness(a, Metrics(), heartbeat_ttl_s=120, call_timeout_s=60)
        key = new_key()
        assert (await a.admit(admission(key))).admitted
        [beat] = me.registrations._inflight.values()
        assert not beat.done()  # still waiting on {~p}: the admission went ahead
        assert await plain_redis.smembers(keys.open_set_key(key, "proc-a")) == {key}
        beat.cancel()
    finally:
        await a.close()
        silent.close()


async def test_every_open_record_of_a_dead_processor_is_settled_by_a_peer(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    liveness(a, ttl_s=30)
    streaming, finished = new_key(), new_key()
    await a.admit(admission(streaming, tokens=132))
    await a.reserve(streaming, 1, (TPM,), 32)
    await a.admit(admission(finished))
    await a.settle(finished, (TPM,), used=60)
    # Admitted the instant before it died, in another tenant too: no beat ran after them.
    last = new_key()
    await a.admit(admission(last, tokens=7))
    elsewhere = keys.reservation_key("beta", "last")
    await a.admit(AdmitRequest(elsewhere, (), (), 0))
    assert await charged(plain_redis) == 164 + 60 + 7

    peer = await ready_sweeper(b)
    assert await peer.sweep() == 0  # its heartbeat is still there: alive
    assert await plain_redis.hget(streaming, "st") is None
    await die(plain_redis, "proc-a")
    assert await peer.sweep() == 3
    assert peer.metrics.orphan_settlements_total == 3

    assert await plain_redis.hget(streaming, "st") == "164,164"
    assert await plain_redis.hget(last, "st") == "7,7"
    assert await plain_redis.hget(elsewhere, "orphan") == "1"
    assert await charged(plain_redis) == 164 + 60 + 7  # orphans keep their whole reservation
    assert not await plain_redis.exists(keys.registries_key("proc-a"))
    assert not await plain_redis.exists(keys.open_set_key(last, "proc-a"))
    assert not await plain_redis.sismember(keys.processor_index_key(), "proc-a")
    assert await peer.sweep() == 0 and peer.metrics.orphan_settlements_total == 3
    reasons = [f["reason"] for _, f in await plain_redis.xrange(keys.usage_stream_key(last))]
    assert sorted(reasons) == ["completed", "orphaned", "orphaned"]


async def test_a_dead_processors_stream_that_outlived_its_record_lifetime_is_swept(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    liveness(a, ttl_s=30)
    key = new_key()
    await a.admit(dataclasses.replace(admission(key, tokens=100), record_ttl_s=30))
    # As if the stream had run 29.8 s: every key of its admission has 0.2 s left.
    listed = keys.open_set_key(key, "proc-a")
    for k in (key, listed, keys.open_count_key(key)):
        assert await plain_redis.pexpire(k, 200)
    await plain_redis.set("set-after-them", 1, px=200)  # gone only once they would be
    assert (await a.reserve(key, 1, (TPM,), 32)).granted == 32  # renews them all
    while await plain_redis.exists("set-after-them"):
        await asyncio.sleep(0.05)

    await die(plain_redis, "proc-a")
    peer = await ready_sweeper(b)
    assert await peer.sweep() == 1
    assert await plain_redis.hget(key, "st") == "132,132"
    assert not await plain_redis.exists(listed) and not await plain_redis.exists(
        keys.open_count_key(key)
    )
    assert await charged(plain_redis) == 132
    # The books balance: one ledger entry, orphaned, whose window nets are the counter's.
    [entry] = [f for _, f in await plain_redis.xrange(keys.usage_stream_key(key))]
    assert (entry["reason"], entry["used"]) == ("orphaned", "132")
    assert sum(int(w.rsplit(":", 1)[1]) for w in entry["windows"].split(";")) == 132


async def test_a_dead_processors_admission_blocks_are_swept_as_fully_used(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    """A block (base.py) is an open record of its owner like a request's: what a dead
    processor held is charged, never free, and the books still balance."""
    a, b = processors
    liveness(a, ttl_s=30)  # registrations: the block's open set is listed before its charge
    block = keys.block_key("acme", "proc-a", 1)
    taken = await a.take_block(AdmitRequest(block, (RPM,), (TPM,), 500), 4)
    assert taken.verdict.admitted
    moved = new_key()  # admitted locally against the block, recorded off the request path
    assert (await a.admit_from_block(block, admission(moved, tokens=120))).from_block
    returned = keys.block_key("acme", "proc-a", 2)  # given back before the crash
    await a.take_block(AdmitRequest(returned, (RPM,), (TPM,), 300), 2)
    await a.return_block(returned, (RPM,), (TPM,))
    elsewhere = keys.block_key("beta", "proc-a", 3)  # another tenant's block
    await a.take_block(AdmitRequest(elsewhere, (), (), 0), 1)
    assert await charged(plain_redis) == 500

    peer = await ready_sweeper(b)
    await die(plain_redis, "proc-a")
    assert await peer.sweep() == 3  # the block, the request moved out of it, beta's block
    assert await plain_redis.hget(block, "st") == "380,380"  # what it still held
    assert await plain_redis.hget(moved, "st") == "120,120"
    assert await charged(plain_redis) == 500
    rpm_keys = await plain_redis.keys(RPM.key + ":*")
    assert sum([int(await plain_redis.get(k) or 0) for k in rpm_keys]) == 4  # slots kept
    entries = [f for _, f in await plain_redis.xrange(keys.usage_stream_key(block))]
    assert sorted(f["reason"] for f in entries) == ["orphaned", "orphaned", "returned"]
    kept = sum(int(f["windows"].rpartition(":")[2]) for f in entries if f["windows"])
    assert kept == 500
    assert not await plain_redis.exists(keys.open_set_key(block, "proc-a"))
    # The peer cannot take from the dead processor's block: it admits directly.
    late = await b.admit_from_block(block, admission(new_key(), tokens=10))
    assert late.admitted and not late.from_block
    assert await charged(plain_redis) == 510


async def test_a_sweep_racing_the_owners_own_settlements_settles_each_record_once(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    # The owner was only slow (its heartbeat lapsed): it settles while a peer sweeps it.
    a, b = processors
    liveness(a, ttl_s=30)
    opened = [new_key() for _ in range(60)]
    for key in opened:
        await a.admit(admission(key, tokens=100))
    peer = await ready_sweeper(b)
    await die(plain_redis, "proc-a")
    swept, *settlements = await asyncio.gather(
        peer.sweep(), *(a.settle(key, (TPM,), used=40) for key in opened)
    )
    by_owner = [s for s in settlements if not s.already_settled]
    assert swept + len(by_owner) == len(opened)
    entries = await plain_redis.xrange(keys.usage_stream_key(opened[0]))
    assert len(entries) == len({f["request_id"] for _, f in entries}) == len(opened)
    reasons = [f["reason"] for _, f in entries]
    assert reasons.count("orphaned") == swept and reasons.count("completed") == len(by_owner)
    kept = sum(int(f["windows"].rpartition(":")[2]) for _, f in entries)
    assert await charged(plain_redis) == kept == swept * 100 + len(by_owner) * 40


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


async def test_a_lapsed_processor_is_counted_and_lists_its_open_sets_again(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    clock = FakeClock(5000.0)
    me = liveness(a, ttl_s=30, clock=clock)
    key = new_key()
    await a.admit(admission(key))
    await me.beat()
    assert me.metrics.heartbeat_lapses_total == 0
    # Taken for dead (it stalled a TTL): a peer settles its record and drops its index.
    await die(plain_redis, "proc-a")
    peer = await ready_sweeper(b)
    assert await peer.sweep() == 1
    assert not await plain_redis.exists(keys.registries_key("proc-a"))
    clock.now += 31
    # Back: its next admission lists its open set again before charging (its heartbeat may
    # have lapsed, so what it knew may be gone), and that beat counts the lapse.
    again = new_key()
    assert not me.registrations.fresh(keys.open_set_key(again, "proc-a"))
    await a.admit(admission(again))
    assert me.metrics.heartbeat_lapses_total == 1
    assert await plain_redis.smembers(keys.registries_key("proc-a")) == {
        keys.open_set_key(again, "proc-a")
    }
    assert (await a.settle(key, (TPM,), used=10)).already_settled  # the peer's stands


async def test_a_sweeper_never_drops_the_index_of_a_processor_whose_heartbeat_is_back(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    a, b = processors
    me = liveness(a, ttl_s=30)
    key = new_key()
    await a.admit(admission(key))
    await a.settle(key, (TPM,), used=1)  # its open set is empty now
    peer = await ready_sweeper(b)
    index = keys.registries_key("proc-a")
    forget = [keys.heartbeat_key("proc-a"), keys.processor_index_key(), index]
    empty = keys.open_set_key(key, "proc-a")
    assert await peer._forget(keys=forget, args=["proc-a", empty]) == -1
    assert await plain_redis.scard(index) == 1  # alive: nothing dropped
    await die(plain_redis, "proc-a")
    assert await peer.sweep() == 0  # nothing open; its empty set and itself are dropped
    assert not await plain_redis.exists(index)
    assert not await plain_redis.sismember(keys.processor_index_key(), "proc-a")
    await me.beat()  # it was alive after all: it lists itself again
    assert await plain_redis.sismember(keys.processor_index_key(), "proc-a")


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
    elsewhere = keys.reservation_key("beta", "done")
    await a.admit(AdmitRequest(elsewhere, (), (), 0))
    await a.settle(elsewhere, (), used=0)
    await me.stop()  # a drain that timed out left one request open

    assert not await plain_redis.exists(keys.heartbeat_key("proc-a"))
    # The emptied set leaves the index; the one still open stays there for the peers.
    assert await plain_redis.smembers(keys.registries_key("proc-a")) == {
        keys.open_set_key(left_open, "proc-a")
    }
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
        assert not await plain_redis.exists(keys.registries_key(c.owner_id))
        assert not await plain_redis.sismember(keys.processor_index_key(), c.owner_id)
    finally:
        await c.close()


def test_registrations_are_fresh_only_while_the_heartbeat_that_listed_them_lives() -> None:
    clock = FakeClock(0.0)
    regs = Registrations(clock=clock)
    assert not regs.fresh("s1")
    regs.pending.add("s1")
    listed, full = regs.to_send(0.0, ttl_s=30, margin_s=2)
    assert listed == ["s1"] and full  # never beaten: everything
    regs.sent(listed, full, sent_at=0.0, ttl_s=30)
    assert regs.fresh("s1") and not regs.fresh("s2")
    regs.pending.add("s2")
    clock.now = 10
    assert regs.to_send(10.0, ttl_s=30, margin_s=2) == (["s2"], False)
    regs.sent(["s2"], False, sent_at=10.0, ttl_s=30)
    clock.now = 29
    assert regs.fresh("s1") and regs.to_send(29.0, ttl_s=30, margin_s=2) == ([], False)
    # Once per TTL everything again, even when healthy (a failover may have lost a write).
    assert regs.to_send(30.0, ttl_s=30, margin_s=2) == (["s1", "s2"], True)
    regs.sent(["s1", "s2"], True, sent_at=30.0, ttl_s=30)
    # A beat that may land after the heartbeat of the last one expired: everything again.
    assert regs.to_send(58.5, ttl_s=30, margin_s=2) == (["s1", "s2"], True)
    clock.now = 60.0
    assert not regs.fresh("s1")  # the heartbeat may have lapsed: ensure() lists it again


def test_processor_keys_share_one_hash_tag_no_tenant_can_have() -> None:
    def tag(key: str) -> str:
        found = re.search(r"\{([^}]+)\}", key)
        assert found is not None
        return found.group(1)

    processor_keys = [
        keys.processor_index_key(),
        keys.heartbeat_key("host-1-abc"),
        keys.registries_key("host:1 {x}"),
    ]
    assert {tag(k) for k in processor_keys} == {"~p"}
    assert tag(keys.reservation_key("~p", "r")) == "%7Ep"
    assert keys.registries_key("host:1 {x}").count("{") == 1
    # A tenant's open set is in the tenant's slot, whatever the processor id holds.
    record = keys.reservation_key("acme", "r-1")
    assert keys.open_set_key(record, "host:1 {x}") == "tq:{acme}:own:host%3A1%20%7Bx%7D"
    with pytest.raises(ValueError):
        keys.heartbeat_key("")
    assert beat_interval(30) == 2.0 and beat_interval(2) == 0.5
    assert settle_bound_s(30, 10) == 42.0


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


async def test_a_settlement_a_failover_lost_is_sent_again_by_its_owners_next_sweep(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis
) -> None:
    """A master acknowledged a settlement and died before its replica had it: the replica
    took over with none of its writes (the record open and in the owner's open set, the
    refund and the ledger entry missing). Simulated on one real Redis by putting back every
    key of the tenant as it was before the settlement. The owner's sweep finds its own
    settled record open again and settles it once more, as it was: the bill and the books
    are the settlement's."""
    a, _ = processors
    metrics = Metrics()
    live = Liveness(a, metrics, heartbeat_ttl_s=30, sweep_interval_s=60)
    tpm = Counter("tpm", keys.counter_key("lost", "tpm", "m", 3600), 1_000_000, 3600)
    key = keys.reservation_key("lost", f"req-{next(_ids)}")
    assert (await a.admit(AdmitRequest(key, (), (tpm,), 100))).admitted
    assert (await a.reserve(key, 1, (tpm,), 32)).granted == 32
    tenant_keys = await plain_redis.keys("tq:{lost}:*")
    before = {k: (await plain_redis.dump(k), await plain_redis.pttl(k)) for k in tenant_keys}
    settled = await a.settle(key, (tpm,), used=90, output_tokens=40)
    assert (settled.reserved, settled.used, settled.refunded) == (132, 90, 42)
    assert not await live.repair_own()  # nothing lost yet: nothing to send again

    for k in set(await plain_redis.keys("tq:{lost}:*")) - set(before):
        await plain_redis.delete(k)  # the ledger entry (a new stream), and the like
    for k, (dump, ttl) in before.items():
        await plain_redis.restore(k, max(ttl, 0), dump, replace=True)
    open_set = keys.open_set_key(key, a.owner_id)
    assert await plain_redis.sismember(open_set, key) and not await plain_redis.hget(key, "st")
    counter_keys = await plain_redis.keys(tpm.key + ":*")
    assert sum([int(await plain_redis.get(k) or 0) for k in counter_keys]) == 132

    await live.sweep()
    assert metrics.settlements_repaired_total == 1
    assert await plain_redis.hget(key, "st") is not None
    assert not await plain_redis.sismember(open_set, key)
    assert sum([int(await plain_redis.get(k) or 0) for k in counter_keys]) == 90
    entries = [f for _, f in await plain_redis.xrange(keys.usage_stream_key(key))]
    assert [(e["output_tokens"], e["reason"]) for e in entries] == [("40", "completed")]
    assert int(await plain_redis.get(keys.open_count_key(key)) or 0) == 0
    # Once: the next sweeps find nothing more of it.
    assert await live.repair_own() == 0 and metrics.settlements_repaired_total == 1


@pytest.mark.parametrize("kind", ["cancel", "return_block"])
async def test_a_cancel_or_block_return_a_failover_lost_is_sent_again_by_its_owners_next_sweep(
    processors: tuple[RedisQuotaBackend, RedisQuotaBackend], plain_redis: aioredis.Redis, kind: str
) -> None:
    """As for a settlement: the replica took over with the admission (or the block) open and
    charged, though its owner had given it back. The owner's sweep sends the cancel (or the
    return) again, so nothing stays charged for tokens nobody used."""
    a, _ = processors
    metrics = Metrics()
    live = Liveness(a, metrics, heartbeat_ttl_s=30, sweep_interval_s=60)
    tpm = Counter("tpm", keys.counter_key("lost", "tpm", "m", 3600), 1_000_000, 3600)
    rpm = Counter("rpm", keys.counter_key("lost", "rpm", "m", 3600), 1000, 3600)
    if kind == "cancel":
        key = keys.reservation_key("lost", f"req-{next(_ids)}")
        assert (await a.admit(AdmitRequest(key, (rpm,), (tpm,), 100))).admitted
    else:
        key = keys.block_key("lost", a.owner_id, next(_ids))
        assert (await a.take_block(AdmitRequest(key, (rpm,), (tpm,), 100), 4)).verdict.admitted
    tenant_keys = await plain_redis.keys("tq:{lost}:*")
    before = {k: (await plain_redis.dump(k), await plain_redis.pttl(k)) for k in tenant_keys}
    tpm_keys = await plain_redis.keys(tpm.key + ":*")
    rpm_keys = await plain_redis.keys(rpm.key + ":*")
    held = [sum([int(await plain_redis.get(k) or 0) for k in ks]) for ks in (tpm_keys, rpm_keys)]
    if kind == "cancel":
        await a.cancel(key, (tpm,))
    else:
        await a.return_block(key, (rpm,), (tpm,))
    gone = [sum([int(await plain_redis.get(k) or 0) for k in ks]) for ks in (tpm_keys, rpm_keys)]
    assert gone[0] == 0 and gone[1] == (held[1] if kind == "cancel" else 0)
    assert not await live.repair_own()  # nothing lost yet: nothing to send again

    for k in set(await plain_redis.keys("tq:{lost}:*")) - set(before):
        await plain_redis.delete(k)
    for k, (dump, ttl) in before.items():
        await plain_redis.restore(k, max(ttl, 0), dump, replace=True)
    open_set = keys.open_set_key(key, a.owner_id)
    assert await plain_redis.sismember(open_set, key) and not await plain_redis.hget(key, "st")
    assert [
        sum([int(await plain_redis.get(k) or 0) for k in ks]) for ks in (tpm_keys, rpm_keys)
    ] == held

    await live.sweep()
    assert metrics.settlements_repaired_total == 1
    assert await plain_redis.hget(key, "c") == "1" and not await plain_redis.sismember(
        open_set, key
    )
    assert [
        sum([int(await plain_redis.get(k) or 0) for k in ks]) for ks in (tpm_keys, rpm_keys)
    ] == gone
    assert int(await plain_redis.get(keys.open_count_key(key)) or 0) == 0
    assert await live.repair_own() == 0 and metrics.settlements_repaired_total == 1
