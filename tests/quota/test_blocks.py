"""Admission blocks on both backends (base.py): take_block, admit_from_block, return_block.

The books must balance as for requests: every window's counter equals the sum of the nets
the usage ledger gives it, once everything (requests and blocks) is settled.
"""

from __future__ import annotations

import itertools
from collections import Counter as Tally

import pytest

from extproc.quota.base import AdmitRequest, Counter, CounterKind, UsageTags
from extproc.quota.keys import (
    block_key,
    counter_key,
    is_block_key,
    open_set_key,
    reservation_key,
    reservation_names,
    usage_stream_key,
)
from extproc.quota.redis.slots import key_slot
from tests.quota.conftest import Harness
from tests.quota.test_conformance import DAY, HOUR, peer

_ids = itertools.count()
_blocks = itertools.count()


def counter(
    kind: CounterKind,
    limit: int,
    window_s: int = HOUR,
    weights: tuple[int, int, int] = (1, 1, 1),
    shape: str = "fixed",
    bucket_s: int = 1,
) -> Counter:
    model = None if kind.startswith("tenant") else "m"
    span = f"sl{window_s}.{bucket_s}" if shape == "sliding" else None
    return Counter(
        kind,
        counter_key("acme", kind, model, window_s, span=span),
        limit,
        window_s,
        weights=weights,
        shape=shape,  # type: ignore[arg-type]
        bucket_s=bucket_s,
    )


def request(
    rpm: tuple[Counter, ...], tokens_counters: tuple[Counter, ...], tokens: int, prompt: int = 0
) -> AdmitRequest:
    return AdmitRequest(
        reservation_key=reservation_key("acme", f"req-{next(_ids)}"),
        request_counters=rpm,
        token_counters=tokens_counters,
        tokens=tokens,
        usage=UsageTags("pro", "m", "", prompt),
    )


def block_request(
    harness: Harness, rpm: tuple[Counter, ...], tokens_counters: tuple[Counter, ...], tokens: int
) -> AdmitRequest:
    key = block_key("acme", peer(harness).owner_id, next(_blocks))
    return AdmitRequest(key, rpm, tokens_counters, tokens, usage=UsageTags("pro", "m", "", 0))


async def ledger_nets(harness: Harness) -> Tally[tuple[str, str, str]]:
    """Σ net per (kind, span, window start) over the tenant's ledger."""
    nets: Tally[tuple[str, str, str]] = Tally()
    stream = usage_stream_key(reservation_key("acme", "x"))
    for _, entry in await harness.ledger(stream):
        for part in filter(None, entry["windows"].split(";")):
            kind, span, start, net = part.split(":")
            nets[(kind, span, start)] += int(net)
    return nets


async def assert_books_balance(harness: Harness, *counters: Counter) -> None:
    nets = await ledger_nets(harness)
    for c in counters:
        span = c.key.rpartition(":")[2]
        for start, value in (await harness.windows(c)).items():
            assert nets[(c.kind, span, str(start))] == value, (c.kind, start)


def reasons(entries: list[tuple[str, dict[str, str]]]) -> list[str]:
    return [e["reason"] for _, e in entries]


def test_a_block_key_is_a_reservation_key_in_the_tenants_slot() -> None:
    key = block_key("acme", "host-1:9", 3)
    assert reservation_names(key) == ("acme", "~block.host-1:9.3")
    assert key_slot(key) == key_slot(reservation_key("acme", "r1"))
    assert open_set_key(key, "p") == open_set_key(reservation_key("acme", "r1"), "p")
    assert is_block_key(key) and not is_block_key(reservation_key("acme", "block.x"))
    with pytest.raises(ValueError):
        block_key("acme", "", 1)


async def test_take_admit_from_and_return_a_block_balance_the_books(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 10)
    rpm = counter("rpm", 100)
    tpm, itpm = counter("tpm", 100_000), counter("itpm", 100_000, weights=(1, 0, 1))
    cost = counter("cost", 10_000_000, weights=(3, 7, 1))
    tokens = (tpm, itpm, cost)
    take = block_request(harness, (rpm,), tokens, 1000)
    block = await harness.backend.take_block(take, 5)

    assert block.verdict.admitted and not block.verdict.replayed
    assert block.amounts == (1000, 1000, 7000) and block.requests == 5
    assert [await harness.total(c) for c in (rpm, *tokens)] == [5, 1000, 1000, 7000]
    assert 0 < block.valid_s <= HOUR and block.server_now_us > 0
    owned = open_set_key(take.reservation_key, peer(harness).owner_id)
    assert await harness.open_set(owned) == {take.reservation_key}

    moved = [request((rpm,), tokens, t, prompt=p) for t, p in ((300, 100), (200, 200), (100, 0))]
    for r in moved:
        verdict = await harness.backend.admit_from_block(take.reservation_key, r)
        assert verdict.admitted and verdict.from_block, verdict
        assert [s.kind for s in verdict.states] == ["rpm", "tpm", "itpm", "cost"]
    assert verdict.states[0].remaining == 95  # the block's charge, nothing more
    assert [await harness.total(c) for c in (rpm, *tokens)] == [5, 1000, 1000, 7000]
    assert await harness.open_set(owned) == {take.reservation_key} | {
        r.reservation_key for r in moved
    }

    for r in moved:
        await harness.backend.settle(r.reservation_key, tokens, r.tokens // 2)
    returned = await harness.backend.return_block(take.reservation_key, (rpm,), tokens)
    assert not returned.already_settled and returned.used == 0
    # What was left: 1000 - 600 tokens; input-only 1000 - (100 + 200 + 0); cost 7000 - moved
    moved_cost = sum(3 * p + 7 * (t - p) for t, p in ((300, 100), (200, 200), (100, 0)))
    assert returned.refunded_per_counter == (400, 700, 7000 - moved_cost)
    assert returned.reserved == 400
    assert await harness.total(rpm) == 3  # two unused slots back
    assert await harness.open_set(owned) == set()
    entries = await harness.ledger(usage_stream_key(take.reservation_key))
    assert reasons(entries) == ["completed"] * 3 + ["returned"]
    assert entries[-1][1]["request_id"] == reservation_names(take.reservation_key)[1]
    await assert_books_balance(harness, *tokens)
    # A request settling from the block is the request's: replays and reserve still work.
    assert (await harness.backend.admit(moved[0])).replayed


async def test_a_block_without_room_is_refused_and_charges_nothing(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 10), counter("tpm", 1000)
    shadow = Counter("shadow_tpm", counter("shadow_tpm", 10).key, 600, HOUR, shadow=True)
    for tokens, slots, refused_by in ((1001, 1, "tpm"), (10, 11, "rpm")):
        take = block_request(harness, (rpm,), (tpm, shadow), tokens)
        block = await harness.backend.take_block(take, slots)
        assert not block.verdict.admitted and block.verdict.refused_by == refused_by
        assert (block.valid_s, block.amounts, block.requests) == (0.0, (), 0)
    assert [await harness.total(c) for c in (rpm, tpm, shadow)] == [0, 0, 0]
    take = block_request(harness, (rpm,), (tpm, shadow), 500)
    block = await harness.backend.take_block(take, 10)
    assert block.verdict.admitted and block.verdict.shadow_refused_by == ()
    assert [await harness.total(c) for c in (rpm, tpm, shadow)] == [10, 500, 500]
    assert (await harness.backend.take_block(take, 10)).verdict.replayed  # charges nothing
    assert [await harness.total(c) for c in (rpm, tpm, shadow)] == [10, 500, 500]
    assert await harness.open_set(open_set_key(take.reservation_key, peer(harness).owner_id)) == {
        take.reservation_key
    }


async def test_a_block_is_never_taken_past_a_shadow_limit(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    shadow = Counter("shadow_tpm", counter("shadow_tpm", 10).key, 600, HOUR, shadow=True)
    # An admission over the shadow limit is admitted and reports it ...
    over = request((), (tpm, shadow), 700)
    verdict = await harness.backend.admit(over)
    assert verdict.admitted and verdict.shadow_refused_by == ("shadow_tpm",)
    assert [await harness.total(c) for c in (tpm, shadow)] == [700, 700]
    await harness.backend.settle(over.reservation_key, (tpm, shadow), 100)
    # ... a take over it is refused by it, and charges nothing.
    take = block_request(harness, (), (tpm, shadow), 501)
    block = await harness.backend.take_block(take, 1)
    assert not block.verdict.admitted and block.verdict.refused_by == "shadow_tpm"
    assert [await harness.total(c) for c in (tpm, shadow)] == [100, 100]
    # Within it, a take is admitted; what it admits reports nothing, and the books balance.
    take = block_request(harness, (), (tpm, shadow), 500)
    assert (await harness.backend.take_block(take, 2)).verdict.admitted
    inside = request((), (tpm, shadow), 500)
    moved = await harness.backend.admit_from_block(take.reservation_key, inside)
    assert moved.from_block and moved.shadow_refused_by == ()
    await harness.backend.settle(inside.reservation_key, (tpm, shadow), 300)
    await harness.backend.return_block(take.reservation_key, (), (tpm, shadow))
    assert [await harness.total(c) for c in (tpm, shadow)] == [400, 400]
    await assert_books_balance(harness, tpm, shadow)


async def test_admit_from_block_replays_charge_and_move_nothing(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 10_000)
    take = block_request(harness, (rpm,), (tpm,), 500)
    await harness.backend.take_block(take, 2)
    first = request((rpm,), (tpm,), 200)
    assert (await harness.backend.admit_from_block(take.reservation_key, first)).from_block
    again = await harness.backend.admit_from_block(take.reservation_key, first)
    assert again.admitted and again.replayed and not again.from_block
    # The block still holds one slot and 300 tokens: the replay moved nothing.
    second = request((rpm,), (tpm,), 300)
    assert (await harness.backend.admit_from_block(take.reservation_key, second)).from_block
    assert [await harness.total(c) for c in (rpm, tpm)] == [2, 500]
    # A cancelled key stays cancelled, whatever the block holds.
    gone = request((rpm,), (tpm,), 1)
    await harness.backend.cancel(gone.reservation_key, (tpm,))
    assert (await harness.backend.admit_from_block(take.reservation_key, gone)).cancelled
    assert [await harness.total(c) for c in (rpm, tpm)] == [2, 500]


async def test_an_exhausted_block_falls_back_to_a_normal_admission(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 2000)
    take = block_request(harness, (rpm,), (tpm,), 500)
    await harness.backend.take_block(take, 2)
    big = request((rpm,), (tpm,), 501)  # more than the block holds: a direct admission
    verdict = await harness.backend.admit_from_block(take.reservation_key, big)
    assert verdict.admitted and not verdict.from_block
    assert [await harness.total(c) for c in (rpm, tpm)] == [3, 1001]
    for tokens in (10, 10):  # two slots
        r = request((rpm,), (tpm,), tokens)
        assert (await harness.backend.admit_from_block(take.reservation_key, r)).from_block
    no_slot = request((rpm,), (tpm,), 10)
    fallback = await harness.backend.admit_from_block(take.reservation_key, no_slot)
    assert fallback.admitted and not fallback.from_block
    no_room = request((rpm,), (tpm,), 1000)
    refused = await harness.backend.admit_from_block(take.reservation_key, no_room)
    assert not refused.admitted and refused.refused_by == "tpm"  # 1011 + 1000 > 2000
    assert [await harness.total(c) for c in (rpm, tpm)] == [5, 1011]  # the attempt counts
    # Another processor's block is not this one's to take from.
    foreign = block_key("acme", "someone-else", 1)
    r = request((rpm,), (counter("tpm", 10_000, 60),), 5)
    assert not (await harness.backend.admit_from_block(foreign, r)).from_block


async def test_a_block_settled_by_a_peer_is_not_taken_from(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 10_000)
    take = block_request(harness, (rpm,), (tpm,), 500)
    await harness.backend.take_block(take, 5)
    owner = peer(harness).owner_id
    status, settled = await peer(harness).settle_orphan(take.reservation_key, owner)
    assert status == "settled" and settled is not None and settled.used == 500
    r = request((rpm,), (tpm,), 100)
    verdict = await harness.backend.admit_from_block(take.reservation_key, r)
    assert verdict.admitted and not verdict.from_block
    assert [await harness.total(c) for c in (rpm, tpm)] == [6, 600]
    again = await harness.backend.return_block(take.reservation_key, (rpm,), (tpm,))
    assert again.already_settled and again.used == 500
    assert [await harness.total(c) for c in (rpm, tpm)] == [6, 600]


async def test_admitting_from_a_block_after_its_window_ended_keeps_the_charge_there(
    harness: Harness,
) -> None:
    window = 2
    rpm = counter("rpm", 100, window)
    tpm, daily = counter("tpm", 1000, window), counter("daily", 100_000, DAY)
    await harness.ensure_room(DAY, 10)
    w1 = await harness.advance_to_next_window(window)
    take = block_request(harness, (rpm,), (tpm, daily), 400)
    block = await harness.backend.take_block(take, 3)
    assert 0 < block.valid_s <= window
    w2 = await harness.advance_to_next_window(window)
    late = request((rpm,), (tpm, daily), 100)
    verdict = await harness.backend.admit_from_block(take.reservation_key, late)

    assert verdict.admitted and verdict.from_block
    assert verdict.states[1].remaining == 1000  # the current window: the charge is in W1
    assert await harness.windows(tpm) == {w1: 400}
    settlement = await harness.backend.settle(late.reservation_key, (tpm, daily), used=30)
    assert settlement.refunded_per_counter == (0, 70)  # W1 has ended and keeps its share
    returned = await harness.backend.return_block(take.reservation_key, (rpm,), (tpm, daily))
    assert returned.refunded_per_counter == (0, 300)
    assert await harness.windows(tpm) == {w1: 400}
    assert await harness.windows(rpm) == {w1: 3}  # the slots' window ended too
    assert await harness.total(daily) == 30
    entries = await harness.ledger(usage_stream_key(take.reservation_key))
    assert reasons(entries) == ["completed", "returned"]
    assert entries[0][1]["windows"] == f"tpm:{window}:{w1}:100;daily:{DAY}:{w1 - w1 % DAY}:30"
    assert entries[1][1]["windows"] == f"tpm:{window}:{w1}:300;daily:{DAY}:{w1 - w1 % DAY}:0"
    await assert_books_balance(harness, tpm, daily)
    assert w2 > w1


async def test_returning_a_block_is_idempotent_and_a_lost_take_is_undone(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 10_000)
    take = block_request(harness, (rpm,), (tpm,), 500)
    await harness.backend.take_block(take, 4)
    first = await harness.backend.return_block(take.reservation_key, (rpm,), (tpm,))
    second = await harness.backend.return_block(take.reservation_key, (rpm,), (tpm,))
    assert not first.already_settled and second.already_settled
    assert (second.reserved, second.refunded) == (first.reserved, first.refunded) == (500, 500)
    assert [await harness.total(c) for c in (rpm, tpm)] == [0, 0]
    assert reasons(await harness.ledger(usage_stream_key(take.reservation_key))) == ["returned"]
    # Nothing to take from any more; the take replays as cancelled.
    r = request((rpm,), (tpm,), 10)
    assert not (await harness.backend.admit_from_block(take.reservation_key, r)).from_block
    assert (await harness.backend.take_block(take, 4)).verdict.cancelled
    # Returning a key whose take has not run (its reply was lost) makes that take a no-op.
    lost = block_request(harness, (rpm,), (tpm,), 500)
    empty = await harness.backend.return_block(lost.reservation_key, (rpm,), (tpm,))
    assert (empty.reserved, empty.refunded_per_counter) == (0, (0,))
    late = await harness.backend.take_block(lost, 4)
    assert late.verdict.cancelled and not late.verdict.admitted and late.amounts == ()
    assert [await harness.total(c) for c in (rpm, tpm)] == [1, 10]


async def test_a_dead_owners_block_is_settled_by_a_peer_as_fully_used(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm, tpm = counter("rpm", 100), counter("tpm", 10_000)
    owner = peer(harness).owner_id
    take = block_request(harness, (rpm,), (tpm,), 800)
    await harness.backend.take_block(take, 4)
    moved = request((rpm,), (tpm,), 300)
    assert (await harness.backend.admit_from_block(take.reservation_key, moved)).from_block

    # The owner died: a peer settles everything in its open set.
    owned = open_set_key(take.reservation_key, owner)
    for key in sorted(await harness.open_set(owned)):
        status, settled = await peer(harness).settle_orphan(key, owner)
        assert status == "settled" and settled is not None
        assert settled.used == (500 if key == take.reservation_key else 300)
    assert await harness.open_set(owned) == set()
    assert [await harness.total(c) for c in (rpm, tpm)] == [4, 800]  # slots kept too
    entries = await harness.ledger(usage_stream_key(take.reservation_key))
    assert reasons(entries) == ["orphaned", "orphaned"]
    block_entry = next(e for _, e in entries if e["request_id"].startswith("~block."))
    assert (block_entry["reserved"], block_entry["used"], block_entry["refunded"]) == (
        "500", "500", "0",
    )  # fmt: skip
    await assert_books_balance(harness, tpm)


async def test_a_sliding_counters_block_is_valid_until_its_bucket_ends(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    sliding = counter("tpm", 10_000, 60, shape="sliding", bucket_s=5)
    hourly = counter("tenant_tpm", 100_000)
    take = block_request(harness, (), (sliding, hourly), 100)
    before = await harness.now()
    block = await harness.backend.take_block(take, 1)
    assert block.verdict.admitted
    assert 0 < block.valid_s <= 5 - before % 5 + 0.01
    r = request((), (sliding, hourly), 60)
    assert (await harness.backend.admit_from_block(take.reservation_key, r)).from_block
    await harness.backend.settle(r.reservation_key, (sliding, hourly), 60)
    returned = await harness.backend.return_block(take.reservation_key, (), (sliding, hourly))
    assert returned.refunded_per_counter == (40, 40)
    assert await harness.total(hourly) == 60
