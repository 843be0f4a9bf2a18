"""What the backend could not take yet: settlements, cancels and absorbs, applied later.

A bounded FIFO, one entry per kind and key (all three calls are idempotent on their key).
One worker applies them whenever their shard's breaker is closed, so they go in as soon as
Redis returns, with or without traffic. A full queue drops the new entry (counted, logged
as an error): a dropped settlement leaves its reservation charged as leased, a dropped
absorb under-charges. ``flush`` waits for the queue to empty (shutdown); ``close`` logs
what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import structlog

from extproc.metrics import Metrics
from extproc.quota.base import (
    RECORD_TTL_S,
    SETTLED_TTL_S,
    Absorption,
    Counter,
    QuotaBackend,
    QuotaUnavailable,
    SettleReason,
    UsageTags,
)
from extproc.quota.resilience.breaker import Breakers, CircuitOpen

log = structlog.get_logger("extproc.quota.resilient")

DRAIN_BATCH = 32  # queued calls applied concurrently
MAX_OP_ATTEMPTS = 100  # failed tries (breaker closed) before a queued call is given up
SEEN_RETRY_S = SETTLED_TTL_S - 30.0  # a queued settle charges a lost record until then

OpKind = Literal["settle", "cancel", "absorb"]


@dataclass(slots=True)
class Op:
    """A call waiting for the backend; idempotent on ``key``."""

    kind: OpKind
    key: str
    counters: tuple[Counter, ...] = ()
    used: int = 0  # settle
    reason: SettleReason = "completed"  # settle: for the usage ledger
    output_tokens: int | None = None  # settle
    cached_tokens: int = 0  # settle
    # settle: the admission was seen answered (``QuotaBackend.settle``); kept while a retry
    # could not be a replay of a first try whose settled record has expired since.
    seen_admitted: bool = False
    usage: UsageTags | None = None  # settle: what admission recorded, for a lost one's entry
    ttl_s: int = RECORD_TTL_S  # cancel: tombstone lifetime
    absorption: Absorption | None = None  # absorb
    tokens: int = 0  # absorb: tokens served locally
    attempts: int = 0
    queued_at: float = field(default_factory=time.monotonic)


class RetryQueue:
    def __init__(
        self,
        backend: QuotaBackend,
        breakers: Breakers,
        metrics: Metrics,
        queue_max: int,
        retry_pause_s: float,
    ) -> None:
        self.backend = backend
        self.breakers = breakers
        self.metrics = metrics
        self.queue_max = queue_max
        self.retry_pause_s = retry_pause_s  # after a round with failures
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._pending: OrderedDict[tuple[OpKind, str], Op] = OrderedDict()
        self._worker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def wake(self) -> None:
        """A breaker closed: what waited for it may go."""
        self._wake.set()

    def put(self, op: Op) -> bool:
        """Queue a call for when the backend returns; False when the queue is full."""
        ident = (op.kind, op.key)
        if ident in self._pending:
            return True
        if len(self._pending) >= self.queue_max:
            self.metrics.quota_queue_dropped_total += 1
            log.error(
                "quota_queue_full_dropped",
                kind=op.kind,
                request_id=op.key,
                used=op.used,
                tokens=op.tokens,
                queue_max=self.queue_max,
            )
            return False
        self._pending[ident] = op
        self.metrics.quota_queued_total += 1
        self.metrics.quota_queue_depth = len(self._pending)
        self._empty.clear()
        self._wake.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return True

    async def _apply(self, op: Op) -> None:
        backend, guarded = self.backend, self.breakers.guarded
        if op.kind == "settle":
            # A first try may have been applied before its answer was lost; its settled
            # record answers a retry only while it lives (SETTLED_TTL_S from that try).
            seen = op.seen_admitted and time.monotonic() - op.queued_at < SEEN_RETRY_S
            settled = await guarded(
                op.key,
                lambda: backend.settle(
                    op.key,
                    op.counters,
                    op.used,
                    reason=op.reason,
                    output_tokens=op.output_tokens,
                    cached_tokens=op.cached_tokens,
                    seen_admitted=seen,
                    usage=op.usage,
                ),
            )
            if settled.record_lost:
                self.metrics.lost_admissions_charged_total += 1
                log.warning("admission_record_lost", request_id=op.key, used=op.used)
        elif op.kind == "cancel":
            await guarded(op.key, lambda: backend.cancel(op.key, op.counters, op.ttl_s))
        elif op.absorption is not None:
            absorption = op.absorption
            await guarded(op.key, lambda: backend.absorb(absorption))
            self.metrics.reconciled_reservations_total += 1
            self.metrics.reconciled_tokens_total += op.tokens

    async def _drain(self) -> None:
        """Apply queued calls, oldest first, whenever their shard's breaker is closed."""
        while True:
            if not self._pending:
                self._empty.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            ready = (op for op in self._pending.values() if not self.breakers.is_open(op.key))
            batch = list(itertools.islice(ready, DRAIN_BATCH))
            if not batch:  # every call waits for an open breaker: until one closes or more come
                self._wake.clear()
                await self._wake.wait()
                continue
            results = await asyncio.gather(
                *(self._apply(op) for op in batch), return_exceptions=True
            )
            failed = False
            for op, result in zip(batch, results, strict=True):
                if isinstance(result, CircuitOpen):
                    continue  # not tried: waits for the breaker to close
                if isinstance(result, QuotaUnavailable):
                    failed = True
                    op.attempts += 1
                    if op.attempts < MAX_OP_ATTEMPTS:
                        continue
                    self._give_up(op, result)
                elif isinstance(result, BaseException):
                    self._give_up(op, result)
                else:
                    self.metrics.quota_queue_applied_total += 1
                self._pending.pop((op.kind, op.key), None)
            self.metrics.quota_queue_depth = len(self._pending)
            if failed:
                await asyncio.sleep(self.retry_pause_s)

    def _give_up(self, op: Op, error: BaseException) -> None:
        self.metrics.quota_queue_dropped_total += 1
        log.error(
            "quota_queue_gave_up",
            kind=op.kind,
            request_id=op.key,
            used=op.used,
            tokens=op.tokens,
            attempts=op.attempts,
            error=repr(error),
        )

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call is applied, at most ``timeout_s``; True when done."""
        if not self._pending:
            return True
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._empty.wait()
        except TimeoutError:
            log.error("quota_queue_unflushed", pending=len(self._pending), **self.lost())
            return False
        return True

    def lost(self) -> dict[str, int]:
        """What the queue holds, by kind: what is lost if the process stops now."""
        kinds = [op.kind for op in self._pending.values()]
        return {
            "settlements": kinds.count("settle"),
            "cancels": kinds.count("cancel"),
            "absorbs": kinds.count("absorb"),
            "absorb_tokens": sum(op.tokens for op in self._pending.values()),
        }

    async def stop(self) -> None:
        """Stop the worker (what is queued stays, see ``lost``)."""
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
