"""Admission blocks (``extproc.admission.blocks``) on both backends: what is admitted here,
from a block, is charged before and recorded after, and the books balance.

Each test drives ``AdmissionBlocks`` over a real backend (memory, and redis-server) the way
``Admission`` does: ``admit_here`` first, the backend's ``admit`` when it declines; then
the meter's ``reserve`` and ``settle`` through it. Invariants only: counters == the sum of
the ledger's net per window, one ledger entry per request, nothing left open.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any, cast

from extproc.admission.blocks import AdmissionBlocks
from extproc.config.schema import AdmissionLeaseSpec
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import AdmitRequest, Counter, QuotaBackend, UsageTags, Verdict
from tests.quota.conftest import Clocked, Harness

WINDOW_S = 3600
PROMPT = 20
OUTPUT = 32  # the first lease admission reserves


_probes = itertools.count()


class SlowMoves:
    """The harness's backend, with each move out of a block held back ``delay_s`` first:
    a Redis slow to answer that one call (the others go through at once)."""

    def __init__(self, backend: QuotaBackend, delay_s: float) -> None:
        self.backend = backend
        self.delay_s = delay_s

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict:
        await asyncio.sleep(self.delay_s)
        return await self.backend.admit_from_block(block_key, request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class Rig:
    """An ``AdmissionBlocks`` over the harness's backend, and the work it spawned."""

    def __init__(
        self,
        harness: Harness,
        tenant: str,
        tpm: int,
        rpm: int = 10_000,
        move_delay_s: float = 0,
        shadow_tpm: int | None = None,
        sliding: tuple[int, int] | None = None,
    ) -> None:
        """``sliding``: (window_s, bucket_s) of a sliding tpm counter (None: a fixed hour)."""
        self.harness = harness
        self.tenant = tenant
        self.rpm = Counter("rpm", keys.counter_key(tenant, "rpm", "m", WINDOW_S), rpm, WINDOW_S)
        self.tpm = Counter("tpm", keys.counter_key(tenant, "tpm", "m", WINDOW_S), tpm, WINDOW_S)
        if sliding is not None:
            window_s, bucket_s = sliding
            span = keys.window_span("sliding", window_s, bucket_s)
            key = keys.counter_key(tenant, "tpm", "m", window_s, span=span)
            self.tpm = Counter("tpm", key, tpm, window_s, shape="sliding", bucket_s=bucket_s)
        self.tokens: tuple[Counter, ...] = (self.tpm,)
        if shadow_tpm is not None:
            key = keys.counter_key(tenant, "shadow_tpm", "m", WINDOW_S)
            self.tokens += (Counter("shadow_tpm", key, shadow_tpm, WINDOW_S, shadow=True),)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.metrics = Metrics()
        backend = harness.backend
        if move_delay_s:
            backend = cast(QuotaBackend, SlowMoves(backend, move_delay_s))
        self.blocks = AdmissionBlocks(
            backend,
            AdmissionLeaseSpec(enabled=True, fraction=0.05, idle_s=0.05),
            self.metrics,
            self.spawn,
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        return task

    async def settle_spawned(self) -> None:
        while pending := [t for t in self.tasks if not t.done()]:
            await asyncio.gather(*pending)

    def request(self, i: int) -> AdmitRequest:
        return AdmitRequest(
            reservation_key=keys.reservation_key(self.tenant, f"req-{i}"),
            request_counters=(self.rpm,),
            token_counters=self.tokens,
            tokens=PROMPT + OUTPUT,
            usage=UsageTags("p", "m", f"client-{i}", PROMPT),
        )

    async def admit(self, i: int) -> tuple[Verdict, bool]:
        """As ``Admission`` does: here first, else the backend. (verdict, admitted here)"""
        request = self.request(i)
        here = self.blocks.admit_here(request)
        if here is not None:
            return here, True
        return await self.blocks.admit(request), False

    async def finish(self, i: int, output: int) -> None:
        """The meter's calls for request ``i``: a lease, then the settlement."""
        key = self.request(i).reservation_key
        await self.blocks.reserve(key, 1, self.tokens, OUTPUT)
        await self.blocks.settle(key, self.tokens, PROMPT + output, output_tokens=output)

    async def held(self, c: Counter) -> int:
        """What a counter holds now, as the backend tells an admission of nothing on it."""
        probe = AdmitRequest(
            reservation_key=keys.reservation_key(self.tenant, f"probe-{next(_probes)}"),
            request_counters=(),
            token_counters=(c,),
            tokens=0,
            usage=UsageTags("p", "m", "probe", 0),
        )
        [state] = (await self.harness.backend.admit(probe)).states
        return state.limit - state.remaining

    async def books(self) -> list[dict[str, str]]:
        """Asserts counters == ledger net per window; returns the ledger entries."""
        stream = keys.usage_stream_key(self.request(0).reservation_key)
        entries = [fields for _, fields in await self.harness.ledger(stream)]
        net: dict[tuple[str, int], int] = {}
        for entry in entries:
            for part in filter(None, entry["windows"].split(";")):
                kind, _, start, amount = part.split(":")
                net[(kind, int(start))] = net.get((kind, int(start)), 0) + int(amount)
        assert {kind for kind, _ in net} == {c.kind for c in self.tokens}
        for c in self.tokens:
            if c.shape == "sliding":  # one hash of buckets: what it holds in all
                held = sum(v for (kind, _), v in net.items() if kind == c.kind)
                assert await self.held(c) == held, c.kind
                continue
            windows = await self.harness.windows(c)
            ledger = {s: v for (kind, s), v in net.items() if kind == c.kind}
            assert windows == {s: v for s, v in ledger.items() if v or s in windows}, c.kind
        return entries


async def test_after_one_admission_the_next_come_from_a_block_and_the_books_balance(
    harness: Harness,
) -> None:
    await harness.ensure_room(WINDOW_S, 30)
    rig = Rig(harness, "blk-busy", tpm=100_000)
    verdict, here = await rig.admit(0)
    assert verdict.admitted and not here
    await rig.settle_spawned()  # the block is taken
    assert rig.metrics.admission_blocks["taken"] == 1
    results = [await rig.admit(i) for i in range(1, 11)]
    assert all(v.admitted and here for v, here in results)
    assert rig.metrics.local_admissions_total == 10
    # The meter's calls right away: each waits for its record, none is lost.
    await asyncio.gather(*(rig.finish(i, output=10 + i) for i in range(11)))
    await rig.blocks.return_all()
    await rig.settle_spawned()
    entries = await rig.books()
    requests = sorted(e["request_id"] for e in entries if not e["request_id"].startswith("~"))
    assert requests == sorted(f"req-{i}" for i in range(11))
    used = sum(PROMPT + 10 + i for i in range(11))
    assert await harness.total(rig.tpm) == used
    blocks = [e for e in entries if e["request_id"].startswith("~")]
    assert [e["reason"] for e in blocks] == ["returned"]
    assert rig.metrics.admission_blocks["overdrawn"] == 0


async def assert_no_block_taken(rig: Rig, n: int) -> None:
    """``n`` requests, each admitted by the backend, and no block taken after any."""
    for i in range(n):
        verdict, here = await rig.admit(i)
        assert verdict.admitted and not here
        await rig.settle_spawned()
    assert rig.metrics.admission_blocks["taken"] == 0
    assert rig.metrics.local_admissions_total == 0


async def test_near_its_limit_a_tenant_takes_no_block(harness: Harness) -> None:
    await harness.ensure_room(WINDOW_S, 30)
    # 5 % of 400 is 20 tokens: not two requests of 52.
    await assert_no_block_taken(Rig(harness, "blk-tight", tpm=400), 3)


async def test_a_replay_of_a_key_admitted_here_is_the_backend_s_replay(harness: Harness) -> None:
    await harness.ensure_room(WINDOW_S, 30)
    rig = Rig(harness, "blk-replay", tpm=100_000)
    await rig.admit(0)
    await rig.settle_spawned()
    first, here = await rig.admit(1)
    assert first.admitted and here
    again, here_again = await rig.admit(1)  # the same key, while its record is being made
    assert again.admitted and again.replayed and not here_again
    charged = await harness.total(rig.tpm)
    await rig.finish(0, 5)
    await rig.finish(1, 5)
    await rig.blocks.return_all()
    await rig.settle_spawned()
    await rig.books()
    assert await harness.total(rig.tpm) <= charged
    assert await harness.total(rig.tpm) == 2 * (PROMPT + 5)


async def test_an_idle_block_goes_back_and_its_refund_reaches_the_counter(
    harness: Harness,
) -> None:
    await harness.ensure_room(WINDOW_S, 30)
    rig = Rig(harness, "blk-idle", tpm=100_000)
    await rig.admit(0)
    await rig.settle_spawned()
    held = await harness.total(rig.tpm)
    assert held > PROMPT + OUTPUT  # the block is charged
    await rig.finish(0, 3)
    for _ in range(200):  # idle 50 ms, reaped every 100 ms
        await asyncio.sleep(0.05)
        await rig.settle_spawned()
        if rig.metrics.admission_blocks["returned"]:
            break
    assert rig.metrics.admission_blocks["returned"] == 1
    assert await harness.total(rig.tpm) == PROMPT + 3
    await rig.books()


async def test_a_spent_block_sends_requests_to_the_backend_and_is_replaced(
    harness: Harness,
) -> None:
    await harness.ensure_room(WINDOW_S, 30)
    # A block: min(5 % of 20,000, a quarter left) = 1,000 tokens = 19 requests of 52.
    rig = Rig(harness, "blk-spent", tpm=20_000)
    await rig.admit(0)
    await rig.settle_spawned()
    here = 0
    for i in range(1, 60):
        verdict, local = await rig.admit(i)
        assert verdict.admitted
        here += local
        await asyncio.sleep(0)
        if not local:
            await rig.settle_spawned()
    assert rig.metrics.admission_blocks["taken"] >= 2
    assert here >= 50
    await asyncio.gather(*(rig.finish(i, 1) for i in range(60)))
    await rig.blocks.return_all()
    await rig.settle_spawned()
    await rig.books()
    assert await harness.total(rig.tpm) == 60 * (PROMPT + 1)


async def test_a_settlement_and_a_return_right_after_local_admissions_wait_for_the_records(
    harness: Harness,
) -> None:
    """Clients gone before their first token: settled at once, with no lease, and the
    block returned in the same breath. Each settlement finds its record; the return
    refunds only what no request took."""
    await harness.ensure_room(WINDOW_S, 30)
    rig = Rig(harness, "blk-hasty", tpm=100_000, move_delay_s=0.05)
    await rig.admit(0)
    await rig.settle_spawned()
    for i in range(1, 6):
        verdict, here = await rig.admit(i)
        assert verdict.admitted and here
    settled = [
        rig.blocks.settle(rig.request(i).reservation_key, (rig.tpm,), PROMPT, output_tokens=0)
        for i in range(6)
    ]
    results = await asyncio.gather(*settled, rig.blocks.return_all())
    assert all(s.reserved == PROMPT + OUTPUT for s in results[:6]), results
    await rig.settle_spawned()
    entries = await rig.books()
    assert sorted(e["request_id"] for e in entries if not e["request_id"].startswith("~")) == [
        f"req-{i}" for i in range(6)
    ]
    assert rig.metrics.admission_blocks["overdrawn"] == 0
    assert await harness.total(rig.tpm) == 6 * PROMPT


async def test_a_shadow_rule_takes_blocks_and_reports_past_its_limit_exactly(
    harness: Harness,
) -> None:
    """A limit rolled out in shadow beside the enforced one: the tenant is still admitted
    from blocks, and no request a block admitted got past the shadow limit."""
    await harness.ensure_room(WINDOW_S, 30)
    # Blocks of min(5 % of 4,000, a quarter left) = 200 tokens: 3 requests of 52 each.
    rig = Rig(harness, "blk-shadow", tpm=100_000, shadow_tpm=4_000)
    results = []
    for i in range(120):  # nothing settled before the end: the counters only grow
        verdict, here = await rig.admit(i)
        results.append((verdict, here))
        await asyncio.sleep(0)
        if not here:
            await rig.settle_spawned()
    assert all(v.admitted for v, _ in results)  # a shadow rule refuses nothing
    local = [v for v, here in results if here]
    assert len(local) >= 40 and rig.metrics.local_admissions_total == len(local)
    assert all(not v.shadow_refused_by for v in local)
    clean = sum(not v.shadow_refused_by for v, _ in results)
    reported = sum(v.shadow_refused_by == ("shadow_tpm",) for v, _ in results)
    assert clean + reported == 120 and reported > 0
    # Every request admitted without a report was charged within the shadow limit, and
    # reports came at most a block's worth (3 requests) early.
    assert 4_000 // (PROMPT + OUTPUT) - 3 <= clean <= 4_000 // (PROMPT + OUTPUT)
    await asyncio.gather(*(rig.finish(i, 1) for i in range(120)))
    await rig.blocks.return_all()
    await rig.settle_spawned()
    await rig.books()
    assert rig.metrics.admission_blocks["overdrawn"] == 0
    for c in rig.tokens:
        assert await harness.total(c) == 120 * (PROMPT + 1)


async def test_processors_racing_for_blocks_never_take_one_past_a_shadow_limit(
    harness: Harness,
) -> None:
    """Eight processors see the same counters and take blocks at once, each sized from what
    it saw: together they ask for more than is left. The takes past the shadow limit are
    refused, so what the blocks admit without a report still fits in it."""
    await harness.ensure_room(WINDOW_S, 30)
    limit = 4_000
    rigs = [Rig(harness, "blk-race", tpm=100_000, shadow_tpm=limit) for _ in range(8)]
    fill = AdmitRequest(
        reservation_key=keys.reservation_key("blk-race", "fill"),
        request_counters=(rigs[0].rpm,),
        token_counters=rigs[0].tokens,
        tokens=3_400,
        usage=UsageTags("p", "m", "fill", 3_400),
    )
    assert not (await harness.backend.admit(fill)).shadow_refused_by
    ids = itertools.count(1)
    admitted: list[tuple[Rig, int, Verdict, bool]] = []

    async def admit(rig: Rig) -> None:
        i = next(ids)
        admitted.append((rig, i, *await rig.admit(i)))

    # One exact admission each, all at once (so each block is sized before any is taken),
    # then every processor's block taken at once.
    await asyncio.gather(*(admit(rig) for rig in rigs))
    assert not any(here for *_, here in admitted)
    await asyncio.gather(*(rig.settle_spawned() for rig in rigs))
    taken = sum(rig.metrics.admission_blocks["taken"] for rig in rigs)
    refused = sum(rig.metrics.admission_blocks["refused"] for rig in rigs)
    assert taken >= 1 and refused >= 1, (taken, refused)
    for _ in range(4):
        for rig in rigs:
            await admit(rig)
            await rig.settle_spawned()
    assert all(v.admitted for _, _, v, _ in admitted)
    clean = sum(not v.shadow_refused_by for _, _, v, _ in admitted)
    assert any(here for *_, here in admitted) and clean < len(admitted)
    # Every token admitted without a report fits in the shadow limit.
    assert fill.tokens + clean * (PROMPT + OUTPUT) <= limit

    await asyncio.gather(*(rig.finish(i, 1) for rig, i, _, _ in admitted))
    await harness.backend.settle(fill.reservation_key, rigs[0].tokens, 3_400)
    for rig in rigs:
        await rig.blocks.return_all()
        await rig.settle_spawned()
    await rigs[0].books()
    for c in rigs[0].tokens:
        assert await harness.total(c) == 3_400 + len(admitted) * (PROMPT + 1)


async def test_a_sliding_hour_in_minute_buckets_takes_blocks_and_its_books_balance(
    harness: Harness,
) -> None:
    """A block of a sliding counter is charged in the current bucket and used until that
    bucket ends: requests admitted from it count there, as if admitted one by one."""
    await harness.ensure_room(60, 10)  # the test's calls stay in one bucket (well under 1 s)
    rig = Rig(harness, "blk-sliding", tpm=100_000, sliding=(3600, 60))
    verdict, here = await rig.admit(0)
    assert verdict.admitted and not here
    await rig.settle_spawned()
    assert rig.metrics.admission_blocks["taken"] == 1
    results = [await rig.admit(i) for i in range(1, 11)]
    assert all(v.admitted and here for v, here in results)
    await asyncio.gather(*(rig.finish(i, output=10 + i) for i in range(11)))
    await rig.blocks.return_all()
    await rig.settle_spawned()
    await rig.books()
    assert await rig.held(rig.tpm) == sum(PROMPT + 10 + i for i in range(11))
    assert rig.metrics.admission_blocks["overdrawn"] == 0


async def test_a_sliding_limit_admitted_from_blocks_is_never_exceeded(harness: Harness) -> None:
    """Requests that use all they reserved, one after another, until the sliding limit
    refuses: blocks admit many of them, and no more is admitted than the limit holds."""
    await harness.ensure_room(60, 10)
    limit = 4_000
    rig = Rig(harness, "blk-sliding-tight", tpm=limit, sliding=(3600, 60))
    admitted, local = 0, 0
    for i in range(120):
        verdict, here = await rig.admit(i)
        if not verdict.admitted:
            break
        admitted += 1
        local += here
        await rig.finish(i, OUTPUT)  # every token reserved is used
        await rig.settle_spawned()
    else:
        raise AssertionError("the limit never refused")
    assert local >= 20 and admitted * (PROMPT + OUTPUT) <= limit
    # Exact admissions took what the blocks left: the limit is used to the last request.
    assert admitted == limit // (PROMPT + OUTPUT)
    await rig.blocks.return_all()
    await rig.settle_spawned()
    await rig.books()
    assert await rig.held(rig.tpm) == admitted * (PROMPT + OUTPUT)


async def test_sliding_buckets_under_ten_seconds_take_no_block(harness: Harness) -> None:
    await assert_no_block_taken(Rig(harness, "blk-sliding-fine", tpm=100_000, sliding=(600, 5)), 5)


async def test_no_block_is_taken_in_a_sliding_bucket_s_last_seconds(clocked: Clocked) -> None:
    """A sliding counter's block would be used only until its bucket ends: with less than
    MIN_VALID_S of it left none is taken, and the next bucket takes one."""
    rig = Rig(cast(Harness, clocked), "blk-bucket-end", tpm=100_000, sliding=(600, 10))
    now = await clocked.now()
    # 8.x s into a bucket: its last 2 s, whatever real time passes in this test's calls.
    await clocked.travel_to(now - now % 10 + 10 + 8)
    verdict, here = await rig.admit(0)
    assert verdict.admitted and not here
    await rig.settle_spawned()
    assert rig.metrics.admission_blocks["taken"] == 0
    assert rig.metrics.admission_blocks["refused"] == 0  # not asked for: nothing charged
    await clocked.shift(3)  # 1.x s into the next bucket
    verdict, here = await rig.admit(1)
    assert verdict.admitted and not here
    await rig.settle_spawned()
    assert rig.metrics.admission_blocks["taken"] == 1
    await rig.blocks.return_all()
    await rig.settle_spawned()
