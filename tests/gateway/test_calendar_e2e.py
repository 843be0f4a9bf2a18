"""Calendar budgets and the seed RLS config end to end, on a Redis-side clock the test moves.

The processor runs with ``EXTPROC_TEST_CLOCK_KEY``: its Lua scripts add the integer in that
key to Redis ``TIME``, so the test can put the quota's clock 10 s before midnight on the 1st
of a month in Berlin, or at the start of a DST-change day, while Envoy, the simulator and
the client keep real time. Every expected reset is worked out from the instant the test set
and hand-written UTC bounds, never from the code under test. Only future instants are used:
counter keys expire at their window's end on the shifted clock, which Redis's own expiry
compares with real time.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from loadlab.gateway import ROOT, Envoy, Gateway, Processor, key_hash, wait_until, write_config
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import MODELS, tenant_key
from tests.support.quota_views import counter_total, ledger, ledger_net

CLOCK_KEY = "e2e:test-clock"
SEED_RLS = ROOT / "envoy_config" / "ratelimit" / "ai-gateway.yaml"
BUDGET = 60  # tokens: one 40-token answer fits, a second does not
BERLIN = "Europe/Berlin"


def utc(*args: int) -> int:
    return int(dt.datetime(*args, tzinfo=dt.UTC).timestamp())


# Berlin: 2027-01-01 00:00 CET is 2026-12-31 23:00 UTC; February starts 2027-01-31 23:00.
NEW_YEAR, FEBRUARY = utc(2026, 12, 31, 23), utc(2027, 1, 31, 23)
# Berlin's DST days in 2027: Sun Mar 28 (02:00 CET -> 03:00 CEST) has 23 hours, Sun Oct 31
# (03:00 CEST -> 02:00 CET) has 25.
SPRING_DAY = (utc(2027, 3, 27, 23), utc(2027, 3, 28, 22))
FALL_DAY = (utc(2027, 10, 30, 22), utc(2027, 10, 31, 23))

BUDGET_PLAN = {"window_s": 3600, "limits": {"*": {"rpm": 1000}}, "timezone": BERLIN,
               "charge_mode": "reserve_max"}  # fmt: skip
PLANS: dict[str, dict[str, Any]] = {
    "monthly": {**BUDGET_PLAN, "monthly_tokens": BUDGET},
    "daily-spring": {**BUDGET_PLAN, "daily_tokens": BUDGET},
    "daily-fall": {**BUDGET_PLAN, "daily_tokens": BUDGET},
}
# Tenants on the seed file's plans (defined there, not under ``plans``).
RLS_TENANTS = {"rls-standard": "standard", "rls-enterprise": "enterprise"}


class RedisClock:
    """The quota's clock: Redis TIME plus the shift in ``CLOCK_KEY``."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def real(self) -> float:
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def now(self) -> float:
        return self.real() + int(self.client.get(CLOCK_KEY) or 0)

    def set_to(self, instant: float) -> None:
        """Shift the clock so that it reads ``instant`` now (to within a second: the shift
        is whole seconds; ``now`` tells exactly)."""
        shift = round(instant - self.real())
        assert shift >= 0, "only future instants: counter expiry runs on real time"
        self.client.set(CLOCK_KEY, shift)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    simulators: list[Simulator],
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("calendar-e2e")
    tenants = {
        **{name: {"plan": name, "key_sha256": [key_hash(tenant_key(name))]} for name in PLANS},
        **{
            name: {"plan": plan, "key_sha256": [key_hash(tenant_key(name))]}
            for name, plan in RLS_TENANTS.items()
        },
    }
    config = write_config(
        workdir / "quota.yaml",
        {
            "redis_url": redis_server.url,
            "models": MODELS,
            "ratelimit_file": str(SEED_RLS),
            "plans": PLANS,
            "tenants": tenants,
            "refund_wait_ms": 0,
            # The default age bound (a week) stays on: it trims by the stream's own ids,
            # so a clock months ahead must not empty the ledger.
        },
    )
    client = redis.Redis(port=redis_server.port)
    client.delete(CLOCK_KEY)
    processor = Processor.start(config, workdir, env={"EXTPROC_TEST_CLOCK_KEY": CLOCK_KEY})
    try:
        envoy = Envoy.start(workdir, [processor.port], [s.port for s in simulators])
    except BaseException:
        processor.stop()
        raise
    gw = Gateway(envoy, [processor])
    yield gw
    gw.stop()
    client.delete(CLOCK_KEY)
    client.close()


@pytest.fixture()
def clock(redis_client: redis.Redis) -> RedisClock:
    return RedisClock(redis_client)


def sdk(gateway: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=tenant_key(tenant), max_retries=0
    )


def ask(gateway: Gateway, tenant: str, max_tokens: int = 40) -> Any:
    """One non-streamed request (reserve_max: admission charges prompt + max_tokens)."""
    return sdk(gateway, tenant).chat.completions.with_raw_response.create(
        model="gpt-4.1",
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )


def reset_seconds(text: str) -> float:
    """``x-ratelimit-reset-*`` (``850ms``, ``12s``, ``6m0s``, ``719h59m50s``) in seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?", text)
    assert match and text, text
    h, m, s, ms = (int(g or 0) for g in match.groups())
    return h * 3600 + m * 60 + s + ms / 1000


def billed_in_full(client: redis.Redis, tenant: str, kind: str, used: list[int]) -> bool:
    """One ledger entry per admitted request, and the budget's counter holds their usage."""
    entries = ledger(client, tenant)
    return sorted(int(e["used"]) for e in entries) == sorted(used) and ledger_net(
        entries, kind
    ) == sum(used) == counter_total(client, tenant, kind)


def refused_until(
    gateway: Gateway, clock: RedisClock, tenant: str, end: int
) -> tuple[openai.RateLimitError, float, float]:
    """Spend the tenant's budget; the refusal and the time to ``end`` before and after it
    (the refusal happened on the quota's clock in between)."""
    first = ask(gateway, tenant)
    assert first.http_response.status_code == 200
    before = end - clock.now()
    with pytest.raises(openai.RateLimitError) as info:
        ask(gateway, tenant)  # admission already holds the first one's prompt + max_tokens
    after = end - clock.now()
    assert after > 0, "the test's own timing: the boundary passed during the requests"
    kind = "monthly" if tenant == "monthly" else "daily"
    used = [first.parse().usage.total_tokens]
    assert wait_until(lambda: billed_in_full(clock.client, tenant, kind, used))
    return info.value, before, after


def assert_reset_between(error: openai.RateLimitError, before: float, after: float) -> None:
    headers = error.response.headers
    assert math.ceil(after) <= int(headers["retry-after"]) <= math.ceil(before)
    reset = reset_seconds(headers["x-ratelimit-reset-tokens"])
    assert math.floor(after) <= reset <= math.ceil(before)


def test_monthly_budget_refuses_until_the_month_ends_in_berlin_then_admits(
    gateway: Gateway, clock: RedisClock
) -> None:
    clock.set_to(NEW_YEAR - 10)
    error, before, after = refused_until(gateway, clock, "monthly", NEW_YEAR)
    assert error.code == "monthly_budget_exceeded"
    assert after <= 11
    assert_reset_between(error, before, after)

    clock.set_to(NEW_YEAR + 1)
    sent = FEBRUARY - clock.now()
    fresh = ask(gateway, "monthly")
    received = FEBRUARY - clock.now()
    assert fresh.http_response.status_code == 200
    usage = fresh.parse().usage
    # Billed to January's window: December's keeps the first request alone.
    first = ledger(clock.client, "monthly")[0]
    used = [int(first["used"]), usage.total_tokens]
    assert wait_until(lambda: billed_in_full(clock.client, "monthly", "monthly", used))
    headers = fresh.headers
    assert headers["x-ratelimit-limit-tokens"] == str(BUDGET)
    assert int(headers["x-ratelimit-remaining-tokens"]) == BUDGET - usage.total_tokens
    # January in Berlin: 31 days from the boundary
    assert math.floor(received) <= reset_seconds(headers["x-ratelimit-reset-tokens"])
    assert reset_seconds(headers["x-ratelimit-reset-tokens"]) <= math.ceil(sent)
    assert FEBRUARY - NEW_YEAR == 31 * 86400


@pytest.mark.parametrize(
    ("tenant", "day", "hours"), [("daily-spring", SPRING_DAY, 23), ("daily-fall", FALL_DAY, 25)]
)
def test_daily_budget_on_a_dst_change_day_resets_after_23_or_25_hours(
    gateway: Gateway, clock: RedisClock, tenant: str, day: tuple[int, int], hours: int
) -> None:
    start, end = day
    assert end - start == hours * 3600
    clock.set_to(start + 10)
    error, before, after = refused_until(gateway, clock, tenant, end)
    assert error.code == "daily_budget_exceeded"
    assert_reset_between(error, before, after)
    # The rest of a 23 h (25 h) day, not of a 24 h one: the clock was set 10 s into it.
    reset = reset_seconds(error.response.headers["x-ratelimit-reset-tokens"])
    assert (hours - 1) * 3600 < reset <= hours * 3600 - 9


def test_seed_rls_config_enforces_60_requests_per_minute(
    gateway: Gateway, clock: RedisClock
) -> None:
    # Put the quota's clock one second into a minute, so 61 requests fall in one window.
    minute = math.ceil(clock.now() / 60) * 60 + 60
    clock.set_to(minute + 1)
    c = sdk(gateway, "rls-standard")
    for i in range(60):
        raw = c.chat.completions.with_raw_response.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "60"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(59 - i)
        assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert clock.now() < minute + 60, "the test's own timing: 61 requests took a minute"
    assert info.value.code == "rpm_limit_exceeded"
    assert info.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # The other seed plan loaded with its own limits.
    other = sdk(gateway, "rls-enterprise").chat.completions.with_raw_response.create(
        model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert other.headers["x-ratelimit-limit-requests"] == "1000"
    assert other.headers["x-ratelimit-limit-tokens"] == "2000000"
