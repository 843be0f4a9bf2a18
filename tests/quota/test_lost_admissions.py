"""An admission Redis acknowledged and then lost (a failover before its replica had the
write, a restart without persistence) is charged at its settlement, once.

Redis replication is asynchronous: the replica that takes over may hold none of an
admission's writes — its record, its charges, its open count — though the processor saw it
admitted and streamed. A lost admission is made on one real Redis by putting every key of
the tenant back as it was before the admission (what the promoted replica would hold).
"""

from __future__ import annotations

import itertools
import time

import pytest
import redis.asyncio as aioredis

from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import AdmitRequest, Counter, UsageTags
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.resilience.backend import ResilientQuotaBackend
from extproc.quota.resilience.queue import SEEN_RETRY_S, Op
from loadlab.redis_server import RedisServer
from tests.quota.conftest import Harness

_ids = itertools.count()
TENANT = "lossy"
TPM = Counter("tpm", keys.counter_key(TENANT, "tpm", "m", 3600), 1_000_000, 3600)


def new_key() -> str:
    return keys.reservation_key(TENANT, f"req-{next(_ids)}")


async def tenant_snapshot(plain: aioredis.Redis) -> dict[str, tuple[bytes, int]]:
    found = await plain.keys(f"*{{{TENANT}}}*")
    return {k: (await plain.dump(k), await plain.pttl(k)) for k in found}


async def lose_writes_since(plain: aioredis.Redis, before: dict[str, tuple[bytes, int]]) -> None:
    """The tenant's keys as a replica promoted before it had the writes since ``before``."""
    for k in set(await plain.keys(f"*{{{TENANT}}}*")) - set(before):
        await plain.delete(k)
    for k, (dump, ttl) in before.items():
        await plain.restore(k, max(ttl, 0), dump, replace=True)


async def charged(plain: aioredis.Redis) -> int:
    return sum([int(await plain.get(k) or 0) for k in await plain.keys(TPM.key + ":*")])


async def admit_and_lease(backend: RedisQuotaBackend, key: str) -> None:
    assert (await backend.admit(AdmitRequest(key, (), (TPM,), 100))).admitted
    assert (await backend.reserve(key, 1, (TPM,), 32)).granted == 32


@pytest.fixture
async def backend(redis_server: RedisServer, plain_redis: aioredis.Redis):  # type: ignore[no-untyped-def]
    b = RedisQuotaBackend.from_url(redis_server.url, owner_id="proc-a")
    try:
        yield b
    finally:
        await b.close()


async def test_a_settlement_whose_admission_redis_lost_charges_what_was_used_once(
    backend: RedisQuotaBackend, plain_redis: aioredis.Redis
) -> None:
    other = new_key()  # another open request of the tenant: its open count must stay
    assert (await backend.admit(AdmitRequest(other, (), (TPM,), 50))).admitted
    before = await tenant_snapshot(plain_redis)
    key = new_key()
    await admit_and_lease(backend, key)
    assert await charged(plain_redis) == 50 + 132
    await lose_writes_since(plain_redis, before)
    assert await charged(plain_redis) == 50 and not await plain_redis.exists(key)

    tags = UsageTags("gold", "gpt-4.1", "client-7", 50)
    settled = await backend.settle(
        key, (TPM,), used=90, output_tokens=40, seen_admitted=True, usage=tags
    )
    assert settled.record_lost and not settled.already_settled
    assert (settled.reserved, settled.used, settled.refunded) == (0, 90, 0)
    assert await charged(plain_redis) == 50 + 90
    assert int(await plain_redis.get(keys.open_count_key(key)) or 0) == 1  # `other` only
    entries = [f for _, f in await plain_redis.xrange(keys.usage_stream_key(key))]
    assert [(e["used"], e["prompt_tokens"], e["output_tokens"]) for e in entries] == [
        ("90", "50", "40")
    ]
    assert (entries[0]["plan"], entries[0]["model"], entries[0]["client_request_id"]) == (
        "gold",
        "gpt-4.1",
        "client-7",
    )
    [window] = entries[0]["windows"].split(";")
    assert int(window.rsplit(":", 1)[1]) == 90  # the ledger's net is the counter's charge

    again = await backend.settle(key, (TPM,), used=90, output_tokens=40, seen_admitted=True)
    assert again.already_settled and not again.record_lost
    assert await charged(plain_redis) == 50 + 90
    assert len(await plain_redis.xrange(keys.usage_stream_key(key))) == 1
    assert 0 < await plain_redis.ttl(key) <= 120  # the settled record lives SETTLED_TTL_S


async def test_a_plain_settlement_without_a_record_charges_nothing(
    backend: RedisQuotaBackend, plain_redis: aioredis.Redis
) -> None:
    """Without ``seen_admitted`` (a late replay: the settled record may have expired since
    the first try was applied) a missing record charges nothing, as before."""
    before = await tenant_snapshot(plain_redis)
    key = new_key()
    await admit_and_lease(backend, key)
    await lose_writes_since(plain_redis, before)
    settled = await backend.settle(key, (TPM,), used=90, output_tokens=40)
    assert not settled.record_lost and settled.reserved == 0
    assert await charged(plain_redis) == 0
    assert await plain_redis.xrange(keys.usage_stream_key(key)) == []


async def test_a_seen_settlement_of_a_recorded_admission_is_a_plain_settlement(
    harness: Harness,
) -> None:
    """Both backends: with the record in place ``seen_admitted`` changes nothing; without
    one (a key the memory backend never admitted stands for a lost one) it charges."""
    b = harness.backend
    kept, lost = new_key(), new_key()
    assert (await b.admit(AdmitRequest(kept, (), (TPM,), 100))).admitted
    settled = await b.settle(kept, (TPM,), used=60, output_tokens=10, seen_admitted=True)
    assert (settled.reserved, settled.refunded, settled.record_lost) == (100, 40, False)
    assert sum((await harness.windows(TPM)).values()) == 60

    tags = UsageTags("gold", "gpt-4.1", "client-9", 20)
    gone = await b.settle(lost, (TPM,), used=25, output_tokens=5, seen_admitted=True, usage=tags)
    assert (gone.reserved, gone.refunded, gone.record_lost) == (0, 0, True)
    assert sum((await harness.windows(TPM)).values()) == 85
    replay = await b.settle(lost, (TPM,), used=25, output_tokens=5, seen_admitted=True)
    assert replay.already_settled and sum((await harness.windows(TPM)).values()) == 85
    ledger = await harness.ledger(keys.usage_stream_key(lost))
    assert [(f["request_id"], f["used"], f["output_tokens"]) for _, f in ledger] == [
        ("req-" + kept.rsplit("req-", 1)[1], "60", "10"),
        ("req-" + lost.rsplit("req-", 1)[1], "25", "5"),
    ]
    lost_entry = ledger[1][1]
    assert (lost_entry["plan"], lost_entry["model"], lost_entry["client_request_id"]) == (
        "gold",
        "gpt-4.1",
        "client-9",
    )


@pytest.mark.parametrize("late", [False, True], ids=["soon", "late"])
async def test_a_queued_settlement_charges_a_lost_admission_only_while_no_replay_can_double(
    backend: RedisQuotaBackend, plain_redis: aioredis.Redis, late: bool
) -> None:
    """A settlement queued while Redis could not answer keeps ``seen_admitted`` for
    ``SEEN_RETRY_S``: a first try applied before its answer was lost is still found settled
    then. Later it is sent plain, since that settled record may have expired."""
    metrics = Metrics()
    resilient = ResilientQuotaBackend(backend, metrics=metrics)
    before = await tenant_snapshot(plain_redis)
    key = new_key()
    await admit_and_lease(backend, key)
    await lose_writes_since(plain_redis, before)
    op = Op("settle", key, (TPM,), used=90, reason="completed")
    op.seen_admitted, op.usage = True, UsageTags("gold", "gpt-4.1", "client-8", 0)
    if late:
        op.queued_at = time.monotonic() - SEEN_RETRY_S - 1
    assert resilient.queue.put(op)
    assert await resilient.flush(10)
    assert metrics.quota_queue_applied_total == 1
    assert await charged(plain_redis) == (0 if late else 90)
    entries = [f for _, f in await plain_redis.xrange(keys.usage_stream_key(key))]
    assert [(e["plan"], e["model"]) for e in entries] == ([] if late else [("gold", "gpt-4.1")])
