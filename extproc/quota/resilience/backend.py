"""Redis faults: a circuit breaker, fail-open admission from a local allowance, and a queue
for what the backend could not take (settlements, cancels, reconciliations).

``ResilientQuotaBackend`` wraps the Redis backend and implements the same protocol; the
factory puts it around every Redis URL (``memory://`` cannot fail and is not wrapped). Its
parts: the breakers (``breaker``), the allowance (``allowance``), the queue (``queue``).

**Breaker.** One per shard: the server that serves a call's key now (``shard_of``: each
master of a Redis Cluster, the one server otherwise), so a dead master stops only the
tenants whose slots it serves. Every call that reaches Redis and fails (``QuotaUnavailable``,
timeouts included) counts against its shard; ``failures`` consecutive ones open that
shard's breaker. While it is open no call for that shard reaches Redis: each fails at once
with ``CircuitOpen`` (a ``QuotaUnavailable`` saying the call was never sent), and the only
traffic to it is one probe every ``probe_interval_s``, one at a time (``probe``: a PING, or
on a Cluster "no slot is served there any more", once a replica has taken its slots over:
their calls then go to the new master, whose breaker is its own). The first probe that
succeeds closes the breaker. Fail-open admissions and leases and the queue below follow
each call's own shard.

**Fail open.** A request whose counters all carry ``fail_open_limit`` (its plan says
``on_backend_failure: open``; the policy resolver sets it to ``limit × fail_open_fraction``,
rounded up) is admitted, when Redis cannot answer, from an in-process ``MemoryQuotaBackend``
whose limits are those allowances: each processor serves at most that share of every limit
per window on its own clock. The workers of one ``serve --workers N`` are one processor
here: each takes ``⌈allowance / N⌉`` (``fail_open_workers``), so the host serves the
allowance, not N times it (one more per worker at most, from rounding up). The verdict
carries no counter states (the real remaining budget is unknown, so no ``x-ratelimit-*``
headers). A request the allowance cannot cover raises ``QuotaUnavailable`` (the client gets
503 ``quota_unavailable``, as on a closed plan).
A reservation admitted locally stays local to its end (its leases too). A stream admitted
by Redis whose lease batch Redis cannot answer gets that batch from the local allowance
instead of being cut; a closed plan's lease raises, and the meter cuts the stream.

**Reconciliation.** When a reservation that was served locally settles, its local part is
released from the allowance and charged into Redis by one ``absorb`` script call keyed
``<reservation key>:absorb``, so it applies once however often it is retried: each token
goes into the window it was served in when that window is still live, into the current
window otherwise (it is never dropped). The local part of a stream Redis admitted is what
it used beyond what Redis reserved for it (``used - min(used, reserved in Redis)``); the rest
settles in Redis as usual. A local admission's RPM is absorbed too, unless Redis may have
seen the admission (its call failed with an unknown outcome): that key is cancelled in Redis
instead, whose record keeps the attempt if the admission ran. RPM of refused local attempts
is not reconciled.

**Ledger.** An absorb that carries a settlement's local part appends that part's usage
ledger entry in the same script (reserved = used, nothing refunded; ``windows`` names the
current windows it was charged to): a stream Redis admitted that leased locally during a
pause has two entries with the same ``request_id``. A local RPM-only admission has none.

**Queue.** Settlements, cancels and absorbs Redis cannot take now wait in a bounded FIFO
(one entry per kind and key; all three are idempotent on their key). One worker applies
them whenever the breaker is closed, so they go in as soon as Redis returns, with or
without traffic. A full queue drops the new entry (counted, logged as an error): a dropped
settlement leaves its reservation charged as leased, a dropped absorb under-charges.
``flush`` waits for the queue to empty (shutdown); ``close`` logs what is left.

The queue lives in this process only. What it still holds when the process dies (or
stops with Redis still away) is not lost from the books: a queued settlement or cancel
belongs to a record that is still open in Redis, in this processor's open set
(``admit.lua``), and a live peer settles it at what it reserved once this processor's
heartbeat is gone (``extproc.quota.liveness``): billed as charged. Queued absorbs (what was
served from the allowance) die with the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from extproc.metrics import Metrics
from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    Absorption,
    AdmitRequest,
    Block,
    Counter,
    Grant,
    QuotaMisconfigured,
    QuotaUnavailable,
    Settlement,
    SettleReason,
    UsageTags,
    Verdict,
)
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.resilience.allowance import Allowance, Tracked, absorb_key
from extproc.quota.resilience.breaker import Breakers, CircuitOpen
from extproc.quota.resilience.queue import Op, RetryQueue

log = structlog.get_logger("extproc.quota.resilient")

__all__ = ["CircuitOpen", "Resilience", "ResilientQuotaBackend", "absorb_key"]


@dataclass(frozen=True, slots=True)
class Resilience:
    """Settings of the wrapper: the breaker (``circuit_breaker`` in the configuration) and
    the bound of the queue (``settle_queue_max``)."""

    failures: int = 5
    probe_interval_s: float = 0.5
    queue_max: int = 100_000
    fail_open_workers: int = 1  # worker processes sharing the host's fail-open allowance


def _zeros(counters: tuple[Counter, ...]) -> tuple[int, ...]:
    return tuple(0 for _ in counters)


class ResilientQuotaBackend:
    def __init__(
        self,
        primary: RedisQuotaBackend,
        *,
        failures: int = 5,
        probe_interval_s: float = 0.5,
        queue_max: int = 100_000,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        fail_open_workers: int = 1,
    ) -> None:
        if failures < 1 or probe_interval_s <= 0 or queue_max < 1 or fail_open_workers < 1:
            raise ValueError(
                "need failures >= 1, probe_interval_s > 0, queue_max >= 1 and "
                "fail_open_workers >= 1"
            )
        self.fail_open_workers = fail_open_workers
        self.primary = primary
        self.metrics = metrics if metrics is not None else Metrics()
        self.failures = failures
        self.probe_interval_s = probe_interval_s
        self.queue_max = queue_max
        self.breakers = Breakers(
            primary,
            self.metrics,
            failures,
            probe_interval_s,
            queued=lambda: len(self.queue),
            on_close=lambda: self.queue.wake(),
        )
        self.queue = RetryQueue(primary, self.breakers, self.metrics, queue_max, probe_interval_s)
        self.allowance = Allowance(self.metrics, fail_open_workers, clock)
        self.local = self.allowance.local

    @property
    def breaker_open(self) -> bool:
        """Some shard's breaker is open."""
        return self.breakers.any_open

    def open_shards(self) -> list[str]:
        """The shards whose breaker is open."""
        return self.breakers.open_shards()

    @property
    def pending(self) -> int:
        """Calls waiting in the queue."""
        return len(self.queue)

    # -- admission -------------------------------------------------------------------------

    async def admit(self, request: AdmitRequest) -> Verdict:
        self.allowance.sweep()
        key = request.reservation_key
        try:
            verdict = await self.breakers.guarded(key, lambda: self.primary.admit(request))
        except QuotaMisconfigured:
            raise  # fail closed even on an open plan: no allowance hides a broken ACL
        except CircuitOpen:
            if not request.fail_open:
                self.allowance.remember_unsent(key)
                raise
            return await self._admit_locally(request, sent=False)
        except QuotaUnavailable:
            if not request.fail_open:
                raise
            return await self._admit_locally(request, sent=True)
        if verdict.admitted and request.token_counters and request.fail_open:
            self.allowance.track(key, request)
        return verdict

    async def _admit_locally(self, request: AdmitRequest, sent: bool) -> Verdict:
        """Admit from the local allowance; ``sent``: Redis may have seen the admission."""
        key = request.reservation_key
        tracked = await self.allowance.admit(request, sent)
        if sent:
            # The admission may have run in Redis (or may still run, from a paused server):
            # cancel it there. What is served here is charged by the absorb at settlement.
            self.queue.put(Op("cancel", key, request.token_counters))
        if request.token_counters:
            self.allowance.tracked[key] = tracked
        else:  # nothing will be settled: the RPM is reconciled now
            self._absorb(key, tracked, (), 0)
        return Verdict(admitted=True, local=True)

    # -- leases ----------------------------------------------------------------------------

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant:
        tracked = self.allowance.tracked.get(reservation_key)
        if tracked is not None and (tracked.local or tracked.redis_lost):
            return await self.allowance.reserve(
                tracked, reservation_key, seq, token_counters, amount, minimum
            )
        try:
            grant = await self.breakers.guarded(
                reservation_key,
                lambda: self.primary.reserve(reservation_key, seq, token_counters, amount, minimum),
            )
        except QuotaUnavailable as exc:
            if tracked is None or isinstance(exc, QuotaMisconfigured):
                raise
            return await self.allowance.reserve(
                tracked, reservation_key, seq, token_counters, amount, minimum
            )
        if tracked is not None:
            if grant.granted == 0 and not grant.states:
                # Not a refusal (that carries states): Redis lost the admitted record (it
                # restarted). The stream goes on from the local allowance.
                tracked.redis_lost = True
                log.warning("quota_record_lost", request_id=reservation_key)
                return await self.allowance.reserve(
                    tracked, reservation_key, seq, token_counters, amount, minimum
                )
            if not grant.replayed:
                tracked.redis_reserved += grant.granted
        return grant

    # -- settlement ------------------------------------------------------------------------

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
        windows.check_settle(used, token_counters)
        windows.check_reason(reason, output_tokens, used)
        tracked = self.allowance.tracked.pop(reservation_key, None)
        if tracked is None or not tracked.local_record:
            return await self._settle_remote(
                reservation_key,
                token_counters,
                used,
                reason,
                output_tokens,
                cached_tokens,
                seen_admitted,
                usage,
            )
        # Redis reserved the oldest part of the request, so it takes the oldest usage.
        used_remote = 0 if tracked.local else min(used, tracked.redis_reserved)
        used_local = used - used_remote
        local = await self.local.settle(
            reservation_key, self.allowance.counters(token_counters), used_local, reason=reason
        )
        # The ledger's split: the prompt came first, so Redis's part holds it first.
        remote_output = local_output = None
        if output_tokens is not None:
            remote_output = used_remote - min(used - output_tokens, used_remote)
            local_output = output_tokens - remote_output
        self._absorb(reservation_key, tracked, token_counters, used_local, reason, local_output)
        if tracked.local:
            return Settlement(
                reserved=local.reserved,
                used=used,
                refunded=local.refunded,
                refunded_per_counter=local.refunded_per_counter,
                queued=True,
            )
        # Two ledger entries for this request: Redis's part here, the absorbed one on its own.
        remote = await self._settle_remote(
            reservation_key,
            token_counters,
            used_remote,
            reason,
            remote_output,
            0,
            seen_admitted,
            usage,
        )
        return Settlement(
            reserved=remote.reserved + local.reserved,
            used=used,
            refunded=remote.refunded,
            already_settled=remote.already_settled,
            refunded_per_counter=remote.refunded_per_counter,
            queued=True,
        )

    async def _settle_remote(
        self,
        key: str,
        token_counters: tuple[Counter, ...],
        used: int,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
        cached_tokens: int = 0,
        seen_admitted: bool = False,
        usage: UsageTags | None = None,
    ) -> Settlement:
        try:
            return await self.breakers.guarded(
                key,
                lambda: self.primary.settle(
                    key,
                    token_counters,
                    used,
                    reason=reason,
                    output_tokens=output_tokens,
                    cached_tokens=cached_tokens,
                    seen_admitted=seen_admitted,
                    usage=usage,
                ),
            )
        except QuotaUnavailable as exc:
            op = Op("settle", key, token_counters, used=used, reason=reason)
            op.output_tokens = output_tokens
            op.cached_tokens = cached_tokens
            op.seen_admitted, op.usage = seen_admitted, usage
            queued = self.queue.put(op)
            if queued:
                log.info("settle_queued", request_id=key, used=used, error=repr(exc))
            zeros = _zeros(token_counters)
            return Settlement(
                reserved=0, used=used, refunded=0, refunded_per_counter=zeros, queued=queued
            )

    async def cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        windows.check_cancel(tombstone_ttl_s, token_counters)
        zeros = _zeros(token_counters)
        if self.allowance.is_unsent(reservation_key):  # the admission never left this process
            self.allowance.forget_unsent(reservation_key)
            return Settlement(reserved=0, used=0, refunded=0, refunded_per_counter=zeros)
        tracked = self.allowance.tracked.get(reservation_key)
        if tracked is not None and tracked.local:
            return await self.settle(reservation_key, token_counters, 0)
        if tracked is not None and tracked.local_record:
            del self.allowance.tracked[reservation_key]
            await self.local.cancel(reservation_key, self.allowance.counters(token_counters))
        try:
            return await self.breakers.guarded(
                reservation_key,
                lambda: self.primary.cancel(reservation_key, token_counters, tombstone_ttl_s),
            )
        except QuotaUnavailable:
            queued = self.queue.put(
                Op("cancel", reservation_key, token_counters, ttl_s=tombstone_ttl_s)
            )
            return Settlement(
                reserved=0, used=0, refunded=0, refunded_per_counter=zeros, queued=queued
            )

    # -- admission blocks: straight through (no queue, no allowance) ---------------------------

    async def take_block(self, request: AdmitRequest, requests: int) -> Block:
        """Redis's answer, or ``QuotaUnavailable``: the caller admits directly instead (and
        returns the key, whose block may have been charged)."""
        key = request.reservation_key
        return await self.breakers.guarded(key, lambda: self.primary.take_block(request, requests))

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict:
        """Redis's answer, or ``QuotaUnavailable`` (the outcome unknown: cancel the key)."""
        key = request.reservation_key
        return await self.breakers.guarded(
            key, lambda: self.primary.admit_from_block(block_key, request)
        )

    async def return_block(
        self,
        block_key: str,
        request_counters: tuple[Counter, ...],
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        """Redis's answer, or ``QuotaUnavailable`` (retry it: it is idempotent)."""
        return await self.breakers.guarded(
            block_key,
            lambda: self.primary.return_block(
                block_key, request_counters, token_counters, tombstone_ttl_s
            ),
        )

    # -- reconciliation --------------------------------------------------------------------

    def _absorb(
        self,
        key: str,
        tracked: Tracked,
        token_counters: tuple[Counter, ...],
        used: int,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
    ) -> None:
        """Queue the charge of what a reservation used locally, window by window."""
        absorption = self.allowance.absorption(
            key, tracked, token_counters, used, reason, output_tokens
        )
        if absorption is not None:
            self.queue.put(Op("absorb", absorption.key, absorption=absorption, tokens=used))

    async def absorb(self, absorption: Absorption) -> bool:
        """Queued, applied once the shard's breaker lets it (True: taken)."""
        tokens = sum(amount for *_, amount in absorption.entries)
        return self.queue.put(Op("absorb", absorption.key, absorption=absorption, tokens=tokens))

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call is applied, at most ``timeout_s``; True when done."""
        return await self.queue.flush(timeout_s)

    # -- housekeeping ----------------------------------------------------------------------

    async def ping(self) -> bool:
        return await self.primary.ping()

    async def check(self) -> None:
        await self.primary.check()

    async def close(self) -> None:
        await self.queue.stop()
        await self.breakers.close()
        if len(self.queue):
            log.error("quota_queue_lost", pending=len(self.queue), **self.queue.lost())
        await self.primary.close()
        await self.local.close()
