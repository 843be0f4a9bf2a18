"""``usage_ledger`` in the configuration: defaults, bounds, errors, and the backends it builds."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.config import ConfigError, parse_config
from extproc.quota.base import LedgerSettings
from extproc.quota.factory import backend_from_url
from extproc.quota.memory.backend import MemoryQuotaBackend
from tests.config.test_config import base_doc


def test_the_ledger_is_on_by_default_with_its_bounds() -> None:
    config = parse_config(base_doc())
    assert config.usage_ledger == LedgerSettings(True, 1_000_000, 7 * 86400)
    assert config.normalised["usage_ledger"] == {
        "enabled": True,
        "max_len": 1_000_000,
        "retention_s": 604_800,
    }


def test_ledger_settings_are_read_and_change_the_hash() -> None:
    doc = {**base_doc(), "usage_ledger": {"max_len": 0, "retention_s": 86400}}
    config = parse_config(doc)
    assert config.usage_ledger == LedgerSettings(True, 0, 86400)
    assert config.hash != parse_config(base_doc()).hash
    off = parse_config({**base_doc(), "usage_ledger": {"enabled": False}})
    assert not off.usage_ledger.enabled


@pytest.mark.parametrize(
    ("ledger", "field"),
    [
        ({"max_len": -1}, "usage_ledger.max_len"),
        ({"retention_s": "a week"}, "usage_ledger.retention_s"),
        ({"enabled": "yes"}, "usage_ledger.enabled"),
        ({"maxlen": 5}, "usage_ledger.maxlen"),
        ([1], "usage_ledger"),
    ],
)
def test_a_bad_ledger_setting_is_named(ledger: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**base_doc(), "usage_ledger": ledger})
    assert info.value.path == field


def test_the_memory_backend_keeps_the_configured_bound() -> None:
    backend = backend_from_url("memory://", ledger=LedgerSettings(max_len=3, retention_s=0))
    assert isinstance(backend, MemoryQuotaBackend)
    assert backend.ledger == LedgerSettings(max_len=3, retention_s=0)


async def test_the_memory_ledger_keeps_max_len_entries_and_drops_old_ones() -> None:
    from extproc.quota.base import AdmitRequest, Counter
    from extproc.quota.keys import counter_key, reservation_key, usage_stream_key
    from tests.quota.conftest import FakeClock

    clock = FakeClock(1_700_000_000.5)
    backend = MemoryQuotaBackend(clock=clock, ledger=LedgerSettings(max_len=3, retention_s=60))
    tpm = Counter("tpm", counter_key("t", "tpm", "m", 60), 10**6, 60)
    stream = usage_stream_key(reservation_key("t", "x"))
    for i in range(5):
        key = reservation_key("t", f"r{i}")
        await backend.admit(AdmitRequest(key, (), (tpm,), 10))
        await backend.settle(key, (tpm,), 5)
    assert [f["request_id"] for _, f in backend.ledger_entries(stream)] == ["r2", "r3", "r4"]
    clock.now += 61
    key = reservation_key("t", "late")
    await backend.admit(AdmitRequest(key, (), (tpm,), 10))
    await backend.settle(key, (tpm,), 5)
    assert [f["request_id"] for _, f in backend.ledger_entries(stream)] == ["late"]
