"""The usage ledger, on both backends: one entry per settlement, fields exact, and the
ledger's net tokens per window equal to the counters (extproc/quota/base.py)."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

from extproc.quota.base import AdmitRequest, Counter, LedgerSettings, UsageTags
from extproc.quota.keys import reservation_key, usage_stream_key
from extproc.quota.windows import EXPIRY_MARGIN_S
from tests.quota.conftest import Harness
from tests.quota.test_conformance import DAY, HOUR, counter

_ids = itertools.count()
TAGS = UsageTags("pro", "gpt-4.1", "client-7", 60)


def request(
    token_counters: tuple[Counter, ...],
    tokens: int,
    rpm: Counter | None = None,
    tags: UsageTags | None = TAGS,
) -> AdmitRequest:
    return AdmitRequest(
        reservation_key=reservation_key("acme", f"led/{next(_ids)}"),
        request_counters=(rpm,) if rpm is not None else (),
        token_counters=token_counters,
        tokens=tokens,
        usage=tags,
    )


def stream(req: AdmitRequest) -> str:
    return usage_stream_key(req.reservation_key)


def request_id(req: AdmitRequest) -> str:
    return req.reservation_key.rpartition(":r:")[2].replace("%2F", "/")


async def entries(harness: Harness, req: AdmitRequest) -> list[dict[str, str]]:
    return [fields for _, fields in await harness.ledger(stream(req))]


def net_per_window(ledger: list[dict[str, str]]) -> dict[tuple[str, int, int], int]:
    total: dict[tuple[str, int, int], int] = defaultdict(int)
    for fields in ledger:
        for part in filter(None, fields["windows"].split(";")):
            kind, window_s, start, net = part.split(":")
            total[(kind, int(window_s), int(start))] += int(net)
    return dict(total)


async def assert_ledger_matches_counters(
    harness: Harness, counters: tuple[Counter, ...], ledger: list[dict[str, str]]
) -> None:
    from_ledger = net_per_window(ledger)
    stored = {}
    for c in counters:
        for start, value in (await harness.windows(c)).items():
            stored[(c.kind, c.window_s, start)] = value
    now = await harness.now()

    def alive(window: tuple[str, int, int]) -> bool:
        # Keys expire EXPIRY_MARGIN_S after their window; compare those surely still there.
        return window[2] + window[1] + EXPIRY_MARGIN_S > now + 0.2

    # A window the ledger names with 0 net may have no key, or a key at 0.
    assert {k: v for k, v in stored.items() if v and alive(k)} == {
        k: v for k, v in from_ledger.items() if v and alive(k)
    }
    assert any(alive(k) for k in from_ledger)


async def test_a_settlement_appends_one_entry_with_every_field(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm, daily = counter("tpm", 10_000), counter("daily", 100_000, DAY)
    req = request((tpm, daily), 100)
    await harness.backend.admit(req)
    await harness.backend.reserve(req.reservation_key, 1, (tpm, daily), 32)
    before = await harness.now()
    settlement = await harness.backend.settle(
        req.reservation_key, (tpm, daily), 90, reason="cutoff", output_tokens=25
    )

    [(entry_id, fields)] = await harness.ledger(stream(req))
    now = await harness.now()
    hour = int(before) - int(before) % HOUR
    day = int(before) - int(before) % DAY
    admitted_at, settled_at = int(fields.pop("admitted_at_us")), int(fields.pop("settled_at_us"))
    assert fields == {
        "tenant": "acme",
        "plan": "pro",
        "model": "gpt-4.1",
        "request_id": request_id(req),
        "client_request_id": "client-7",
        "prompt_tokens": "65",
        "output_tokens": "25",
        "reserved": "132",
        "used": "90",
        "refunded": "42",
        "windows": f"tpm:{HOUR}:{hour}:90;daily:{DAY}:{day}:90",
        "reason": "cutoff",
    }
    assert settlement.refunded == 42
    assert admitted_at <= settled_at <= now * 1_000_000 + 1
    assert before * 1_000_000 - 1 <= settled_at
    # The entry id is the server's ms when XADD ran, a moment after the script read TIME.
    assert settled_at // 1000 - 1 <= int(entry_id.split("-")[0]) <= now * 1000 + 1


async def test_without_an_output_split_the_prompt_is_admissions_count(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    req = request((tpm,), 100)
    await harness.backend.admit(req)
    await harness.backend.settle(req.reservation_key, (tpm,), 70)
    [fields] = await entries(harness, req)
    assert (fields["prompt_tokens"], fields["output_tokens"], fields["reason"]) == (
        "60",
        "10",
        "completed",
    )


async def test_replays_refusals_and_unknown_records_write_no_entry(harness: Harness) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 150)
    first, refused = request((tpm,), 100), request((tpm,), 100)
    await harness.backend.admit(first)
    assert not (await harness.backend.admit(refused)).admitted
    await harness.backend.settle(first.reservation_key, (tpm,), 40)
    await harness.backend.settle(first.reservation_key, (tpm,), 40)  # replay
    await harness.backend.cancel(first.reservation_key, (tpm,))  # after settle: nothing
    await harness.backend.settle(refused.reservation_key, (tpm,), 40)
    await harness.backend.cancel(refused.reservation_key, (tpm,))
    unknown = request((tpm,), 10)
    await harness.backend.settle(unknown.reservation_key, (tpm,), 5)
    await harness.backend.cancel(request((tpm,), 10).reservation_key, (tpm,))  # tombstone

    ledger = await entries(harness, first)
    assert [(f["request_id"], f["used"]) for f in ledger] == [(request_id(first), "40")]
    await assert_ledger_matches_counters(harness, (tpm,), ledger)


async def test_a_cancelled_admission_that_had_run_is_recorded_as_cancelled(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    tpm = counter("tpm", 10_000)
    req = request((tpm,), 100)
    await harness.backend.admit(req)
    await harness.backend.cancel(req.reservation_key, (tpm,))
    await harness.backend.cancel(req.reservation_key, (tpm,))
    [fields] = await entries(harness, req)
    assert (fields["reason"], fields["used"], fields["refunded"]) == ("cancelled", "0", "100")
    assert (fields["prompt_tokens"], fields["output_tokens"]) == ("0", "0")  # nothing billed
    assert fields["windows"].endswith(":0")
    await assert_ledger_matches_counters(harness, (tpm,), [fields])


async def test_an_rpm_only_request_is_settled_into_the_ledger_without_windows(
    harness: Harness,
) -> None:
    await harness.ensure_room(HOUR, 5)
    rpm = counter("rpm", 10)
    req = request((), 100, rpm=rpm)
    await harness.backend.admit(req)
    settlement = await harness.backend.settle(req.reservation_key, (), 80, output_tokens=20)
    [fields] = await entries(harness, req)
    assert settlement.reserved == 0
    assert (fields["reserved"], fields["used"], fields["windows"]) == ("0", "80", "")
    assert (fields["prompt_tokens"], fields["output_tokens"]) == ("60", "20")
    assert await harness.total(rpm) == 1


async def test_net_tokens_per_window_equal_the_counters_across_window_boundaries(
    harness: Harness,
) -> None:
    window = 2
    tpm, daily = counter("tpm", 10**9, window), counter("daily", 10**9, DAY)
    tenant_tpm = counter("tenant_tpm", 10**9, window, model=None)
    counters = (tpm, tenant_tpm, daily)
    await harness.ensure_room(DAY, 30)
    rng = random.Random(11)
    everything: list[AdmitRequest] = []
    open_requests: list[AdmitRequest] = []
    for step in range(4):
        await harness.advance_to_next_window(window)
        for _ in range(6):
            req = request(counters, rng.randrange(0, 200))
            await harness.backend.admit(req)
            open_requests.append(req)
            everything.append(req)
        for i, req in enumerate(open_requests):
            await harness.backend.reserve(req.reservation_key, step, counters, rng.randrange(1, 64))
            if rng.random() < 0.4:
                used = rng.randrange(0, 400)  # below and above the reservation
                if i % 5 == 0:
                    await harness.backend.cancel(req.reservation_key, counters)
                else:
                    await harness.backend.settle(req.reservation_key, counters, used)
        open_requests = [r for r in open_requests if rng.random() < 0.7]
    await harness.advance_to_next_window(window)
    for req in everything:  # what is still open settles now; the rest are replays
        await harness.backend.settle(req.reservation_key, counters, rng.randrange(0, 300))
    ledger = await entries(harness, everything[0])
    assert sorted(f["request_id"] for f in ledger) == sorted(map(request_id, everything))
    await assert_ledger_matches_counters(harness, counters, ledger)


async def test_a_disabled_ledger_writes_nothing(harness: Harness) -> None:
    backend = harness.backend
    backend.ledger = LedgerSettings(enabled=False)  # type: ignore[attr-defined]
    tpm = counter("tpm", 10_000)
    req = request((tpm,), 100)
    await backend.admit(req)
    await backend.settle(req.reservation_key, (tpm,), 10)
    assert await entries(harness, req) == []
