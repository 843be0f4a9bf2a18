"""Record lifetimes on both backends: open an hour, settled two minutes, cancelled as before.

A settled record only has to answer the settling processor's own retries of ``settle``;
keeping it for the hour an open record lives costs ~1 KB per request for nothing. A
tombstone (``cancel`` before any admission) and a cancelled record keep their TTL: an admit
may still be queued for that key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from extproc.quota.base import RECORD_TTL_S, SETTLED_TTL_S, Counter, QuotaBackend
from extproc.quota.keys import block_key, open_count_key, open_set_key, reservation_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import RedisQuotaBackend
from tests.quota.conftest import Harness, MemoryHarness, RedisHarness
from tests.quota.test_conformance import HOUR, admit_request, counter, peer

_ids = itertools.count()


async def record_ttl(harness: Harness, key: str, backend: QuotaBackend | None = None) -> float:
    """Seconds the record of ``key`` has left; -2 when there is none (as Redis ``TTL``)."""
    if isinstance(harness, MemoryHarness):
        memory = backend if isinstance(backend, MemoryQuotaBackend) else harness.memory
        ttl = memory.record_ttl(key)
        return -2 if ttl is None else ttl
    assert isinstance(harness, RedisHarness)
    ttl_ms = int(await harness.plain.pttl(key))
    return float(ttl_ms) if ttl_ms < 0 else ttl_ms / 1000


def short_lived(harness: Harness, settled_ttl_s: int) -> QuotaBackend:
    """A second backend on the same store (and clock) whose settled records live briefly."""
    if isinstance(harness, MemoryHarness):
        # Its own store, but the harness's clock: the test advances time for it.
        return MemoryQuotaBackend(clock=harness.clock, settled_ttl_s=settled_ttl_s)
    assert isinstance(harness, RedisHarness)
    return RedisQuotaBackend.from_url(harness.server.url, settled_ttl_s=settled_ttl_s)


async def let_record_expire(harness: Harness, backend: QuotaBackend, key: str) -> None:
    if isinstance(harness, MemoryHarness):
        harness.clock.now += 1.5
        return
    for _ in range(400):  # Redis expires it on its own clock; wait until it has
        if await record_ttl(harness, key) == -2:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"record {key} did not expire")


async def test_an_open_record_lives_an_hour_and_a_settled_one_at_most_two_minutes(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    request = admit_request(None, (tpm,), 100)
    await harness.backend.admit(request)
    await harness.backend.reserve(request.reservation_key, 1, (tpm,), 32)

    assert SETTLED_TTL_S < await record_ttl(harness, request.reservation_key) <= RECORD_TTL_S
    settlement = await harness.backend.settle(request.reservation_key, (tpm,), used=90)
    assert 0 < await record_ttl(harness, request.reservation_key) <= SETTLED_TTL_S

    # Within that time a retry of the settlement is answered from the record, once.
    again = await harness.backend.settle(request.reservation_key, (tpm,), used=90)
    assert again.already_settled and (again.reserved, again.used) == (132, 90)
    assert settlement.refunded == 42 and await harness.total(tpm) == 90


async def test_settling_never_lengthens_a_record_that_expires_sooner(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    request = dataclasses.replace(admit_request(None, (tpm,), 100), record_ttl_s=30)
    await harness.backend.admit(request)
    await harness.backend.settle(request.reservation_key, (tpm,), used=100)
    assert 0 < await record_ttl(harness, request.reservation_key) <= 30


async def test_a_tombstone_and_a_cancelled_record_keep_their_lifetime(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    admitted = admit_request(None, (tpm,), 100)
    await harness.backend.admit(admitted)
    await harness.backend.cancel(admitted.reservation_key, (tpm,))
    tombstone = reservation_key("acme", f"never-admitted-{next(_ids)}")
    await harness.backend.cancel(tombstone, (tpm,))

    # An admission may still be queued for either key: both outlive it as before.
    assert SETTLED_TTL_S < await record_ttl(harness, admitted.reservation_key) <= RECORD_TTL_S
    assert SETTLED_TTL_S < await record_ttl(harness, tombstone) <= RECORD_TTL_S
    assert await harness.total(tpm) == 0


async def test_a_refused_record_is_not_shortened_by_a_settle(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10)
    refused = admit_request(None, (tpm,), 100)
    assert not (await harness.backend.admit(refused)).admitted
    await harness.backend.settle(refused.reservation_key, (tpm,), used=5)
    # Its replay must still come back refused, whatever capacity frees up meanwhile.
    assert SETTLED_TTL_S < await record_ttl(harness, refused.reservation_key) <= RECORD_TTL_S
    assert await harness.total(tpm) == 0


async def test_a_settle_retry_after_the_settled_record_expired_charges_nothing(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 10)
    backend = short_lived(harness, settled_ttl_s=1)
    try:
        tpm = counter("tpm", 10_000)
        request = admit_request(None, (tpm,), 100)
        assert (await backend.admit(request)).admitted
        await backend.settle(request.reservation_key, (tpm,), used=60)
        # At most a second left (or already gone, on a slow machine), and never no expiry.
        ttl = await record_ttl(harness, request.reservation_key, backend)
        assert ttl == -2 or 0 <= ttl <= 1
        charged = await _charged(harness, backend, tpm)
        assert charged == 60

        await let_record_expire(harness, backend, request.reservation_key)
        late = await backend.settle(request.reservation_key, (tpm,), used=60)
        assert (late.reserved, late.refunded, late.already_settled) == (0, 0, False)
        assert await _charged(harness, backend, tpm) == charged
    finally:
        await backend.close()


def test_settled_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="settled_ttl_s"):
        MemoryQuotaBackend(settled_ttl_s=0)
    with pytest.raises(ValueError, match="settled_ttl_s"):
        RedisQuotaBackend.from_url("redis://127.0.0.1:1/0", settled_ttl_s=0)


async def _charged(harness: Harness, backend: QuotaBackend, tpm: Counter) -> int:
    """What ``backend`` holds on the counter (the memory twin keeps its own store)."""
    if isinstance(backend, MemoryQuotaBackend) and backend is not harness.backend:
        head = tpm.key + ":"
        return sum(v for k, v in backend.counters().items() if k.startswith(head))
    return await harness.total(tpm)


async def test_a_block_lives_like_a_record_and_once_returned_like_a_settled_one(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    owner = peer(harness).owner_id
    take = dataclasses.replace(
        admit_request(None, (tpm,), 100), reservation_key=block_key("acme", owner, next(_ids))
    )
    assert (await harness.backend.take_block(take, 2)).verdict.admitted
    assert SETTLED_TTL_S < await record_ttl(harness, take.reservation_key) <= RECORD_TTL_S
    await harness.backend.return_block(take.reservation_key, (), (tpm,))
    assert 0 < await record_ttl(harness, take.reservation_key) <= SETTLED_TTL_S
    # A return that met no block leaves a tombstone for tombstone_ttl_s.
    lost = block_key("acme", owner, next(_ids))
    await harness.backend.return_block(lost, (), (tpm,), tombstone_ttl_s=600)
    assert SETTLED_TTL_S < await record_ttl(harness, lost) <= 600


async def shorten_life(harness: Harness, key: str, left_s: float) -> None:
    """Bring the record of ``key`` to ``left_s`` seconds of life, as if time had passed."""
    if isinstance(harness, MemoryHarness):
        ttl = harness.memory.record_ttl(key)
        assert ttl is not None
        harness.clock.now += ttl - left_s
        return
    assert isinstance(harness, RedisHarness)
    assert await harness.plain.pexpire(key, int(left_s * 1000))
    for listing in (open_count_key(key), open_set_key(key, harness.backend.owner_id)):
        await harness.plain.pexpire(listing, int(left_s * 1000), lt=True)


async def still_listed_open(harness: Harness, key: str, lifetime_s: float) -> bool:
    """Is the record of ``key`` in its owner's open set, which lives as long as it does?"""
    listing = open_set_key(key, harness.backend.owner_id)
    if isinstance(harness, MemoryHarness):
        return key in harness.memory.open_set(listing)
    assert isinstance(harness, RedisHarness)
    ttls = [await harness.plain.pttl(k) / 1000 for k in (listing, open_count_key(key))]
    return bool(await harness.plain.sismember(listing, key)) and all(
        lifetime_s - 5 < t <= lifetime_s for t in ttls
    )


async def test_a_stream_that_outlives_its_record_lifetime_is_settled_once_at_its_use(
    harness: Harness,
) -> None:
    # Only the memory backend's clock moves on (150 s): the window must hold all of it.
    await harness.ensure_room(HOUR, 160 if isinstance(harness, MemoryHarness) else 5)
    tpm = counter("tpm", 100_000)
    request = dataclasses.replace(admit_request(None, (tpm,), 100), record_ttl_s=30)
    assert (await harness.backend.admit(request)).admitted
    # Each lease comes when the record has 5 of its 30 seconds left: six leases span 150 s,
    # five lifetimes, and each grant renews the record.
    for seq in range(1, 7):
        await shorten_life(harness, request.reservation_key, 5)
        grant = await harness.backend.reserve(request.reservation_key, seq, (tpm,), 32)
        assert grant.granted == 32 and grant.states
        assert 25 < await record_ttl(harness, request.reservation_key) <= 30
        # So do the keys a peer finds it by once this processor dies (tests/quota/test_orphans.py).
        assert await still_listed_open(harness, request.reservation_key, 30)

    settlement = await harness.backend.settle(
        request.reservation_key, (tpm,), used=250, seen_admitted=True
    )
    assert not settlement.record_lost and not settlement.already_settled
    assert (settlement.reserved, settlement.used, settlement.refunded) == (292, 250, 42)
    assert await harness.total(tpm) == 250


async def test_a_refused_lease_does_not_renew_a_record(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 120)
    request = dataclasses.replace(admit_request(None, (tpm,), 100), record_ttl_s=30)
    assert (await harness.backend.admit(request)).admitted
    await shorten_life(harness, request.reservation_key, 5)
    assert (await harness.backend.reserve(request.reservation_key, 1, (tpm,), 32, 32)).granted == 0
    assert 0 < await record_ttl(harness, request.reservation_key) <= 5
