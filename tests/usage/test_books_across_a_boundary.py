"""A window's counter expires with it, its ledger entries stay: what the tests' books compare.

The gateway tests check counters == ledger with ``tests.support.quota_views.live_books``. A
test that runs across a window boundary finds the ended window in the ledger but no longer
in the counters (its key expires ``EXPIRY_MARGIN_S`` after the window ends). This proves that
on the real backend and real Redis, and that ``live_books`` leaves out just that window.
"""

from __future__ import annotations

import asyncio

import redis

from extproc.quota import windows
from extproc.quota.base import AdmitRequest, Counter
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.gateway import wait_until
from loadlab.redis_server import RedisServer
from tests.support.quota_views import ledger, ledger_net, live_books, server_now

TENANT = "boundary"
WINDOW_S = 1  # the shortest fixed window: a boundary within a second


async def _charge(url: str, request_id: str, used: int) -> None:
    backend = RedisQuotaBackend.from_url(url)
    tpm = Counter("tpm", counter_key(TENANT, "tpm", "m", WINDOW_S), 10**9, WINDOW_S)
    key = reservation_key(TENANT, request_id)
    try:
        await backend.admit(AdmitRequest(key, (), (tpm,), used + 5))
        await backend.settle(key, (tpm,), used)
    finally:
        await backend.close()


def test_an_ended_windows_counter_expires_and_only_live_windows_are_compared(
    usage_redis: RedisServer, plain: redis.Redis
) -> None:
    # (An admission and its settlement may fall in two windows: the first keeps what it got.)
    asyncio.run(_charge(usage_redis.url, "before", 7))
    counters, listed = live_books(plain, TENANT, "tpm")
    assert counters == listed and len(counters) == 1
    [((span, first), kept_first)] = counters.items()

    # Once the first window's key is gone (it ended EXPIRY_MARGIN_S ago), charge the next.
    gone_at = first + span + windows.EXPIRY_MARGIN_S
    assert wait_until(lambda: server_now(plain) > gone_at, timeout_s=30, interval_s=0.05)
    asyncio.run(_charge(usage_redis.url, "after", 11))

    counters, listed = live_books(plain, TENANT, "tpm")
    assert counters == listed and len(counters) == 1
    [((_, second), kept_second)] = counters.items()
    assert second > first and kept_second >= 11
    # The ledger still holds both requests; the counters only the live window.
    assert ledger_net(ledger(plain, TENANT), "tpm") == kept_first + kept_second
    assert not plain.exists(counter_key(TENANT, "tpm", "m", WINDOW_S) + f":{first}")

    # A live window the ledger does not list still shows.
    later = int(server_now(plain)) + 3600
    plain.set(counter_key(TENANT, "tpm", "m", WINDOW_S) + f":{later}", 1, ex=60)
    counters, listed = live_books(plain, TENANT, "tpm")
    assert counters[(span, later)] == 1 and (span, later) not in listed
