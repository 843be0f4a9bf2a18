"""The meter's lease: output tokens reserved in the quota backend ahead of delivery.

Admission reserved the first batch; ``Leasing`` holds how much is reserved so far and asks
for the next batch in the background as the stream is delivered (the rule is
``extproc.admission.lease``'s), or at once when an event needs tokens the lease doesn't
cover. A refused lease ends the stream (``exhausted``, and which limit cut it); one refused
while others hold reservations is asked again for up to ``refund_wait_ms``.

A part of ``extproc.billing.meter.ResponseMeter``, apart from it by job: it reads the few
parts of the meter declared below, and only it changes the lease state (``_init_lease``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from extproc.admission.lease import (
    REFUND_RETRY_S,
    cover_lease,
    fair_share,
    lease_due_at,
    next_lease,
    refund_retries,
)
from extproc.admission.limit_names import describe_limit
from extproc.admission.policy import limit_kind
from extproc.tracing import ExchangeSpan, fail

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.metrics import Metrics
    from extproc.quota.base import CounterState, QuotaBackend

log = structlog.get_logger("extproc.billing")


class Leasing:
    # What the lease reads of the meter (``ResponseMeter.__init__`` sets them).
    admitted: Admitted
    backend: QuotaBackend
    metrics: Metrics
    trace: ExchangeSpan | None
    _labels: tuple[str, str]
    _rid: str
    max_output: int
    delivered: int

    def _init_lease(self, admitted: Admitted) -> None:
        self.states: tuple[CounterState, ...] = admitted.states
        self.batch = admitted.policy.batch_tokens
        self.leased = admitted.output_reserved  # output tokens covered so far
        # Delivered tokens at which the next background lease is due (None: never).
        self._lease_due = lease_due_at(self.leased, self.batch, self.max_output)
        self.seq = 0  # lease batch sequence number (idempotency with the request id)
        self.lease_task: asyncio.Task[None] | None = None
        self.exhausted = False
        self.refusals = 0  # leases refused while others held reservations (asked again)
        # The configuration it was admitted under (a reload may have come since).
        self._refusal_retries = refund_retries(admitted.refund_wait_s)
        self.retry_due = False  # the last lease was such a refusal: wait, then ask again
        self.exhausted_code = "tpm_limit_exceeded"
        self.exhausted_what = "tokens per minute"  # the limit that cut, for the message

    def _lease_ahead(self) -> None:
        """Reserve in the background what ``extproc.admission.lease.next_lease`` says is due.

        One batch in hand before the first token (admission's share topped up on the first
        event), the next batch once the current one is half used: at most one batch ahead,
        one lease per batch of output. Partial grants keep a nearly spent budget usable to
        the last token; after one, ``_cover`` leases only when an event needs the tokens.
        """
        due = self._lease_due  # where next_lease turns positive: one compare per event
        if due is None or self.delivered < due:
            return
        if self.lease_task is None and not self.exhausted and not self.refusals:
            amount = next_lease(self.leased, self.delivered, self.batch, self.max_output)
            if amount > 0:
                amount = fair_share(amount, self._room_left())
                self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    async def _cover(self, need: int) -> None:
        while need > self.leased and not self.exhausted:
            if self.lease_task is not None:
                await asyncio.shield(self.lease_task)
                continue
            if self.retry_due:
                # Refused while other requests of the tenant hold reservations: what they
                # don't use comes back when they settle, so ask again shortly.
                await asyncio.sleep(REFUND_RETRY_S)
            amount = cover_lease(self.leased, need, self.batch, self.max_output)
            amount = max(need - self.leased, fair_share(amount, self._room_left()))
            self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    def _room_left(self) -> int | None:
        """Tokens the tightest token counter had left at this request's last charge."""
        enforced = self.admitted.enforced_token_kinds
        rooms = [s.remaining for s in self.states if s.kind in enforced]
        return min(rooms) if rooms else None

    async def _lease(self, amount: int, minimum: int) -> None:
        self.seq += 1
        metrics = self.metrics
        metrics.quota_round_trips_total += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        span = None
        if self.trace is not None:
            span = self.trace.child("extproc.lease", **{"extproc.seq": self.seq})
            span.set_attribute("extproc.amount", amount)
        try:
            grant = await self.backend.reserve(
                self.admitted.reservation_key,
                self.seq,
                self.admitted.policy.token_counters,
                amount,
                minimum,
            )
        except Exception as exc:  # fail closed: no tokens without a charge
            log.error("lease_failed", request_id=self._rid, error=repr(exc))
            # The backend failed, not the budget: the client is told so, not "limit reached".
            self.exhausted_code = "quota_unavailable"
            metrics.backend_errors["reserve"] += 1
            metrics.lease_batches[(*self._labels, "failed")] += 1
            if span is not None:
                fail(span, exc)
                span.end()
            self.exhausted = True
            self.lease_task = None
            return
        finally:
            metrics.observe("backend", ("reserve",), loop.time() - started)
        if grant.replayed:
            metrics.replays["reserve"] += 1
        if span is not None:
            span.set_attribute("extproc.granted", grant.granted)
            span.end()
        self.retry_due = False
        if grant.granted > 0:
            metrics.lease_batches[(*self._labels, "granted")] += 1
            metrics.tokens_reserved[self._labels] += grant.granted
            self.leased += grant.granted
            self._lease_due = lease_due_at(self.leased, self.batch, self.max_output)
            self.states = grant.states or self.states
            for shadow in grant.shadow_cut_by:
                # Granted all the same: a shadow limit only reports the cut it would make.
                kind = limit_kind(shadow)
                metrics.shadow_violations[(*self._labels, kind, "cut")] += 1
                log.warning("shadow_limit_would_cut", request_id=self._rid, kind=kind)
        elif grant.others_open > 0 and self.refusals < self._refusal_retries:
            # A budget full of others' unused leases is not used up: ask again for up to
            # refund_wait_ms; refused with nobody else open, the stream is cut at once.
            self.refusals += 1
            self.retry_due = True
            metrics.lease_batches[(*self._labels, "deferred")] += 1
        elif not grant.states:
            # No counter was read: the backend holds no open record of this request (Redis
            # lost the admission). The backend failed, not the budget; settlement charges it.
            log.error("lease_record_lost", request_id=self._rid)
            self.exhausted = True
            self.exhausted_code = "quota_unavailable"
            metrics.lease_batches[(*self._labels, "failed")] += 1
        else:
            self.exhausted = True
            metrics.lease_batches[(*self._labels, "refused")] += 1
            enforced = self.admitted.policy.enforced(grant.states)
            if enforced:
                tightest = min(enforced, key=lambda s: s.remaining / max(1, s.limit))
                counters = self.admitted.policy.token_counters
                counter = next((c for c in counters if c.kind == tightest.kind), None)
                if counter is not None:
                    self.exhausted_code, self.exhausted_what = describe_limit(counter)
        self.lease_task = None
