"""Sliding and calendar windows, input/output/cost weights and shadow counters: one suite
on real redis-server and on the memory backend.

Time moves on both sides by a controlled clock: the memory backend's injected one, and on
Redis the test-only clock key (``EXTPROC_TEST_CLOCK_KEY``) whose integer the scripts add
to ``TIME``. Bucket and window facts are read back from the reservation records (the
bucket every charge went to), so no assertion depends on how fast the test runs.
"""

from __future__ import annotations

import itertools
import random
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from extproc.quota.base import AdmitRequest, Counter, UsageTags
from extproc.quota.calendar import calendar_bounds
from extproc.quota.keys import counter_key, reservation_key, usage_stream_key, window_span
from tests.quota.conftest import Clocked

_ids = itertools.count()


def sliding(kind: str, limit: int, window_s: int = 10, bucket_s: int = 1, **kw: Any) -> Counter:
    span = window_span("sliding", window_s, bucket_s)
    key = counter_key("acme", kind, "m", window_s, span=span)
    return Counter(kind, key, limit, window_s, shape="sliding", bucket_s=bucket_s, **kw)


def fixed(kind: str, limit: int, window_s: int = 3600, **kw: Any) -> Counter:
    return Counter(kind, counter_key("acme", kind, "m", window_s), limit, window_s, **kw)


def monthly(limit: int, zone: str) -> Counter:
    span = window_span("calendar", 31 * 86400, period="month", zone=zone)
    key = counter_key("acme", "monthly", None, 31 * 86400, span=span)
    return Counter(
        "monthly", key, limit, 31 * 86400, shape="calendar", period="month", timezone=zone
    )


def admit(
    tokens: int,
    *counters: Counter,
    prompt: int = 0,
    requests: tuple[Counter, ...] = (),
    rid: str | None = None,
) -> AdmitRequest:
    return AdmitRequest(
        reservation_key=reservation_key("acme", rid or f"r{next(_ids)}"),
        request_counters=requests,
        token_counters=counters,
        tokens=tokens,
        usage=UsageTags("p", "m", "", prompt),
    )


async def charges_by_bucket(c: Clocked, keys_: list[str], counter: Counter) -> dict[int, int]:
    """What every admitted request's record says it charged per bucket of ``counter``."""
    out: dict[int, int] = {}
    head = "k" + counter.key + ":"
    for key in keys_:
        if c.plain is not None:
            record = await c.plain.hgetall(key)
            fields = {f[1:]: int(v) for f, v in record.items() if f.startswith(head)}
        else:
            rec = c.backend._records.get(key)  # type: ignore[union-attr]
            fields = rec.charged if rec is not None else {}
            fields = {k: v for k, v in fields.items() if k.startswith(counter.key + ":")}
        for field, amount in fields.items():
            start = int(field.rsplit(":", 1)[1])
            out[start] = out.get(start, 0) + amount
    return out


# --- sliding windows -------------------------------------------------------------------


async def test_a_sliding_window_holds_a_burst_across_the_fixed_boundary(clocked: Clocked) -> None:
    tpm = sliding("tpm", 100, window_s=10)
    now = await clocked.now()
    # The last second of a fixed 10 s window, then the first of the next: a fixed window
    # would take 100 in each.
    await clocked.travel_to(now - now % 10 + 19)
    await clocked.room_in_second()
    charged_from = int(await clocked.now())
    assert (await clocked.backend.admit(admit(100, tpm))).admitted
    charged_to = int(await clocked.now())
    await clocked.shift(1)
    asked = await clocked.now()
    refused = await clocked.backend.admit(admit(1, tpm))
    answered = await clocked.now()
    assert not refused.admitted and refused.refused_by == "tpm"
    # The 100 leave with their bucket: 10 s (+ its own second) after it.
    retry_s = refused.states[0].retry_s
    assert retry_s is not None
    assert charged_from + 11 - answered <= retry_s <= charged_to + 11 - asked
    await clocked.shift(9)
    assert not (await clocked.backend.admit(admit(1, tpm))).admitted
    await clocked.shift(1)
    assert (await clocked.backend.admit(admit(100, tpm))).admitted


async def test_no_window_of_the_sliding_length_carries_more_than_the_limit(
    clocked: Clocked,
) -> None:
    """Random admissions over ~50 s of a 10 s window: every charge's bucket and the ten
    before it hold at most the limit, so any 10 s interval does (a charge in bucket b is at
    a time in [b, b+1), and (t-10, t] lies within buckets b-10..b)."""
    tpm = sliding("tpm", 100, window_s=10)
    rng = random.Random(13)
    admitted: list[str] = []
    for _ in range(120):
        await clocked.room_in_second()
        request = admit(rng.randint(1, 40), tpm)
        verdict = await clocked.backend.admit(request)
        if verdict.admitted:
            admitted.append(request.reservation_key)
        if rng.random() < 0.4:
            await clocked.shift(1)
    buckets = await charges_by_bucket(clocked, admitted, tpm)
    assert len(buckets) > 15  # the test moved through many buckets
    for start in buckets:
        assert sum(v for b, v in buckets.items() if start - 10 <= b <= start) <= 100
    # The limit was reached, not just approached: some 11 buckets hold more than 90.
    assert max(sum(v for b, v in buckets.items() if s - 10 <= b <= s) for s in buckets) > 90


async def test_a_sliding_refund_comes_back_while_its_bucket_is_in_the_window(
    clocked: Clocked,
) -> None:
    tpm = sliding("tpm", 100, window_s=10)
    await clocked.room_in_second()
    first = admit(80, tpm)
    assert (await clocked.backend.admit(first)).admitted
    await clocked.shift(3)
    assert not (await clocked.backend.admit(admit(50, tpm))).admitted
    settled = await clocked.backend.settle(first.reservation_key, (tpm,), 20)
    assert settled.refunded == 60
    assert (await clocked.backend.admit(admit(80, tpm))).admitted
    assert not (await clocked.backend.admit(admit(1, tpm))).admitted


async def test_a_sliding_lease_gets_what_is_left_and_leaves_with_its_bucket(
    clocked: Clocked,
) -> None:
    tpm = sliding("tpm", 100, window_s=10)
    await clocked.room_in_second()
    request = admit(60, tpm)
    assert (await clocked.backend.admit(request)).admitted
    await clocked.shift(5)
    grant = await clocked.backend.reserve(request.reservation_key, 1, (tpm,), 64)
    assert grant.granted == 40
    assert (await clocked.backend.reserve(request.reservation_key, 2, (tpm,), 8)).granted == 0
    await clocked.shift(6)  # the admission's 60 left; the lease's 40 are 6 s old
    assert (await clocked.backend.reserve(request.reservation_key, 3, (tpm,), 64)).granted == 60


# --- calendar budgets ------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["Europe/Berlin", "Pacific/Kiritimati"])
async def test_a_monthly_budget_resets_at_the_month_boundary_of_its_zone(
    clocked: Clocked, zone: str
) -> None:
    budget = monthly(1000, zone)
    boundary = int(datetime(2027, 2, 1, tzinfo=ZoneInfo(zone)).timestamp())
    await clocked.travel_to(boundary - 10)
    await clocked.room_in_second()
    assert (await clocked.backend.admit(admit(1000, budget))).admitted
    asked_s = await clocked.now()
    refused = await clocked.backend.admit(admit(1, budget))
    answered_s = await clocked.now()
    assert not refused.admitted and refused.refused_by == "monthly"
    assert boundary - answered_s <= refused.states[0].reset_s <= boundary - asked_s
    await clocked.shift(11)
    before_s = await clocked.now()
    after = await clocked.backend.admit(admit(400, budget))
    after_s = await clocked.now()
    assert after.admitted and after.states[0].remaining == 600
    # February in that zone: 28 days to its end.
    start, end = calendar_bounds("month", zone, boundary + 1)
    assert (start, end - start) == (boundary, 28 * 86400)
    assert end - after_s <= after.states[0].reset_s <= end - before_s


async def test_a_monthly_refund_after_the_boundary_is_not_given_to_the_new_month(
    clocked: Clocked,
) -> None:
    budget = monthly(1000, "UTC")
    boundary = int(datetime(2027, 3, 1, tzinfo=ZoneInfo("UTC")).timestamp())
    await clocked.travel_to(boundary - 5)
    await clocked.room_in_second()
    request = admit(900, budget)
    assert (await clocked.backend.admit(request)).admitted
    await clocked.shift(10)
    settled = await clocked.backend.settle(request.reservation_key, (budget,), 100)
    assert settled.refunded == 0  # February kept its 900; March starts empty
    assert (await clocked.backend.admit(admit(1000, budget))).admitted


# --- input / output / cost weights ------------------------------------------------------


async def test_input_output_and_cost_counters_charge_their_own_side(clocked: Clocked) -> None:
    itpm = fixed("itpm", 10_000, weights=(1, 0, 1))
    otpm = fixed("otpm", 10_000, weights=(0, 1, 0))
    cost = fixed("cost", 10**9, weights=(2500, 10_000, 1250))  # $2.50 / $10 / $1.25 per M
    counters = (itpm, otpm, cost)
    await clocked.room_in_second()
    request = admit(132, *counters, prompt=100)  # 100 prompt + 32 output reserved
    verdict = await clocked.backend.admit(request)
    assert [s.remaining for s in verdict.states] == [
        10_000 - 100,
        10_000 - 32,
        10**9 - (100 * 2500 + 32 * 10_000),
    ]
    grant = await clocked.backend.reserve(request.reservation_key, 1, counters, 32)
    assert grant.granted == 32
    assert [s.remaining for s in grant.states] == [
        9_900,
        10_000 - 64,
        10**9 - (100 * 2500 + 64 * 10_000),
    ]
    # Used: 100 prompt of which 40 cached, 50 output (14 of the 64 leased come back).
    settled = await clocked.backend.settle(
        request.reservation_key, counters, 150, output_tokens=50, cached_tokens=40
    )
    assert settled.refunded_per_counter == (0, 14, 40 * (2500 - 1250) + 14 * 10_000)
    ledger = await _ledger(clocked, request.reservation_key)
    nets = {w.split(":")[0]: int(w.split(":")[3]) for w in ledger[-1]["windows"].split(";")}
    assert nets == {"itpm": 100, "otpm": 50, "cost": 60 * 2500 + 40 * 1250 + 50 * 10_000}


async def test_a_cost_lease_is_cut_at_the_exact_nano_unit(clocked: Clocked) -> None:
    # Budget: 1,000,003 nano; prompt 100 × 2,500 = 250,000; output 10,000 per token.
    cost = fixed("cost", 1_000_003, weights=(2500, 10_000, 2500))
    await clocked.room_in_second()
    request = admit(100, cost, prompt=100)
    assert (await clocked.backend.admit(request)).admitted
    grants = [
        (await clocked.backend.reserve(request.reservation_key, seq, (cost,), 32)).granted
        for seq in range(1, 5)
    ]
    # (1,000,003 − 250,000) // 10,000 = 75 tokens, 3 nano-units left over.
    assert grants == [32, 32, 11, 0]
    settled = await clocked.backend.settle(request.reservation_key, (cost,), 175, output_tokens=75)
    assert settled.refunded == 0
    assert (await clocked.backend.admit(admit(1, cost, prompt=1))).admitted is False


# --- shadow -----------------------------------------------------------------------------


async def test_a_shadow_counter_counts_and_reports_but_refuses_and_cuts_nothing(
    clocked: Clocked,
) -> None:
    enforced = fixed("tenant_tpm", 10_000)
    shadow = fixed("tpm", 50, shadow=True)
    rpm = fixed("rpm", 1, shadow=True)
    await clocked.room_in_second()
    request = admit(80, shadow, enforced, requests=(rpm,))
    verdict = await clocked.backend.admit(request)
    assert verdict.admitted and verdict.shadow_refused_by == ("tpm",)
    second = await clocked.backend.admit(admit(1, shadow, enforced, requests=(rpm,)))
    assert second.admitted and set(second.shadow_refused_by) == {"rpm", "tpm"}
    grant = await clocked.backend.reserve(request.reservation_key, 1, (shadow, enforced), 32)
    assert grant.granted == 32 and grant.shadow_cut_by == ("tpm",)
    assert [s.remaining for s in grant.states] == [0, 10_000 - 113]


async def _ledger(c: Clocked, rkey: str) -> list[dict[str, str]]:
    stream = usage_stream_key(rkey)
    if c.plain is not None:
        return [fields for _, fields in await c.plain.xrange(stream)]
    return [fields for _, fields in c.backend.ledger_entries(stream)]  # type: ignore[union-attr]


async def test_the_ledger_nets_of_sliding_and_calendar_counters_equal_what_they_hold(
    clocked: Clocked,
) -> None:
    tpm = sliding("tpm", 10**6, window_s=10)
    budget = monthly(10**6, "Europe/Berlin")
    rng = random.Random(5)
    keys_ = []
    await clocked.room_in_second(0.9)
    for i in range(6):
        request = admit(100, tpm, budget, prompt=40)
        assert (await clocked.backend.admit(request)).admitted
        keys_.append(request.reservation_key)
        await clocked.backend.reserve(request.reservation_key, 1, (tpm, budget), 50)
        await clocked.backend.settle(request.reservation_key, (tpm, budget), rng.randint(40, 150))
        if i % 2:
            await clocked.shift(1)
    entries = await _ledger(clocked, keys_[0])
    nets: dict[str, int] = {}
    for entry in entries:
        for w in entry["windows"].split(";"):
            kind, _, _, net = w.split(":")
            nets[kind] = nets.get(kind, 0) + int(net)
    probe = await clocked.backend.admit(admit(0, tpm, budget))
    held = {s.kind: s.limit - s.remaining for s in probe.states}
    assert nets == held


async def test_a_long_sliding_window_forgets_exactly_what_left_it_after_idle_spells(
    clocked: Clocked,
) -> None:
    """An hour in 1 s buckets: a counter idle for most of it drops what left (the script
    then walks the few fields present, not the thousands of buckets), and one idle for
    longer than the window starts from zero."""
    tph = sliding("tpm", 1000, window_s=3600)
    await clocked.room_in_second()
    assert (await clocked.backend.admit(admit(600, tph))).admitted
    await clocked.shift(3000)
    assert (await clocked.backend.admit(admit(300, tph))).admitted
    assert not (await clocked.backend.admit(admit(200, tph))).admitted
    await clocked.shift(601)  # the 600 left; the 300 are 601 s old
    verdict = await clocked.backend.admit(admit(700, tph))
    assert verdict.admitted and verdict.states[0].remaining == 0
    await clocked.shift(3602)
    after = await clocked.backend.admit(admit(1000, tph))
    assert after.admitted and after.states[0].remaining == 0
