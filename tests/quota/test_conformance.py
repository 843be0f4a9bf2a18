"""One suite, both backends: the semantics stated in extproc/quota/base.py."""

from __future__ import annotations

import asyncio
import itertools
from typing import Protocol, cast

import pytest

from extproc.quota.base import AdmitRequest, Counter, CounterKind, Settlement
from extproc.quota.keys import counter_key, open_set_key, reservation_key, usage_stream_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from tests.quota.conftest import Harness

HOUR = 3600
DAY = 86400
_ids = itertools.count()


def counter(
    kind: CounterKind,
    limit: int,
    window_s: int = HOUR,
    tenant: str = "acme",
    model: str | None = "gpt-4.1",
) -> Counter:
    return Counter(kind, counter_key(tenant, kind, model, window_s), limit, window_s)


def admit_request(
    rpm: Counter | None,
    token_counters: tuple[Counter, ...],
    tokens: int,
    count_refused_attempts: bool = True,
    request_id: str | None = None,
    tenant: str = "acme",
) -> AdmitRequest:
    return AdmitRequest(
        reservation_key=reservation_key(tenant, request_id or f"req-{next(_ids)}"),
        request_counters=(rpm,) if rpm is not None else (),
        token_counters=token_counters,
        tokens=tokens,
        count_refused_attempts=count_refused_attempts,
    )


async def test_admission_charges_one_request_and_the_reserved_tokens_on_every_counter(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    tenant_tpm = counter("tenant_tpm", 5000, model=None)
    daily = counter("daily", 100_000, DAY)
    verdict = await harness.backend.admit(admit_request(rpm, (tpm, tenant_tpm, daily), 300))

    assert verdict.admitted and verdict.refused_by is None and not verdict.replayed
    assert [s.kind for s in verdict.states] == ["rpm", "tpm", "tenant_tpm", "daily"]
    assert [s.remaining for s in verdict.states] == [9, 700, 4700, 99_700]
    assert [await harness.total(c) for c in (rpm, tpm, tenant_tpm, daily)] == [1, 300, 300, 300]


async def test_refusal_by_one_token_counter_charges_tokens_on_none(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    tenant_tpm = counter("tenant_tpm", 200, model=None)
    daily = counter("daily", 100_000, DAY)
    verdict = await harness.backend.admit(admit_request(rpm, (tpm, tenant_tpm, daily), 300))

    assert not verdict.admitted and verdict.refused_by == "tenant_tpm"
    assert await harness.total(tpm) == 0
    assert await harness.total(tenant_tpm) == 0
    assert await harness.total(daily) == 0
    assert await harness.total(rpm) == 1  # the attempt still counts (default mode)


async def test_rpm_counts_refused_attempts_by_default(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 3), counter("tpm", 100)
    verdicts = [await harness.backend.admit(admit_request(rpm, (tpm,), 60)) for _ in range(5)]

    # 1st fits; 2nd and 3rd are refused by TPM but still use up attempts; RPM then refuses.
    assert [v.refused_by for v in verdicts] == [None, "tpm", "tpm", "rpm", "rpm"]
    assert await harness.total(rpm) == 5
    assert await harness.total(tpm) == 60
    assert verdicts[-1].states[0].remaining == 0  # clamped, never negative


async def test_admitted_only_mode_charges_nothing_for_a_refusal(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 3), counter("tpm", 100)
    verdicts = [
        await harness.backend.admit(admit_request(rpm, (tpm,), 60, count_refused_attempts=False))
        for _ in range(3)
    ]
    assert [v.refused_by for v in verdicts] == [None, "tpm", "tpm"]
    assert await harness.total(rpm) == 1
    assert await harness.total(tpm) == 60
    # RPM still has room for two small requests: the refused ones left no trace.
    small = [
        await harness.backend.admit(admit_request(rpm, (tpm,), 1, count_refused_attempts=False))
        for _ in range(3)
    ]
    assert [v.refused_by for v in small] == [None, None, "rpm"]
    assert await harness.total(rpm) == 3


async def test_tpm_admits_a_reservation_that_exactly_fits_and_refuses_one_more_token(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    first = await harness.backend.admit(admit_request(None, (tpm,), 700))
    exact = await harness.backend.admit(admit_request(None, (tpm,), 300))
    over = await harness.backend.admit(admit_request(None, (tpm,), 1))
    too_big = await harness.backend.admit(admit_request(None, (counter("tpm", 10, 60),), 11))

    assert first.admitted and exact.admitted
    assert exact.states[0].remaining == 0
    assert not over.admitted and over.refused_by == "tpm"
    assert not too_big.admitted and too_big.refused_by == "tpm"
    assert await harness.total(tpm) == 1000


async def test_daily_budget_refuses_once_spent_and_resets_at_utc_midnight(
    harness: Harness,
) -> None:
    await harness.ensure_room(DAY, 5)
    daily = counter("daily", 500, DAY)
    tpm = counter("tpm", 10_000, 60)
    ok = await harness.backend.admit(admit_request(None, (tpm, daily), 400))
    refused = await harness.backend.admit(admit_request(None, (tpm, daily), 200))
    now = await harness.now()

    assert ok.admitted
    assert refused.refused_by == "daily"
    assert refused.states[1].remaining == 100
    assert refused.states[1].reset_s == pytest.approx(DAY - now % DAY, abs=2)
    assert await harness.total(daily) == 400


async def test_states_report_remaining_and_seconds_to_window_end(harness: Harness) -> None:
    await harness.ensure_room(60, 5)
    tpm = counter("tpm", 1000, 60)
    before = await harness.now()
    verdict = await harness.backend.admit(admit_request(counter("rpm", 5, 60), (tpm,), 250))
    after = await harness.now()

    rpm_state, tpm_state = verdict.states
    assert (rpm_state.limit, rpm_state.remaining) == (5, 4)
    assert (tpm_state.limit, tpm_state.remaining) == (1000, 750)
    # Seconds left in the minute as seen by the backend's clock (either edge of the call).
    assert 60 - after % 60 - 0.01 <= tpm_state.reset_s <= 60 - before % 60 + 0.01
    assert rpm_state.reset_s == pytest.approx(tpm_state.reset_s, abs=1e-6)


async def test_replayed_admission_returns_first_verdict_and_charges_nothing(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    request = admit_request(rpm, (tpm,), 400, request_id="same-id")
    first = await harness.backend.admit(request)
    replays = [await harness.backend.admit(request) for _ in range(3)]

    assert first.admitted and not first.replayed
    assert all(r.admitted and r.replayed for r in replays)
    assert all(
        [s.remaining for s in r.states] == [s.remaining for s in first.states] for r in replays
    )
    assert await harness.total(rpm) == 1
    assert await harness.total(tpm) == 400


async def test_replay_of_a_refusal_stays_refused_after_capacity_frees_up(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    holder = admit_request(None, (tpm,), 900)
    await harness.backend.admit(holder)
    refused = admit_request(counter("rpm", 10), (tpm,), 500, request_id="refused-once")
    assert (await harness.backend.admit(refused)).refused_by == "tpm"

    await harness.backend.settle(holder.reservation_key, (tpm,), used=0)  # frees 900
    replay = await harness.backend.admit(refused)

    assert replay.replayed and not replay.admitted and replay.refused_by == "tpm"
    assert await harness.total(tpm) == 0
    assert await harness.total(counter("rpm", 10)) == 1


async def test_reserve_is_idempotent_on_sequence_number(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    request = admit_request(None, (tpm,), 100)
    await harness.backend.admit(request)
    key = request.reservation_key

    first = await harness.backend.reserve(key, 1, (tpm,), 32)
    again = await harness.backend.reserve(key, 1, (tpm,), 32)
    second = await harness.backend.reserve(key, 2, (tpm,), 32)

    assert (first.granted, first.replayed) == (32, False)
    assert (again.granted, again.replayed) == (32, True)
    assert (second.granted, second.replayed) == (32, False)
    assert second.states[0].remaining == 1000 - 164
    assert await harness.total(tpm) == 164


async def test_reserve_grants_what_is_left_when_at_least_the_minimum(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm, daily = counter("tpm", 1000), counter("daily", 120, DAY)
    request = admit_request(None, (tpm, daily), 100)
    await harness.backend.admit(request)
    key = request.reservation_key

    below_minimum = await harness.backend.reserve(key, 1, (tpm, daily), 32, minimum=21)
    partial = await harness.backend.reserve(key, 1, (tpm, daily), 32, minimum=20)
    exhausted = await harness.backend.reserve(key, 2, (tpm, daily), 32)

    assert below_minimum.granted == 0 and not below_minimum.replayed
    assert partial.granted == 20  # the smallest room over the counters (daily)
    assert [s.remaining for s in partial.states] == [880, 0]
    assert exhausted.granted == 0
    assert (await harness.total(tpm), await harness.total(daily)) == (120, 120)


async def test_reserve_grants_nothing_to_refused_unknown_or_settled_requests(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    refused = admit_request(None, (tpm,), 5000)
    await harness.backend.admit(refused)
    settled = admit_request(None, (tpm,), 100)
    await harness.backend.admit(settled)
    await harness.backend.settle(settled.reservation_key, (tpm,), used=100)

    for key in (refused.reservation_key, settled.reservation_key, reservation_key("acme", "x")):
        assert (await harness.backend.reserve(key, 1, (tpm,), 32)).granted == 0
    assert await harness.total(tpm) == 100


async def test_concurrent_streams_use_the_whole_budget_without_exceeding_it(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 10)
    tpm = counter("tpm", 1000)
    requests = [admit_request(None, (tpm,), 10) for _ in range(30)]
    for r in requests:
        assert (await harness.backend.admit(r)).admitted

    async def stream(key: str) -> int:
        got = 0
        for seq in itertools.count(1):
            grant = await harness.backend.reserve(key, seq, (tpm,), 32)
            if grant.granted == 0:
                return got
            got += grant.granted

    leased = await asyncio.gather(*(stream(r.reservation_key) for r in requests))
    assert sum(leased) == 1000 - 300  # partial grants hand out the last tokens too
    assert await harness.total(tpm) == 1000


async def test_settle_commits_used_refunds_the_rest_exactly_once(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm, tenant_tpm = counter("tpm", 1000), counter("tenant_tpm", 5000, model=None)
    request = admit_request(counter("rpm", 10), (tpm, tenant_tpm), 100)
    await harness.backend.admit(request)
    await harness.backend.reserve(request.reservation_key, 1, (tpm, tenant_tpm), 32)

    first = await harness.backend.settle(request.reservation_key, (tpm, tenant_tpm), used=50)
    second = await harness.backend.settle(request.reservation_key, (tpm, tenant_tpm), used=10)

    assert (first.reserved, first.used, first.refunded) == (132, 50, 82)
    assert first.refunded_per_counter == (82, 82) and not first.already_settled
    assert second.already_settled
    assert (second.reserved, second.used, second.refunded) == (132, 50, 82)
    assert (await harness.total(tpm), await harness.total(tenant_tpm)) == (50, 50)
    assert await harness.total(counter("rpm", 10)) == 1  # the request itself is never refunded


async def test_settle_charges_use_beyond_the_reservation(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    request = admit_request(None, (tpm,), 100)
    await harness.backend.admit(request)

    settlement = await harness.backend.settle(request.reservation_key, (tpm,), used=130)

    assert (settlement.reserved, settlement.used, settlement.refunded) == (100, 130, 0)
    assert await harness.total(tpm) == 130


async def test_settling_a_refused_or_unknown_request_charges_nothing(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 100)
    refused = admit_request(None, (tpm,), 500)
    await harness.backend.admit(refused)

    for key in (refused.reservation_key, reservation_key("acme", "never-admitted")):
        settlement = await harness.backend.settle(key, (tpm,), used=40)
        assert (settlement.reserved, settlement.refunded) == (0, 0)
    assert await harness.total(tpm) == 0


async def test_refund_after_a_window_boundary_comes_off_live_windows_only(
    harness: Harness,
) -> None:
    window = 2
    tpm, daily = counter("tpm", 1000, window), counter("daily", 100_000, DAY)
    await harness.ensure_room(DAY, 10)
    w1 = await harness.advance_to_next_window(window)
    request = admit_request(None, (tpm, daily), 100)
    await harness.backend.admit(request)
    w2 = await harness.advance_to_next_window(window)
    grant = await harness.backend.reserve(request.reservation_key, 1, (tpm, daily), 50)
    assert grant.granted == 50

    settlement = await harness.backend.settle(request.reservation_key, (tpm, daily), used=40)

    # 110 go back newest first: W2's 50 are refunded; W1 has ended and keeps its 100.
    assert settlement.reserved == 150
    assert settlement.refunded_per_counter == (50, 110)
    assert settlement.refunded == 50
    assert await harness.windows(tpm) == {w1: 100, w2: 0}
    assert await harness.total(daily) == 40


async def test_overage_after_a_window_boundary_is_charged_to_the_current_window(
    harness: Harness,
) -> None:
    window = 2
    tpm, daily = counter("tpm", 1000, window), counter("daily", 100_000, DAY)
    await harness.ensure_room(DAY, 10)
    w1 = await harness.advance_to_next_window(window)
    request = admit_request(None, (tpm, daily), 100)
    await harness.backend.admit(request)
    w2 = await harness.advance_to_next_window(window)

    settlement = await harness.backend.settle(request.reservation_key, (tpm, daily), used=130)

    assert settlement.refunded_per_counter == (0, 0)
    assert await harness.windows(tpm) == {w1: 100, w2: 30}
    assert await harness.total(daily) == 130


@pytest.mark.parametrize("count_refused_attempts", [True, False])
async def test_200_concurrent_admissions_against_rpm_50_admit_exactly_50(
    harness: Harness, count_refused_attempts: bool
) -> None:
    await harness.ensure_room(HOUR, 10)
    rpm, tpm = counter("rpm", 50), counter("tpm", 1_000_000)
    verdicts = await asyncio.gather(
        *(
            harness.backend.admit(
                admit_request(rpm, (tpm,), 10, count_refused_attempts=count_refused_attempts)
            )
            for _ in range(200)
        )
    )
    assert sum(v.admitted for v in verdicts) == 50
    assert {v.refused_by for v in verdicts if not v.admitted} == {"rpm"}
    assert await harness.total(rpm) == (200 if count_refused_attempts else 50)
    assert await harness.total(tpm) == 500


async def test_tenants_and_models_have_separate_counters(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    a = counter("tpm", 100, tenant="a:b", model="c")
    b = counter("tpm", 100, tenant="a", model="b:c")
    assert (await harness.backend.admit(admit_request(None, (a,), 100, tenant="a:b"))).admitted
    assert (await harness.backend.admit(admit_request(None, (b,), 100, tenant="a"))).admitted
    assert (await harness.total(a), await harness.total(b)) == (100, 100)


async def test_bad_amounts_are_rejected_before_touching_counters(harness: Harness) -> None:
    tpm = counter("tpm", 100)
    with pytest.raises(ValueError, match="tokens"):
        await harness.backend.admit(admit_request(None, (tpm,), -1))
    with pytest.raises(ValueError, match="minimum"):
        await harness.backend.reserve(reservation_key("acme", "r"), 1, (tpm,), 10, minimum=11)
    with pytest.raises(ValueError, match="used"):
        await harness.backend.settle(reservation_key("acme", "r"), (tpm,), used=-5)
    assert await harness.total(tpm) == 0


async def test_concurrent_replays_of_one_request_id_charge_once(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 10_000)
    request = admit_request(rpm, (tpm,), 250, request_id="retried")
    verdicts = await asyncio.gather(*(harness.backend.admit(request) for _ in range(20)))

    assert all(v.admitted for v in verdicts)
    assert sum(not v.replayed for v in verdicts) == 1
    assert (await harness.total(rpm), await harness.total(tpm)) == (1, 250)


async def test_concurrent_settlements_of_one_request_apply_once(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    request = admit_request(None, (tpm,), 500)
    await harness.backend.admit(request)
    results = await asyncio.gather(
        *(harness.backend.settle(request.reservation_key, (tpm,), used=u) for u in range(10, 20))
    )

    first = [r for r in results if not r.already_settled]
    assert len(first) == 1
    assert all(r.used == first[0].used for r in results)
    assert await harness.total(tpm) == first[0].used


async def test_cancel_refunds_the_whole_reservation_and_keeps_the_attempt(
    harness: Harness,
) -> None:
    await harness.ensure_room(DAY, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    daily = counter("daily", 100_000, DAY)
    request = admit_request(rpm, (tpm, daily), 100)
    assert (await harness.backend.admit(request)).admitted
    await harness.backend.reserve(request.reservation_key, 1, (tpm, daily), 32)

    cancelled = await harness.backend.cancel(request.reservation_key, (tpm, daily))

    assert (cancelled.reserved, cancelled.used, cancelled.refunded) == (132, 0, 132)
    assert cancelled.refunded_per_counter == (132, 132) and not cancelled.already_settled
    assert (await harness.total(tpm), await harness.total(daily)) == (0, 0)
    assert await harness.total(rpm) == 1  # the attempt stays counted


async def test_cancel_before_admission_makes_a_late_admission_charge_nothing(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    request = admit_request(rpm, (tpm,), 100, request_id="lost-reply")

    tombstone = await harness.backend.cancel(request.reservation_key, (tpm,))
    late = await harness.backend.admit(request)
    replay = await harness.backend.admit(request)

    assert (tombstone.reserved, tombstone.used, tombstone.refunded) == (0, 0, 0)
    assert tombstone.refunded_per_counter == (0,) and not tombstone.already_settled
    assert late.cancelled and not late.admitted and not late.replayed
    assert late.refused_by is None and late.states == ()
    assert replay.cancelled and not replay.admitted
    # Not even the attempt counts, although refused attempts count in this mode.
    assert (await harness.total(rpm), await harness.total(tpm)) == (0, 0)
    assert (await harness.backend.reserve(request.reservation_key, 1, (tpm,), 32)).granted == 0
    settle = await harness.backend.settle(request.reservation_key, (tpm,), used=50)
    assert settle.already_settled and (settle.reserved, settle.used) == (0, 0)
    assert await harness.total(tpm) == 0


async def test_cancel_twice_is_idempotent(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    admitted = admit_request(counter("rpm", 10), (tpm,), 100)
    await harness.backend.admit(admitted)
    unknown = admit_request(None, (tpm,), 100)

    for request, reserved in ((admitted, 100), (unknown, 0)):
        first = await harness.backend.cancel(request.reservation_key, (tpm,))
        second = await harness.backend.cancel(request.reservation_key, (tpm,))
        assert not first.already_settled and second.already_settled
        assert (first.reserved, first.refunded) == (reserved, reserved)
        assert (second.reserved, second.used, second.refunded) == (reserved, 0, reserved)
        assert second.refunded_per_counter == first.refunded_per_counter
    assert await harness.total(tpm) == 0
    assert await harness.total(counter("rpm", 10)) == 1


async def test_settle_and_reserve_after_cancel_do_nothing(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    request = admit_request(None, (tpm,), 100)
    first = await harness.backend.admit(request)
    await harness.backend.cancel(request.reservation_key, (tpm,))

    settle = await harness.backend.settle(request.reservation_key, (tpm,), used=150)
    grant = await harness.backend.reserve(request.reservation_key, 1, (tpm,), 32)
    replay = await harness.backend.admit(request)

    assert settle.already_settled and (settle.reserved, settle.used, settle.refunded) == (
        100,
        0,
        100,
    )
    assert grant.granted == 0
    # A replay says the admission ran and was cancelled, with its first states.
    assert replay.replayed and replay.cancelled and not replay.admitted
    assert [s.remaining for s in replay.states] == [s.remaining for s in first.states]
    assert await harness.total(tpm) == 0


async def test_cancel_after_settle_changes_nothing(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 1000)
    request = admit_request(None, (tpm,), 100)
    await harness.backend.admit(request)
    settled = await harness.backend.settle(request.reservation_key, (tpm,), used=60)

    cancel = await harness.backend.cancel(request.reservation_key, (tpm,))

    assert cancel.already_settled
    assert (cancel.reserved, cancel.used, cancel.refunded) == (100, 60, settled.refunded)
    assert await harness.total(tpm) == 60
    replay = await harness.backend.admit(request)
    assert replay.admitted and replay.replayed and not replay.cancelled


async def test_cancel_of_a_refused_admission_keeps_the_attempt_and_charges_nothing(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 100)
    request = admit_request(rpm, (tpm,), 500)
    assert (await harness.backend.admit(request)).refused_by == "tpm"

    cancel = await harness.backend.cancel(request.reservation_key, (tpm,))
    again = await harness.backend.cancel(request.reservation_key, (tpm,))
    replay = await harness.backend.admit(request)

    assert (cancel.reserved, cancel.refunded, cancel.already_settled) == (0, 0, False)
    assert again.already_settled
    assert replay.cancelled and replay.replayed and not replay.admitted
    assert (await harness.total(rpm), await harness.total(tpm)) == (1, 0)


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_admission_racing_its_cancel_leaves_no_tokens_charged(
    harness: Harness, cancel_first: bool
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    request = admit_request(rpm, (tpm,), 300)
    admit = harness.backend.admit(request)
    cancel = harness.backend.cancel(request.reservation_key, (tpm,))

    if cancel_first:
        settlement, verdict = await asyncio.gather(cancel, admit)
    else:
        verdict, settlement = await asyncio.gather(admit, cancel)

    # On Redis the two calls race over separate connections: either order must end with
    # no tokens charged, and the attempt counted only if the admission ran first.
    ran_first = verdict.admitted
    assert verdict.cancelled != ran_first and not verdict.replayed
    assert settlement.reserved == (300 if ran_first else 0) and not settlement.already_settled
    assert await harness.total(tpm) == 0
    assert await harness.total(rpm) == (1 if ran_first else 0)
    if isinstance(harness.backend, MemoryQuotaBackend):
        assert ran_first != cancel_first  # one event loop: gather order is call order


async def test_bad_tombstone_ttl_is_rejected(harness: Harness) -> None:
    with pytest.raises(ValueError, match="tombstone_ttl_s"):
        await harness.backend.cancel(
            reservation_key("acme", "r"), (counter("tpm", 100),), tombstone_ttl_s=0
        )


async def test_a_refused_lease_says_how_many_other_requests_of_the_tenant_are_open(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tenant = f"open-{next(_ids)}"
    tpm = counter("tpm", 100, tenant=tenant)
    first, second, third = (admit_request(None, (tpm,), 30, tenant=tenant) for _ in range(3))
    for request in (first, second, third):
        assert (await harness.backend.admit(request)).admitted
    refused = await harness.backend.reserve(first.reservation_key, 1, (tpm,), 50, minimum=50)
    assert refused.granted == 0 and refused.others_open == 2

    await harness.backend.settle(second.reservation_key, (tpm,), used=30)
    await harness.backend.cancel(third.reservation_key, (tpm,))
    alone = await harness.backend.reserve(first.reservation_key, 1, (tpm,), 80, minimum=80)
    assert alone.granted == 0 and alone.others_open == 0  # nobody's lease can come back
    granted = await harness.backend.reserve(first.reservation_key, 1, (tpm,), 40)
    assert granted.granted == 40 and granted.others_open == 0


# -- open sets and orphans: what a peer needs when a processor dies -------------------------


class SettlesOrphans(Protocol):
    owner_id: str

    async def settle_orphan(
        self, reservation_key: str, owner_id: str
    ) -> tuple[str, Settlement | None]: ...


def peer(harness: Harness) -> SettlesOrphans:
    """The backend as a peer of the processor that admitted: both backends settle orphans."""
    assert hasattr(harness.backend, "settle_orphan")
    return cast(SettlesOrphans, harness.backend)


def _owner(harness: Harness) -> str:
    return peer(harness).owner_id


async def test_an_admitted_record_is_in_its_owners_open_set_from_admission_to_settlement(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 1000)
    streamed, refused = admit_request(rpm, (tpm,), 100), admit_request(rpm, (tpm,), 5000)
    rpm_only, tombstoned = admit_request(rpm, (), 0), admit_request(rpm, (tpm,), 10)
    open_set = open_set_key(streamed.reservation_key, _owner(harness))
    assert open_set == open_set_key(refused.reservation_key, _owner(harness))  # one per tenant
    for request in (streamed, refused, rpm_only):
        await harness.backend.admit(request)
    assert (await harness.backend.admit(streamed)).replayed
    await harness.backend.cancel(tombstoned.reservation_key, (tpm,))
    assert (await harness.backend.admit(tombstoned)).cancelled
    # Admitted ones only (RPM-only too: it gets a ledger entry), from the admission on.
    assert await harness.open_set(open_set) == {streamed.reservation_key, rpm_only.reservation_key}

    await harness.backend.settle(streamed.reservation_key, (tpm,), 40)
    assert await harness.open_set(open_set) == {rpm_only.reservation_key}
    await harness.backend.cancel(rpm_only.reservation_key, ())
    assert await harness.open_set(open_set) == set()


async def test_an_orphan_is_settled_once_at_what_it_reserved_and_leaves_the_open_set(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    owner = _owner(harness)
    dead = admit_request(None, (tpm,), 100)
    await harness.backend.admit(dead)
    assert (await harness.backend.reserve(dead.reservation_key, 1, (tpm,), 32)).granted == 32
    open_set = open_set_key(dead.reservation_key, owner)

    assert (await peer(harness).settle_orphan(dead.reservation_key, "someone-else"))[0] == (
        "not_owned"
    )
    assert await harness.open_set(open_set) == {dead.reservation_key}  # not its owner's
    status, first = await peer(harness).settle_orphan(dead.reservation_key, owner)
    assert status == "settled" and first is not None
    assert (first.reserved, first.used, first.refunded) == (132, 132, 0)  # billed as charged
    assert await harness.open_set(open_set) == set()
    assert await harness.total(tpm) == 132
    again, replay = await peer(harness).settle_orphan(dead.reservation_key, owner)
    assert again == "already_settled" and replay is not None and replay.used == 132
    late = await harness.backend.settle(dead.reservation_key, (tpm,), 10)  # the owner, late
    assert late.already_settled and late.used == 132
    assert (await harness.backend.reserve(dead.reservation_key, 2, (tpm,), 32)).granted == 0
    assert await harness.total(tpm) == 132
    [(_, entry)] = await harness.ledger(usage_stream_key(dead.reservation_key))
    assert (entry["reason"], entry["reserved"], entry["used"], entry["refunded"]) == (
        "orphaned", "132", "132", "0",
    )  # fmt: skip
    assert entry["windows"] == f"tpm:{HOUR}:{next(iter(await harness.windows(tpm)))}:132"
    missing = admit_request(None, (tpm,), 1).reservation_key
    assert (await peer(harness).settle_orphan(missing, owner))[0] == "no_record"


async def test_an_owner_and_a_peer_settling_one_record_at_once_settle_it_once(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 10)
    tpm = counter("tpm", 1_000_000)
    owner = _owner(harness)
    requests = [admit_request(None, (tpm,), 100) for _ in range(20)]
    for request in requests:
        await harness.backend.admit(request)
    outcomes = await asyncio.gather(
        *(
            call
            for i, r in enumerate(requests)
            for call in (
                harness.backend.settle(r.reservation_key, (tpm,), 30),
                peer(harness).settle_orphan(r.reservation_key, owner),
            )[:: 1 if i % 2 else -1]  # either one first
        )
    )
    assert len(outcomes) == 40
    entries = await harness.ledger(usage_stream_key(requests[0].reservation_key))
    assert sorted(e["request_id"] for _, e in entries) == sorted(
        r.reservation_key.rpartition(":r:")[2] for r in requests
    )
    # The counter holds exactly what the ledger says each one kept, whoever settled it.
    kept = sum(int(e["windows"].rpartition(":")[2]) for _, e in entries)
    assert await harness.total(tpm) == kept
    assert await harness.open_set(open_set_key(requests[0].reservation_key, owner)) == set()
