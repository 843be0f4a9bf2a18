"""``absorb`` (the protocol's reconciliation of charges served elsewhere) on both backends:
into the current window whatever window it was served in, once per key, with its ledger
entry naming the ranked windows it went to."""

from __future__ import annotations

import itertools

from extproc.quota.base import LEDGER_FIELDS, AbsorbedUsage, Absorption, Counter
from extproc.quota.keys import counter_key, reservation_key, usage_stream_key
from extproc.quota.resilience.allowance import absorb_key
from tests.quota.conftest import Harness

HOUR = 3600
_ids = itertools.count()


def counters(tenant: str) -> tuple[Counter, Counter, Counter]:
    return (
        Counter("rpm", counter_key(tenant, "rpm", "m", HOUR), 100, HOUR),
        Counter("tpm", counter_key(tenant, "tpm", "m", HOUR), 10_000, HOUR),
        Counter("otpm", counter_key(tenant, "otpm", "m", HOUR), 10_000, HOUR),
    )


async def test_absorb_charges_the_current_window_once_with_one_ledger_entry(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 30)
    tenant = f"absorb-{harness.name}-{next(_ids)}"
    rpm, tpm, otpm = counters(tenant)
    now = int(await harness.now())
    current = now - now % HOUR
    key = reservation_key(tenant, "r1")
    absorption = Absorption(
        absorb_key(key),
        (
            (rpm.key, HOUR, current, 1),
            (tpm.key, HOUR, current, 30),  # served in the live window
            (tpm.key, HOUR, current - HOUR, 12),  # in one that has ended: moved to this one
            (otpm.key, HOUR, current, 20),
        ),
        AbsorbedUsage("pro", "m", "client-1", "completed", 22, 20, ""),
    )

    assert await harness.backend.absorb(absorption)
    assert not await harness.backend.absorb(absorption)  # applied once, whatever the retries

    assert await harness.windows(rpm) == {current: 1}
    assert await harness.windows(tpm) == {current: 42}
    assert await harness.windows(otpm) == {current: 20}
    ((_, entry),) = await harness.ledger(usage_stream_key(key))
    assert tuple(entry) == LEDGER_FIELDS
    assert {k: v for k, v in entry.items() if k != "settled_at_us"} == {
        "tenant": tenant,
        "plan": "pro",
        "model": "m",
        "request_id": "r1",
        "client_request_id": "client-1",
        "prompt_tokens": "22",
        "output_tokens": "20",
        "reserved": "42",
        "used": "42",
        "refunded": "0",
        "windows": f"tpm:{HOUR}:{current}:42",  # ranked kinds only (otpm, rpm are not)
        "reason": "completed",
        "admitted_at_us": "",
    }


async def test_an_absorb_without_usage_writes_no_ledger_entry(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 30)
    tenant = f"absorb-rpm-{harness.name}-{next(_ids)}"
    rpm, _, _ = counters(tenant)
    now = int(await harness.now())
    key = reservation_key(tenant, "r2")
    assert await harness.backend.absorb(
        Absorption(absorb_key(key), ((rpm.key, HOUR, now - now % HOUR, 1),))
    )
    assert await harness.total(rpm) == 1
    assert await harness.ledger(usage_stream_key(key)) == []
