"""Every key a quota script touches is declared in KEYS; window keys passed by the caller
are checked against Redis TIME and retried on a miss; the ledger's retention bounds.

Redis itself does not enforce KEYS for keys of the script's own slot: even in cluster mode
it only refuses a key of another slot (``#!lua`` flags change nothing there). So the scripts
run here under a ``redis.call`` wrapper that fails the script on any key not in KEYS; the
wrapper's own test proves it fails.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from extproc.metrics import Metrics
from extproc.quota.base import Absorption, AdmitRequest, Counter, LedgerSettings, UsageTags
from extproc.quota.keys import (
    block_key,
    counter_key,
    heartbeat_key,
    reservation_key,
    usage_stream_key,
)
from extproc.quota.liveness.orphans import Liveness, LuaScript
from extproc.quota.redis.backend import RedisQuotaBackend, load_lua
from extproc.quota.redis.resp import Script
from extproc.quota.resilience.backend import absorb_key
from loadlab.redis_server import RedisServer
from tests.quota.conftest import FakeClock

# Shadows the global ``redis`` for the script below it: every command's keys must be in
# KEYS (the first argument; every argument for DEL). TIME takes no key.
STRICT = """
local __declared = {}
for _, k in ipairs(KEYS) do __declared[k] = true end
local __real = redis
local redis = setmetatable({}, {__index = __real})
redis.call = function(command, ...)
  local args = {...}
  local name = string.upper(command)
  local keys = {}
  if name == 'DEL' then keys = args elseif name ~= 'TIME' then keys = {args[1]} end
  for _, key in ipairs(keys) do
    if not __declared[key] then
      error('undeclared key ' .. tostring(key) .. ' in ' .. name)
    end
  end
  return __real.call(command, ...)
end
"""

WINDOW = 60
RPM = Counter("rpm", counter_key("acme", "rpm", "m", WINDOW), 1000, WINDOW)
TPM = Counter("tpm", counter_key("acme", "tpm", "m", WINDOW), 1000, WINDOW)
TENANT_TPM = Counter("tenant_tpm", counter_key("acme", "tenant_tpm", None, 2), 100_000, 2)
DAILY = Counter("daily", counter_key("acme", "daily", None, 86400), 100_000, 86400)
TOKENS = (TPM, TENANT_TPM, DAILY)


def strict(backend: RedisQuotaBackend) -> RedisQuotaBackend:
    backend._admit = Script(STRICT + backend.script_source("admit.lua"))
    backend._reserve = Script(STRICT + backend.script_source("reserve.lua"))
    backend._settle = Script(STRICT + backend.script_source("settle.lua"))
    return backend


def admission(request_id: str, tokens: int = 100, **kwargs: object) -> AdmitRequest:
    return AdmitRequest(
        reservation_key("acme", request_id),
        (RPM,),
        TOKENS,
        tokens,
        usage=UsageTags("pro", "m", "c-1", 40),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
async def plain(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port, decode_responses=True)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def backend(redis_server: RedisServer) -> AsyncIterator[RedisQuotaBackend]:
    b = strict(RedisQuotaBackend.from_url(redis_server.url, owner_id="proc-a"))
    yield b
    await b.close()


async def server_now(client: aioredis.Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1_000_000


async def room(client: aioredis.Redis, window_s: int, need_s: float) -> None:
    """Wait, if need be, until ``need_s`` seconds remain in the current window."""
    now = await server_now(client)
    if window_s - now % window_s < need_s:
        await asyncio.sleep(window_s - now % window_s + 0.05)


async def test_the_strict_wrapper_fails_a_script_that_touches_an_undeclared_key(
    backend: RedisQuotaBackend,
) -> None:
    sneaky = Script(STRICT + "return redis.call('GET', KEYS[1] .. ':next')")
    with pytest.raises(Exception, match="undeclared key"):
        await backend._scripts.run_script(sneaky, ["tq:{acme}:x"], [])
    fine = Script(STRICT + "return redis.call('INCRBY', KEYS[1], 2)")
    assert await backend._scripts.run_script(fine, ["tq:{acme}:x"], []) == 2


async def test_every_path_of_every_script_touches_only_declared_keys(
    backend: RedisQuotaBackend, plain: aioredis.Redis, redis_server: RedisServer
) -> None:
    await room(plain, WINDOW, 10)
    # admit: admitted, replayed, refused, soft retry, cancelled, tombstone
    assert (await backend.admit(admission("a"))).admitted
    assert (await backend.admit(admission("a"))).replayed
    assert not (await backend.admit(admission("big", tokens=5000))).admitted
    assert (await backend.admit(admission("soft", tokens=950, soft_refusal=True))).retry_soon
    await backend.cancel(reservation_key("acme", "gone"), TOKENS)
    assert (await backend.admit(admission("gone"))).cancelled
    # reserve: granted, replayed, refused, not admitted, across a boundary of TENANT_TPM
    assert (await backend.reserve(admission("a").reservation_key, 1, TOKENS, 32)).granted
    assert (await backend.reserve(admission("a").reservation_key, 1, TOKENS, 32)).replayed
    assert not (
        await backend.reserve(admission("a").reservation_key, 2, TOKENS, 2000, 2000)
    ).granted
    assert not (await backend.reserve(admission("big").reservation_key, 1, TOKENS, 5)).granted
    await asyncio.sleep(2.1)  # TENANT_TPM's window ends: its charge is in a past window now
    assert (await backend.reserve(admission("a").reservation_key, 3, TOKENS, 16)).granted
    # settle: refund, past windows named only as strings; over the reservation; replays
    first = await backend.settle(admission("a").reservation_key, TOKENS, 50, reason="cutoff")
    assert not first.already_settled
    assert (await backend.settle(admission("a").reservation_key, TOKENS, 50)).already_settled
    assert (await backend.admit(admission("over"))).admitted
    await backend.settle(admission("over").reservation_key, TOKENS, 180, output_tokens=100)
    await backend.settle(admission("big").reservation_key, TOKENS, 10)
    # cancel of an admitted record; orphan settlement by a peer
    assert (await backend.admit(admission("lost"))).admitted
    await backend.cancel(admission("lost").reservation_key, TOKENS)
    assert (await backend.admit(admission("orphan"))).admitted
    status, _ = await backend.settle_orphan(admission("orphan").reservation_key, "proc-a")
    assert status == "settled"
    assert (await backend.settle_orphan(admission("orphan").reservation_key, "proc-a"))[
        0
    ] == "already_settled"
    # RPM only, and the ledger's retention (XADD MAXLEN ~, XTRIM MINID ~)
    backend.ledger = LedgerSettings(max_len=5, retention_s=3600)
    strict(backend)  # the ledger's settings are constants of the settle script: wrap it again
    rpm_only = AdmitRequest(reservation_key("acme", "rpm"), (RPM,), (), 10)
    assert (await backend.admit(rpm_only)).admitted
    await backend.settle(rpm_only.reservation_key, (), 10)

    # admission blocks: take (admitted, refused, replayed), admit from it (moved, replayed,
    # fallen back), return (now, again, a tombstone), orphan settlement of one
    block = AdmitRequest(block_key("acme", "proc-a", 1), (RPM,), TOKENS, 100)
    assert (await backend.take_block(block, 3)).verdict.admitted
    assert (await backend.take_block(block, 3)).verdict.replayed
    big_block = AdmitRequest(block_key("acme", "proc-a", 2), (RPM,), TOKENS, 5000)
    assert not (await backend.take_block(big_block, 3)).verdict.admitted
    assert (await backend.admit_from_block(block.reservation_key, admission("b1", 50))).from_block
    assert (await backend.admit_from_block(block.reservation_key, admission("b1", 50))).replayed
    fell = await backend.admit_from_block(block.reservation_key, admission("b2", 80))
    assert fell.admitted and not fell.from_block
    assert not (await backend.return_block(block.reservation_key, (RPM,), TOKENS)).already_settled
    assert (await backend.return_block(block.reservation_key, (RPM,), TOKENS)).already_settled
    await backend.return_block(block_key("acme", "proc-a", 3), (RPM,), TOKENS)
    dead = AdmitRequest(block_key("acme", "proc-a", 4), (RPM,), TOKENS, 10)
    assert (await backend.take_block(dead, 2)).verdict.admitted
    assert (await backend.settle_orphan(dead.reservation_key, "proc-a"))[0] == "settled"

    # absorb (the fail-open reconciliation), the call the resilient wrapper's queue makes
    backend._absorb = Script(STRICT + load_lua("absorb.lua"))
    now_s = math.floor(await server_now(plain))
    entries = tuple(
        (c.key, c.window_s, now_s - now_s % c.window_s - shift * c.window_s, 7)
        for c in (RPM, *TOKENS)
        for shift in (0, 1)
    )
    absorption = Absorption(absorb_key(admission("local").reservation_key), entries)
    assert await backend.absorb(absorption)  # applied (the script's 0)
    assert not await backend.absorb(absorption)  # applied before (its 1)

    stream = await plain.xrange(usage_stream_key(admission("a").reservation_key))
    assert [f["reason"] for _, f in stream] == [
        "cutoff",
        "completed",
        "cancelled",
        "orphaned",
        "completed",
        "returned",
        "orphaned",
    ]


async def test_a_wrong_clock_estimate_costs_one_retry_and_charges_the_right_window(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    await room(plain, WINDOW, 10)
    key = admission("w").reservation_key

    def wrong(by_s: float) -> None:
        backend.clock_offset_s = by_s

    async def current() -> int:
        now = math.floor(await server_now(plain))
        return now - now % WINDOW

    # Into the previous window: every call passes keys the server does not hold as current.
    now = await server_now(plain)
    wrong(-(now % WINDOW) - 1 - (time.time() - now))
    assert (await backend.admit(admission("w"))).admitted
    assert backend.window_retries == 1
    assert abs(backend.clock_offset_s) < 1  # learned from the reply
    wrong(WINDOW + 5)  # into the next one
    assert (await backend.reserve(key, 1, TOKENS, 30)).granted == 30
    assert backend.window_retries == 2
    wrong(-WINDOW)
    settlement = await backend.settle(key, TOKENS, 100)
    assert backend.window_retries == 3
    assert settlement.refunded == 30

    start = await current()
    assert await plain.get(f"{TPM.key}:{start}") == "100"
    assert await plain.get(f"{RPM.key}:{start}") == "1"
    assert await plain.keys(f"{TPM.key}:*") == [f"{TPM.key}:{start}"]
    [(_, fields)] = await plain.xrange(usage_stream_key(key))
    assert fields["windows"].split(";")[0] == f"tpm:{WINDOW}:{start}:100"


async def test_max_len_bounds_the_ledger_to_about_its_length(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    backend.ledger = LedgerSettings(max_len=20, retention_s=0)
    node = int((await plain.config_get("stream-node-max-entries"))["stream-node-max-entries"])
    for i in range(300):
        req = admission(f"m{i}", tokens=1)
        await backend.admit(req)
        await backend.settle(req.reservation_key, TOKENS, 1)
    stream = usage_stream_key(admission("m0").reservation_key)
    length = await plain.xlen(stream)
    # ``MAXLEN ~`` drops whole stream nodes only: between max_len and max_len + one node.
    assert 20 <= length <= 20 + node
    [(_, newest)] = await plain.xrevrange(stream, count=1)
    assert newest["request_id"] == "m299"


async def test_retention_drops_entries_older_than_retention_s(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    backend.ledger = LedgerSettings(max_len=0, retention_s=1)
    await plain.config_set("stream-node-max-entries", 2)  # whole nodes go: make them small
    try:
        for i in range(6):
            req = admission(f"old{i}", tokens=1)
            await backend.admit(req)
            await backend.settle(req.reservation_key, TOKENS, 1)
        stream = usage_stream_key(admission("old0").reservation_key)
        [(last_old, _)] = await plain.xrevrange(stream, count=1)
        old_ms = int(last_old.split("-")[0])
        while (await server_now(plain)) * 1000 < old_ms + 1000 + 50:
            await asyncio.sleep(0.1)
        for i in range(3):
            req = admission(f"new{i}", tokens=1)
            await backend.admit(req)
            await backend.settle(req.reservation_key, TOKENS, 1)
        left = [f["request_id"] for _, f in await plain.xrange(stream)]
    finally:
        await plain.config_set("stream-node-max-entries", 100)
    assert left[-3:] == ["new0", "new1", "new2"]
    # Old entries sharing a node with a newer one may stay: at most one node's worth.
    assert len([r for r in left if r.startswith("old")]) <= 1


SHAPES = (
    Counter(
        "tpm",
        counter_key("acme", "tpm", "m", 4, span="sl4.1"),
        1000,
        4,
        shape="sliding",
        bucket_s=1,
    ),
    Counter(
        "monthly_cost",
        counter_key("acme", "monthly_cost", None, 31 * 86400, span="month.Europe%2FBerlin"),
        10**12,
        31 * 86400,
        shape="calendar",
        period="month",
        timezone="Europe/Berlin",
        weights=(2500, 10_000, 1250),
    ),
    Counter("otpm", counter_key("acme", "otpm", "m", 60), 50, 60, weights=(0, 1, 0), shadow=True),
)


async def test_sliding_calendar_weighted_and_shadow_counters_touch_only_declared_keys(
    backend: RedisQuotaBackend, plain: aioredis.Redis
) -> None:
    """A sliding hash (trimmed by bucket, by HGETALL after an idle spell, deleted when all
    of it left), a calendar window, cost weights and a shadow counter, through every
    script path."""

    def shaped(request_id: str, tokens: int = 100) -> AdmitRequest:
        return AdmitRequest(
            reservation_key("acme", request_id),
            (RPM,),
            SHAPES,
            tokens,
            usage=UsageTags("pro", "m", "", 40),
        )

    await room(plain, WINDOW, 15)
    assert (await backend.admit(shaped("s1", 900))).admitted
    refused = await backend.admit(shaped("s2", 200))  # sliding refuses: Retry-After walk
    assert not refused.admitted and refused.states[1].retry_s is not None
    grant = await backend.reserve(shaped("s1").reservation_key, 1, SHAPES, 64)
    assert grant.granted == 64 and grant.shadow_cut_by == ("otpm",)
    await asyncio.sleep(2.1)  # two buckets on: the trim walks them
    assert (await backend.reserve(shaped("s1").reservation_key, 2, SHAPES, 8)).granted == 8
    await backend.settle(
        shaped("s1").reservation_key, SHAPES, 500, output_tokens=460, cached_tokens=20
    )
    assert (await backend.admit(shaped("s3", 50))).admitted
    await asyncio.sleep(5.1)  # the whole window left: the hash is dropped and rebuilt
    assert (await backend.admit(shaped("s4", 50))).admitted
    await backend.cancel(shaped("s4").reservation_key, SHAPES)
    await backend.settle(shaped("s3").reservation_key, SHAPES, 80)
    stream = await plain.xrange(usage_stream_key(shaped("s1").reservation_key))
    assert [f["reason"] for _, f in stream] == ["completed", "cancelled", "completed"]


async def test_the_liveness_scripts_touch_only_declared_keys(
    backend: RedisQuotaBackend, plain: aioredis.Redis, redis_server: RedisServer
) -> None:
    """beat.lua and forget.lua (the {~p} slot), and the open sets admit.lua and settle.lua
    keep in the tenant's slot, through a processor's life and a peer's sweep of it."""

    def strict_liveness(b: RedisQuotaBackend, clock: FakeClock) -> Liveness:
        live = Liveness(b, Metrics(), heartbeat_ttl_s=30, clock=clock)
        live._beat = LuaScript(b.client, STRICT + live._beat.script)
        live._forget = LuaScript(b.client, STRICT + live._forget.script)
        return live

    clock = FakeClock(0.0)
    dying = strict_liveness(backend, clock)
    assert (await backend.admit(admission("open"))).admitted  # the beat that lists acme
    assert (await backend.admit(admission("done"))).admitted
    await backend.settle(admission("done").reservation_key, TOKENS, 10)
    await dying.beat()
    peer_backend = strict(RedisQuotaBackend.from_url(redis_server.url, owner_id="proc-b"))
    try:
        peer = strict_liveness(peer_backend, clock)
        await peer.beat()
        clock.now += 30
        await plain.delete(heartbeat_key("proc-a"))
        assert await peer.sweep() == 1  # SRANDMEMBER, settle (orphan mode), forget
        await peer.stop()  # DEL heartbeat, EXISTS of its sets, forget
    finally:
        await peer_backend.close()
    assert await plain.keys("*:{~p}:*") == []
