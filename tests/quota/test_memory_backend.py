"""What only the memory backend has: its own clock and its own expiry of old windows."""

from __future__ import annotations

from extproc.quota.base import AdmitRequest, Counter
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from tests.quota.conftest import FakeClock


async def test_ended_windows_and_old_records_are_dropped_from_memory() -> None:
    clock = FakeClock(1_700_000_000.5)
    backend = MemoryQuotaBackend(clock=clock, sweep_interval_s=1.0)
    counter = Counter("tpm", counter_key("acme", "tpm", "m", 60), 1000, 60)
    for i in range(20):
        await backend.admit(
            AdmitRequest(reservation_key("acme", f"r{i}"), (), (counter,), 10, record_ttl_s=120)
        )
    assert backend.stored_entries() == (1, 20)

    clock.now += 60  # next minute: the old window is over, records still live
    await backend.admit(AdmitRequest(reservation_key("acme", "late"), (), (counter,), 10))
    assert list(backend.counters().values()) == [10]
    assert backend.stored_entries() == (1, 21)

    clock.now += 3600 * 2
    await backend.ping()
    await backend.admit(AdmitRequest(reservation_key("acme", "later"), (), (counter,), 5))
    assert backend.stored_entries() == (1, 1)


async def test_a_tombstone_expires_after_its_ttl_and_then_admission_charges_again() -> None:
    clock = FakeClock(1_700_000_000.5)
    backend = MemoryQuotaBackend(clock=clock, sweep_interval_s=1.0)
    counter = Counter("tpm", counter_key("acme", "tpm", "m", 3600), 1000, 3600)
    request = AdmitRequest(reservation_key("acme", "late"), (), (counter,), 10)
    await backend.cancel(request.reservation_key, (counter,), tombstone_ttl_s=30)

    clock.now += 29
    assert (await backend.admit(request)).cancelled
    assert backend.counters() == {}
    clock.now += 2
    verdict = await backend.admit(request)
    assert verdict.admitted and not verdict.cancelled and not verdict.replayed
    assert list(backend.counters().values()) == [10]
