"""One circuit breaker per shard: the server that serves a call's key now.

``failures`` consecutive calls that reach Redis and fail (``QuotaUnavailable``, timeouts
included) open their shard's breaker. While it is open no call for that shard is sent:
each fails at once with ``CircuitOpen``, and one probe every ``probe_interval_s``, one at
a time, asks whether calls may go again (a PING, or on a Cluster "no slot is served there
any more"); the first that succeeds closes the breaker. A configuration error
(``QuotaMisconfigured``: Redis answered, and refused) is not an outage: the breaker is left
alone and the error logged once a minute per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from extproc.metrics import Metrics
from extproc.quota.base import QuotaMisconfigured, QuotaUnavailable

log = structlog.get_logger("extproc.quota.resilient")
T = TypeVar("T")

# A configuration error (ACL, credentials) is logged once per this many seconds per message.
CONFIG_ERROR_LOG_S = 60.0


class CircuitOpen(QuotaUnavailable):
    """The breaker is open: the call was not sent to the backend at all."""


class Sharded(Protocol):
    """What the breakers need of a backend (``RedisQuotaBackend`` provides it)."""

    def shard_of(self, key: str) -> str: ...

    async def probe(self, shard: str) -> bool: ...


@dataclass(slots=True)
class _Breaker:
    """The circuit breaker of one shard (``RedisQuotaBackend.shard_of``)."""

    shard: str
    consecutive: int = 0
    open: bool = False
    prober: asyncio.Task[None] | None = None


class Breakers:
    def __init__(
        self,
        backend: Sharded,
        metrics: Metrics,
        failures: int,
        probe_interval_s: float,
        queued: Callable[[], int],
        on_close: Callable[[], None],
    ) -> None:
        """``queued``: calls waiting (for the logs); ``on_close``: a breaker closed."""
        self.backend = backend
        self.metrics = metrics
        self.failures = failures
        self.probe_interval_s = probe_interval_s
        self._queued = queued
        self._on_close = on_close
        self._breakers: dict[str, _Breaker] = {}
        self._config_error_logged: dict[str, float] = {}

    @property
    def any_open(self) -> bool:
        return any(b.open for b in self._breakers.values())

    def open_shards(self) -> list[str]:
        return [b.shard for b in self._breakers.values() if b.open]

    def _breaker(self, key: str) -> _Breaker:
        shard = self.backend.shard_of(key)
        breaker = self._breakers.get(shard)
        if breaker is None:
            breaker = self._breakers[shard] = _Breaker(shard)
        return breaker

    def is_open(self, key: str) -> bool:
        breaker = self._breakers.get(self.backend.shard_of(key))
        return breaker is not None and breaker.open

    async def guarded(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call``, unless the breaker of ``key``'s shard is open; its failure counts."""
        breaker = self._breaker(key)
        if breaker.open:
            self.metrics.quota_short_circuited_total += 1
            raise CircuitOpen("quota backend unavailable (circuit breaker open)")
        self.metrics.quota_backend_calls_total += 1
        try:
            result = await call()
        except QuotaMisconfigured as exc:
            # Redis answered, and refused: not an outage, so the breaker is left alone (a
            # probe's PING would pass and close it again, round and round). Each call
            # fails closed after its one round trip; one log line says what to fix.
            self._misconfigured(exc)
            raise
        except QuotaUnavailable:
            self._failed(breaker)
            raise
        breaker.consecutive = 0
        return result

    def _misconfigured(self, exc: QuotaMisconfigured) -> None:
        self.metrics.quota_config_errors[exc.kind] += 1
        message = str(exc)
        now = time.monotonic()
        if now - self._config_error_logged.get(message, -CONFIG_ERROR_LOG_S) >= CONFIG_ERROR_LOG_S:
            self._config_error_logged[message] = now
            log.error("quota_backend_misconfigured", kind=exc.kind, error=message)

    def _failed(self, breaker: _Breaker) -> None:
        self.metrics.quota_backend_failures_total += 1
        breaker.consecutive += 1
        if breaker.open or breaker.consecutive < self.failures:
            return
        breaker.open = True
        self.metrics.quota_breaker_open = len(self.open_shards())
        self.metrics.quota_breaker_opened_total += 1
        log.error(
            "quota_breaker_open",
            shard=breaker.shard,
            failures=breaker.consecutive,
            probe_interval_s=self.probe_interval_s,
            pending=self._queued(),
        )
        breaker.prober = asyncio.get_running_loop().create_task(self._probe(breaker))

    async def _probe(self, breaker: _Breaker) -> None:
        """One probe every ``probe_interval_s`` while open; the first that succeeds closes."""
        while breaker.open:
            await asyncio.sleep(self.probe_interval_s)
            self.metrics.quota_breaker_probes_total += 1
            try:
                up = await self.backend.probe(breaker.shard)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                up = False  # something under the probe was cancelled, not the prober
            except Exception:
                up = False
            if up:
                breaker.open = False
                breaker.consecutive = 0
                self.metrics.quota_breaker_open = len(self.open_shards())
                self._on_close()
                log.warning("quota_breaker_closed", shard=breaker.shard, pending=self._queued())

    async def close(self) -> None:
        for breaker in self._breakers.values():
            task = breaker.prober
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
