"""Admission blocks: a tenant far from its limits is admitted without a quota round trip.

The rule (docs/design-admission-leases.md). After a request of a tenant is admitted the
usual way, the processor takes a *block* of that tenant's budget in the background: a
share of every counter the request was charged on (``fraction`` of each limit, at most a
quarter of what is left), charged in the backend before use like an output lease. While
the block lasts, the tenant's next requests on the same counters are admitted here, from
the block, with no round trip; each one's reservation record is then created off the
request path by moving its share out of the block (``admit_from_block``), and the meter's
first lease or settlement waits for that move. A block is returned (its unused part
refunded) when idle, when spent, before its window ends, when the tenant nears a limit,
and at shutdown.

What stays exact:

* every token a local admission uses was charged before it was admitted, in the window it
  was admitted in: a block is only used until its first window ends, by a deadline taken
  from the time the take was *sent* (so never later than the server's own end);
* a block is a reservation record of this processor's: if the processor dies, a peer
  settles it as used (what a dead processor held is charged, never free), ledger entry
  and all; a request admitted from it whose record was not created yet is covered by it;
* near a limit no block is taken (a block is at most a quarter of what is left, and worth
  at least two requests) and an open one is returned: the last of a budget goes to exact
  admissions, so utilisation is as without blocks.

Counters of fixed and calendar windows take blocks, and sliding ones whose buckets last
``MIN_SLIDING_BUCKET_S`` or more: a sliding counter's charge stays in its bucket, so its
block is used until that bucket ends (a second by default for a minute-long window: too
short to be worth a take). A shadow counter takes blocks like an enforced one: a take
refuses on it too, so a request admitted from a block is one the shadow limit would have
admitted, and near that limit the block goes back and exact admissions report, per
request, what it would have refused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import structlog

from extproc.admission.retry import NoAnswer, until_answered
from extproc.config.schema import AdmissionLeaseSpec, PlanSpec
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import (
    RECORD_TTL_S,
    Absorption,
    AdmitRequest,
    Block,
    Counter,
    CounterState,
    Grant,
    QuotaBackend,
    Settlement,
    SettleReason,
    UsageTags,
    Verdict,
)

log = structlog.get_logger("extproc.admission.blocks")

# A block is used until this long before the deadline its window gives (the return must
# reach the server while the window is live, or the refund is lost), and only taken when
# its windows last at least MIN_VALID_S.
RETURN_MARGIN_S = 0.5
MIN_VALID_S = 2.0
# A block holds at most this share of what is left on each counter: near a limit, none.
LEFT_SHARE = 4
# At least this many requests' worth, or no block.
MIN_REQUESTS = 2
# After a take failed or was refused, the same counters wait this long before the next.
COOLDOWN_S = 1.0
REAP_INTERVAL_S = 0.1
CLOSE_RETURN_S = 2.0
LEASE_WAIT_S = 2.0
# Sliding counters take blocks only in buckets this long: a block lasts until its bucket
# ends and none is taken in a bucket's last MIN_VALID_S, so in shorter buckets it would be
# taken again every few seconds.
MIN_SLIDING_BUCKET_S = 10


Ident = tuple[tuple[Counter, ...], tuple[Counter, ...]]


def _eligible(request: AdmitRequest) -> bool:
    counters = request.request_counters + request.token_counters
    return bool(counters) and all(
        c.shape != "sliding" or c.bucket_s >= MIN_SLIDING_BUCKET_S for c in counters
    )


def _usable_s(counter: Counter, state: CounterState) -> float:
    """Seconds a block taken now could be used on ``counter``: until its window ends, or a
    sliding counter's bucket (its state's reset is one window after that bucket's end)."""
    if counter.shape == "sliding":
        return state.reset_s - counter.window_s
    return state.reset_s


def sliding_plans(plans: Iterable[PlanSpec]) -> list[str]:
    """The names of ``plans`` with a sliding-window rule in buckets under
    ``MIN_SLIDING_BUCKET_S``: the requests charged on one are always admitted the usual
    way, with no block."""
    found = set()
    for plan in plans:
        rules = [r for spec in plan.limits.values() for r in spec.rules]
        if any(
            r.window.kind == "sliding" and r.window.bucket_s < MIN_SLIDING_BUCKET_S
            for r in (*rules, *plan.tenant_rules)
        ):
            found.add(plan.name)
    return sorted(found)


def _costs(request: AdmitRequest) -> list[int]:
    """Per token counter, what the admission charges (as the admit script weighs it)."""
    prompt = min(request.usage.prompt_tokens if request.usage else 0, request.tokens)
    return [
        prompt * c.weights[0] + (request.tokens - prompt) * c.weights[1]
        for c in request.token_counters
    ]


class _Held:
    """One block this processor holds, as this processor counts it."""

    __slots__ = (
        "closing",
        "ident",
        "key",
        "last_used",
        "left",
        "pending",
        "poisoned",
        "slots",
        "states",
        "taken_at",
        "usable_until",
    )

    def __init__(
        self, key: str, ident: Ident, block: Block, slots: int, sent: float, now: float
    ) -> None:
        self.key = key
        self.ident = ident
        self.slots = slots
        self.left = list(block.amounts)
        self.states = block.verdict.states
        self.taken_at = now
        self.last_used = now
        # Sent before the server read its clock: never later than the server's own end.
        self.usable_until = sent + block.valid_s - RETURN_MARGIN_S
        self.pending: set[asyncio.Task[Verdict]] = set()
        self.closing = False
        self.poisoned = False  # a move that never got through: the block stays charged

    def states_now(self, now: float) -> tuple[CounterState, ...]:
        """The counters as the client reads them: what was left after the take, plus
        what this block still holds."""
        held = [self.slots] * len(self.ident[0]) + self.left
        elapsed = now - self.taken_at
        return tuple(
            CounterState(s.kind, s.limit, max(0, s.remaining + h), max(0.0, s.reset_s - elapsed))
            for s, h in zip(self.states, held, strict=True)
        )


class AdmissionBlocks:
    """The quota backend the admission and billing sides use: ``inner`` plus the blocks.

    ``admit_here`` admits from a block or returns None (then ``admit`` goes to the
    backend); ``reserve``, ``settle`` and ``cancel`` of a request admitted here wait for
    its record first. Everything else is ``inner``'s.
    """

    def __init__(
        self,
        inner: QuotaBackend,
        settings: AdmissionLeaseSpec,
        metrics: Metrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        prefix: str = keys.DEFAULT_PREFIX,
    ) -> None:
        self.inner = inner
        self.settings = settings
        self.metrics = metrics
        self.spawn = spawn
        self.prefix = prefix
        self._id = uuid.uuid4().hex[:12]
        self._seq = itertools.count(1)
        self._blocks: dict[Ident, _Held] = {}
        self._taking: dict[Ident, float] = {}  # taking now (inf) or cooling down until
        self._records: dict[str, asyncio.Task[Verdict]] = {}
        self._unrecorded: set[str] = set()  # admitted from a block whose move was given up
        self._reaper: asyncio.Task[None] | None = None
        self._returning: set[asyncio.Task[None]] = set()

    # -- admission ---------------------------------------------------------------------

    def admit_here(self, request: AdmitRequest) -> Verdict | None:
        """Admit ``request`` from a block of its counters, or None (no block, or too small)."""
        if not self._blocks:
            return None
        block = self._blocks.get((request.request_counters, request.token_counters))
        if block is None or block.closing or request.reservation_key in self._records:
            return None
        now = time.monotonic()
        costs = _costs(request)
        if (
            now >= block.usable_until
            or block.slots < 1
            or any(cost > left for cost, left in zip(costs, block.left, strict=True))
        ):
            self._retire(block)  # spent or ending: this request goes to the backend
            return None
        block.slots -= 1
        block.left = [left - cost for left, cost in zip(block.left, costs, strict=True)]
        block.last_used = now
        task = asyncio.get_running_loop().create_task(self._record(block, request))
        block.pending.add(task)
        self._records[request.reservation_key] = task
        self.metrics.local_admissions_total += 1
        return Verdict(admitted=True, states=block.states_now(now))

    async def admit(self, request: AdmitRequest) -> Verdict:
        """The backend's admission (a replay of a key admitted here waits for its record)."""
        await self._recorded(request.reservation_key)
        verdict = await self.inner.admit(request)
        if verdict.admitted and not (verdict.replayed or verdict.local):
            self._consider(request, verdict)
        return verdict

    def _consider(self, request: AdmitRequest, verdict: Verdict) -> None:
        """Take a block of these counters in the background, if the tenant has room."""
        if not self.settings.enabled or not _eligible(request):
            return
        ident = (request.request_counters, request.token_counters)
        if ident in self._blocks or self._taking.get(ident, 0.0) > time.monotonic():
            return
        size = self._size(request, verdict.states)
        if size is None:
            return
        self._taking[ident] = float("inf")
        self.spawn(self._take(ident, request, *size))

    def _size(
        self, request: AdmitRequest, states: tuple[CounterState, ...]
    ) -> tuple[int, int] | None:
        """(tokens, requests) of a block for ``request``'s counters, or None: too little room.

        Per counter, at most ``fraction`` of its limit and a quarter of what is left; worth
        at least ``MIN_REQUESTS`` requests like this one."""
        counters = request.request_counters + request.token_counters
        if len(states) != len(counters) or any(
            _usable_s(c, s) < MIN_VALID_S for c, s in zip(counters, states, strict=True)
        ):
            return None
        share = [
            min(int(c.limit * self.settings.fraction), s.remaining // LEFT_SHARE)
            for c, s in zip(counters, states, strict=True)
        ]
        n_req = len(request.request_counters)
        caps = share[:n_req]  # requests the block may hold
        tokens = 0
        by_weight = [
            room // max(c.weights[0], c.weights[1])
            for c, room in zip(request.token_counters, share[n_req:], strict=True)
            if max(c.weights[0], c.weights[1]) > 0
        ]
        if by_weight:
            tokens = min(by_weight)
            caps.append(tokens // max(1, request.tokens))
        if not caps or min(caps) < MIN_REQUESTS:
            return None
        return tokens, min(caps)

    async def _take(self, ident: Ident, request: AdmitRequest, tokens: int, slots: int) -> None:
        tenant, _ = keys.reservation_names(request.reservation_key)
        key = keys.block_key(tenant, self._id, next(self._seq), self.prefix)
        usage = request.usage or UsageTags()
        charge = AdmitRequest(
            reservation_key=key,
            request_counters=request.request_counters,
            token_counters=request.token_counters,
            tokens=tokens,
            count_refused_attempts=False,
            record_ttl_s=request.record_ttl_s,
            usage=UsageTags(usage.plan, usage.model, "", 0),
        )
        backend = self.inner
        cooldown = time.monotonic() + COOLDOWN_S
        try:
            sent = time.monotonic()
            self.metrics.quota_round_trips_total += 1
            block = await backend.take_block(charge, slots)
        except Exception as exc:
            # It may have been applied, or be applied later: returning the key undoes it
            # either way (a tombstone stops a late take), as cancel does a lost admission.
            self.metrics.admission_blocks["failed"] += 1
            log.warning("block_take_failed", block=key, error=repr(exc))
            self._taking[ident] = cooldown
            counters = (charge.request_counters, charge.token_counters)
            self.spawn(self._retry("return_block", lambda: backend.return_block(key, *counters)))
            return
        now = time.monotonic()
        if not block.verdict.admitted or block.verdict.replayed:
            self.metrics.admission_blocks["refused"] += 1
            self._taking[ident] = cooldown
            return
        self.metrics.admission_blocks["taken"] += 1
        self._taking.pop(ident, None)
        held = _Held(key, ident, block, slots, sent, now)
        if ident in self._blocks or not self.settings.enabled or now >= held.usable_until:
            self._retire(held)
            return
        self._blocks[ident] = held
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _record(self, block: _Held, request: AdmitRequest) -> Verdict:
        """Move ``request``'s share out of ``block`` into its own record, until answered."""
        backend = self.inner

        async def record() -> Verdict:
            self.metrics.quota_round_trips_total += 1
            return await backend.admit_from_block(block.key, request)

        def failed(attempt: int, exc: Exception) -> None:
            self.metrics.backend_errors["admit_from_block"] += 1
            log.warning(
                "block_record_retry",
                request_id=request.reservation_key,
                attempt=attempt,
                error=repr(exc),
            )

        try:
            try:
                verdict = await until_answered(record, failed)
            except NoAnswer:
                block.poisoned = True
                self._unrecorded.add(request.reservation_key)  # the block covers its usage
                self.metrics.settle_errors_total += 1
                log.error(
                    "block_record_failed", block=block.key, request_id=request.reservation_key
                )
                raise RuntimeError(
                    f"no record for {request.reservation_key} from {block.key}"
                ) from None
            if not (verdict.from_block or verdict.replayed):
                # The block was gone (a peer took this processor for dead and settled it as
                # used): the request was admitted, or refused, on its own.
                self.metrics.admission_blocks["overdrawn"] += 1
                log.error("block_overdrawn", block=block.key, request_id=request.reservation_key)
            elif self._near_limit(block, verdict.states):
                self._retire(block)
            return verdict
        finally:
            task = asyncio.current_task()
            if task is not None:
                block.pending.discard(task)
            self._records.pop(request.reservation_key, None)

    def _near_limit(self, block: _Held, states: tuple[CounterState, ...]) -> bool:
        """Less than two blocks' worth left on a counter: the rest of the budget goes to
        exact admissions (and to other processors), so this block goes back."""
        counters = block.ident[0] + block.ident[1]
        if len(states) != len(counters):
            return False
        fraction = self.settings.fraction
        return any(
            s.remaining < 2 * fraction * c.limit for c, s in zip(counters, states, strict=True)
        )

    async def _recorded(self, reservation_key: str, timeout_s: float | None = None) -> None:
        task = self._records.get(reservation_key)
        if task is not None:
            await asyncio.wait([task], timeout=timeout_s)

    # -- returning -----------------------------------------------------------------------

    def _retire(self, block: _Held) -> None:
        """No more admissions from ``block``; it goes back once its moves are through."""
        if block.closing:
            return
        block.closing = True
        if self._blocks.get(block.ident) is block:
            del self._blocks[block.ident]
        task = asyncio.get_running_loop().create_task(self._return(block))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def _reap(self) -> None:
        while self._blocks:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for block in list(self._blocks.values()):
                if (
                    now >= block.usable_until
                    or now - block.last_used >= self.settings.idle_s
                    or not self.settings.enabled
                ):
                    self._retire(block)

    async def _return(self, block: _Held) -> None:
        """Refund what ``block`` holds unused, once every move out of it is through."""
        if block.pending:
            await asyncio.wait(list(block.pending))
        if block.poisoned:
            return  # a request's share may still be in it: it stays charged
        backend = self.inner
        request_counters, token_counters = block.ident
        if await self._retry(
            "return_block",
            lambda: backend.return_block(block.key, request_counters, token_counters),
        ):
            self.metrics.admission_blocks["returned"] += 1

    async def _retry(self, operation: str, call: Callable[[], Coroutine[Any, Any, Any]]) -> bool:
        async def counted() -> None:
            self.metrics.quota_round_trips_total += 1
            await call()

        def failed(attempt: int, exc: Exception) -> None:
            self.metrics.backend_errors[operation] += 1
            log.warning("block_retry", operation=operation, attempt=attempt, error=repr(exc))

        try:
            await until_answered(counted, failed)
        except NoAnswer:
            self.metrics.settle_errors_total += 1
            log.error("block_call_failed", operation=operation)
            return False
        return True

    async def return_all(self) -> None:
        """Return every block (shutdown), and wait for those already going back."""
        held = list(self._blocks.values())
        self._blocks.clear()
        for block in held:
            block.closing = True
        await asyncio.gather(*(self._return(block) for block in held), *self._returning)

    # -- the rest of the backend protocol ------------------------------------------------

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant:
        # A lease waits for the record a while, then goes on (the backend down: its usual
        # answer then). A settlement waits for good: it must find the record if it is made.
        await self._recorded(reservation_key, LEASE_WAIT_S)
        return await self.inner.reserve(reservation_key, seq, token_counters, amount, minimum)

    async def settle(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        used: int,
        *,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
        cached_tokens: int = 0,
        seen_admitted: bool = False,
        usage: UsageTags | None = None,
    ) -> Settlement:
        await self._recorded(reservation_key)
        if reservation_key in self._unrecorded:
            # Admitted from a block whose move never got through: no record was made, and
            # the poisoned block stays charged for it, so nothing more is charged.
            self._unrecorded.discard(reservation_key)
            seen_admitted = False
        return await self.inner.settle(
            reservation_key,
            token_counters,
            used,
            reason=reason,
            output_tokens=output_tokens,
            cached_tokens=cached_tokens,
            seen_admitted=seen_admitted,
            usage=usage,
        )

    async def cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        await self._recorded(reservation_key)
        return await self.inner.cancel(reservation_key, token_counters, tombstone_ttl_s)

    async def take_block(self, request: AdmitRequest, requests: int) -> Block:
        return await self.inner.take_block(request, requests)

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict:
        return await self.inner.admit_from_block(block_key, request)

    async def return_block(
        self,
        block_key: str,
        request_counters: tuple[Counter, ...],
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        return await self.inner.return_block(
            block_key, request_counters, token_counters, tombstone_ttl_s
        )

    async def absorb(self, absorption: Absorption) -> bool:
        return await self.inner.absorb(absorption)

    async def flush(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self.return_all(), timeout_s)
        except TimeoutError:
            log.error("block_return_timeout", held=len(self._blocks))
        return await self.inner.flush(max(0.0, deadline - loop.time()))

    async def check(self) -> None:
        await self.inner.check()

    async def ping(self) -> bool:
        return await self.inner.ping()

    async def close(self) -> None:
        """Return what is still held (``flush`` normally has), then close ``inner``."""
        if self._blocks:
            try:
                await asyncio.wait_for(self.return_all(), CLOSE_RETURN_S)
            except TimeoutError:
                log.error("block_return_timeout", held=len(self._blocks))
        if self._reaper is not None:
            self._reaper.cancel()
        await self.inner.close()
