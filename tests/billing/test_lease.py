"""The lease-ahead rule (extproc.admission.lease): sizes and timing of output reservations."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from extproc.admission.lease import (
    ADMISSION_CAP,
    cover_lease,
    first_lease,
    lease_due_at,
    lease_target,
    next_lease,
)

batches = st.integers(min_value=1, max_value=512)
outputs = st.integers(min_value=1, max_value=10_000)
counts = st.integers(min_value=0, max_value=20_000)


# -- worked examples -------------------------------------------------------------------


def test_admission_reserves_one_batch_up_to_the_cap() -> None:
    assert first_lease(32, 1000) == 32
    assert first_lease(16, 1000) == 16
    assert first_lease(128, 1000) == ADMISSION_CAP == 32
    assert first_lease(32, 10) == 10  # never more than the request can produce


def test_one_batch_in_hand_before_the_first_token() -> None:
    # batch 32: admission's share is the whole batch; nothing more is due at 0 delivered.
    assert next_lease(32, 0, 32, 1000) == 0
    # batch 128: admission reserved 32, the first event tops it up to one batch.
    assert next_lease(32, 0, 128, 1000) == 96
    assert next_lease(128, 0, 128, 1000) == 0


def test_next_batch_once_the_current_is_half_used() -> None:
    assert [next_lease(32, d, 32, 1000) for d in (1, 15, 16, 31)] == [0, 0, 32, 32]
    assert next_lease(64, 47, 32, 1000) == 0
    assert next_lease(64, 48, 32, 1000) == 32
    assert next_lease(128, 63, 128, 1000) == 0
    assert next_lease(128, 64, 128, 1000) == 128


def test_no_lease_past_max_output() -> None:
    assert next_lease(96, 80, 32, 100) == 4
    assert next_lease(100, 99, 32, 100) == 0


def test_after_a_partial_grant_nothing_is_leased_ahead() -> None:
    # 64 asked at the 16th token, 10 granted: the budget is nearly spent.
    assert next_lease(42, 20, 32, 1000) == 0
    assert next_lease(42, 41, 32, 1000) == 0
    # The event that needs more asks then, for the shortfall and back to whole batches.
    assert cover_lease(42, 43, 32, 1000) == 22
    # A top-up granted in part (32 + 40 of 96 at batch 128) likewise.
    assert next_lease(72, 1, 128, 1000) == 0


def test_cover_asks_for_at_least_the_shortfall() -> None:
    assert cover_lease(32, 40, 32, 1000) == 32  # to 64: the target at 40 delivered
    assert cover_lease(32, 200, 32, 1000) == 192  # to 224, on the grid again
    assert cover_lease(1000, 1003, 32, 1000) == 3  # an upstream overrunning max_tokens


def test_batch_must_be_positive() -> None:
    with pytest.raises(ValueError):
        first_lease(0, 100)
    with pytest.raises(ValueError):
        lease_target(5, -1)


# -- properties --------------------------------------------------------------------------


@given(batches, outputs)
def test_first_lease_bounds(batch: int, max_output: int) -> None:
    amount = first_lease(batch, max_output)
    assert 1 <= amount <= min(batch, max_output, ADMISSION_CAP)


@given(counts, batches)
def test_target_is_whole_batches_between_half_and_one_and_a_half_ahead(
    delivered: int, batch: int
) -> None:
    target = lease_target(delivered, batch)
    assert target % batch == 0
    assert batch // 2 < target - delivered <= batch + batch // 2
    assert lease_target(delivered + 1, batch) >= target  # never shrinks


@given(counts, counts, batches, outputs)
# Batch over the admission cap, the first event half a batch: the first batch's top-up and
# the next batch come in one lease (found by a fresh-clone run).
@example(leased=ADMISSION_CAP, delivered=17, batch=33, max_output=66)
def test_next_lease_never_exceeds_max_output_nor_one_batch_ahead(
    leased: int, delivered: int, batch: int, max_output: int
) -> None:
    delivered = min(delivered, leased)  # the meter never delivers past its lease
    amount = next_lease(leased, delivered, batch, max_output)
    assert amount >= 0
    if amount:
        assert leased + amount <= max_output
        # One batch; right after admission also what tops the first batch up.
        first = first_lease(batch, max_output)
        top_up = batch - first if leased == first and first < batch else 0
        assert amount <= batch + top_up
        # What is in hand afterwards: at most the rest of this batch and the next one.
        assert leased + amount - delivered <= batch + batch // 2


@given(counts, counts, batches, outputs)
def test_cover_lease_covers_the_need_and_stays_within_max_output(
    leased: int, extra: int, batch: int, max_output: int
) -> None:
    need = leased + extra + 1
    amount = cover_lease(leased, need, batch, max_output)
    assert leased + amount >= need
    assert leased + amount <= max(need, max_output)


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    batch = draw(batches)
    max_output = draw(outputs)
    costs = draw(st.lists(st.integers(0, max(1, batch // 2 + 1)), max_size=300))
    return batch, max_output, costs


def replay(batch: int, max_output: int, costs: list[int]) -> tuple[int, int, int, list[int]]:
    """A stream with every lease granted in full before the next event arrives.

    Returns (leases, waits, delivered, lease in hand after each event).
    """
    leased = first_lease(batch, max_output)
    delivered = leases = waits = 0
    in_hand = []
    for cost in costs:
        if delivered + cost > max_output:
            break  # the upstream stops at max_tokens
        if delivered + cost > leased:
            waits += 1
            leased += cover_lease(leased, delivered + cost, batch, max_output)
            leases += 1
        delivered += cost
        amount = next_lease(leased, delivered, batch, max_output)
        if amount:
            leased += amount
            leases += 1
        in_hand.append(leased - delivered)
        assert leased <= max_output
    return leases, waits, delivered, in_hand


@given(streams())
def test_a_stream_never_waits_and_leases_once_per_batch(stream: tuple[int, int, list[int]]) -> None:
    batch, max_output, costs = stream
    costs[:1] = [min(c, first_lease(batch, max_output)) for c in costs[:1]]
    leases, waits, delivered, in_hand = replay(batch, max_output, costs)
    # Events of up to half a batch (+1) never wait on a lease when leases land in time.
    assert waits == 0
    # One lease per batch of output, plus admission's top-up when the batch is over the cap.
    top_up = 1 if first_lease(batch, max_output) < min(batch, max_output) else 0
    assert leases <= math.ceil(delivered / batch) + top_up
    # At most one batch ahead of the current half-batch, whatever the progress.
    assert all(h <= batch + batch // 2 for h in in_hand)


@given(batches, outputs)
def test_one_batch_in_hand_before_the_first_token_property(batch: int, max_output: int) -> None:
    leased = first_lease(batch, max_output)
    leased += next_lease(leased, 0, batch, max_output)  # the first event, before any token
    assert leased == min(batch, max_output)
    assert next_lease(leased, 0, batch, max_output) == 0


@given(leased=counts, delivered=counts, batch=batches, max_output=outputs)
def test_lease_due_at_is_exactly_where_next_lease_starts_asking(
    leased: int, delivered: int, batch: int, max_output: int
) -> None:
    due = lease_due_at(leased, batch, max_output)
    due_now = due is not None and delivered >= due
    assert due_now == (next_lease(leased, delivered, batch, max_output) > 0)
