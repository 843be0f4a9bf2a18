"""Redis faults: a circuit breaker, fail-open admission from a local allowance, and a queue
for what the backend could not take (settlements, cancels, reconciliations).

``ResilientQuotaBackend`` wraps the Redis backend and implements the same protocol; the
factory puts it around every Redis URL (``memory://`` cannot fail and is not wrapped).

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
heartbeat is gone (``extproc.quota.liveness.orphans``): billed as charged. Queued absorbs (what was
served from the allowance) die with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import structlog

from extproc.metrics import Metrics
from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    AdmitRequest,
    Counter,
    Grant,
    LedgerSettings,
    QuotaMisconfigured,
    QuotaUnavailable,
    Settlement,
    SettleReason,
    UsageTags,
    Verdict,
)
from extproc.quota.keys import usage_stream_key, window_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import (
    WINDOW_RETRIES,
    RedisQuotaBackend,
    WrongWindow,
    load_lua,
)
from extproc.quota.redis.resp import Script

log = structlog.get_logger("extproc.quota.resilience.backend")
T = TypeVar("T")


DRAIN_BATCH = 32  # queued calls applied concurrently
MAX_OP_ATTEMPTS = 100  # failed tries (breaker closed) before a queued call is given up
UNSENT_MAX = 100_000  # remembered keys whose admission never reached Redis
SWEEP_INTERVAL_S = 60.0
# A configuration error (ACL, credentials) is logged once per this many seconds per message.
CONFIG_ERROR_LOG_S = 60.0

OpKind = Literal["settle", "cancel", "absorb"]


@dataclass(frozen=True, slots=True)
class Resilience:
    """Settings of the wrapper: the breaker (``circuit_breaker`` in the configuration) and
    the bound of the queue (``settle_queue_max``)."""

    failures: int = 5
    probe_interval_s: float = 0.5
    queue_max: int = 100_000
    fail_open_workers: int = 1  # worker processes sharing the host's fail-open allowance


class CircuitOpen(QuotaUnavailable):
    """The breaker is open: the call was not sent to the backend at all."""


def absorb_key(reservation_key: str) -> str:
    """Record of a reservation's reconciliation; an encoded request id never holds ``:``."""
    return reservation_key + ":absorb"


def _local(counters: tuple[Counter, ...], workers: int = 1) -> tuple[Counter, ...]:
    """The counters with this process's share of the host's allowance as their limits."""
    return tuple(
        Counter(c.kind, c.key, -(-(c.fail_open_limit or 0) // workers), c.window_s)
        for c in counters
    )


def _zeros(counters: tuple[Counter, ...]) -> tuple[int, ...]:
    return tuple(0 for _ in counters)


@dataclass(slots=True)
class _Breaker:
    """The circuit breaker of one shard (``RedisQuotaBackend.shard_of``)."""

    shard: str
    consecutive: int = 0
    open: bool = False
    prober: asyncio.Task[None] | None = None


@dataclass(slots=True)
class _Tracked:
    """A fail-open request with token counters, from its admission to its settlement."""

    created: float
    redis_reserved: int = 0  # tokens Redis reserved for it (admission + batches), as known
    local: bool = False  # admitted from the local allowance: everything stays local
    redis_lost: bool = False  # Redis no longer holds its record (a restart): lease locally
    local_record: bool = False  # the local backend holds a record for it
    # Request counters to absorb: a local admission whose call never reached Redis.
    request_counters: tuple[Counter, ...] = ()
    admitted_at: float = 0.0
    usage: UsageTags | None = None  # for the ledger entry of what is absorbed
    charges: list[tuple[float, int]] = field(default_factory=list)  # local (time, tokens)


@dataclass(slots=True)
class _Op:
    """A call waiting for the backend; idempotent on ``key``."""

    kind: OpKind
    key: str
    counters: tuple[Counter, ...] = ()
    used: int = 0  # settle
    reason: SettleReason = "completed"  # settle: for the usage ledger
    output_tokens: int | None = None  # settle
    cached_tokens: int = 0  # settle
    ttl_s: int = RECORD_TTL_S  # cancel: tombstone lifetime
    entries: tuple[tuple[str, int, int, int], ...] = ()  # absorb: (prefix, window, start, n)
    # absorb: the ledger entry's own fields (plan, model, client id, reason, prompt, output,
    # admitted_at_us); None: no entry (nothing of a settlement was served locally).
    ledger: tuple[str, str, str, str, int, int, str] | None = None
    tokens: int = 0  # absorb: tokens served locally
    attempts: int = 0


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
        self._clock = clock
        # The allowance keeps no ledger: Redis's is the one (nothing to bound here).
        self.local = MemoryQuotaBackend(clock=clock, ledger=LedgerSettings(enabled=False))
        # The absorb script runs on the Redis backend's scripts, under its deadline.
        self._absorb_script = Script(load_lua("absorb.lua"))
        self._breakers: dict[str, _Breaker] = {}
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._pending: OrderedDict[tuple[OpKind, str], _Op] = OrderedDict()
        self._tracked: dict[str, _Tracked] = {}
        self._unsent: OrderedDict[str, None] = OrderedDict()
        self._worker: asyncio.Task[None] | None = None
        self._next_sweep = 0.0
        self._config_error_logged: dict[str, float] = {}

    @property
    def breaker_open(self) -> bool:
        """Some shard's breaker is open."""
        return any(b.open for b in self._breakers.values())

    def open_shards(self) -> list[str]:
        """The shards whose breaker is open."""
        return [b.shard for b in self._breakers.values() if b.open]

    @property
    def pending(self) -> int:
        """Calls waiting in the queue."""
        return len(self._pending)

    # -- breaker ---------------------------------------------------------------------------

    def _breaker(self, key: str) -> _Breaker:
        shard = self.primary.shard_of(key)
        breaker = self._breakers.get(shard)
        if breaker is None:
            breaker = self._breakers[shard] = _Breaker(shard)
        return breaker

    def _is_open(self, key: str) -> bool:
        breaker = self._breakers.get(self.primary.shard_of(key))
        return breaker is not None and breaker.open

    async def _guarded(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
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
            pending=len(self._pending),
        )
        breaker.prober = asyncio.get_running_loop().create_task(self._probe(breaker))

    async def _probe(self, breaker: _Breaker) -> None:
        """One probe every ``probe_interval_s`` while open; the first that succeeds closes."""
        while breaker.open:
            await asyncio.sleep(self.probe_interval_s)
            self.metrics.quota_breaker_probes_total += 1
            try:
                up = await self.primary.probe(breaker.shard)
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
                self._wake.set()
                log.warning("quota_breaker_closed", shard=breaker.shard, pending=len(self._pending))

    # -- admission -------------------------------------------------------------------------

    async def admit(self, request: AdmitRequest) -> Verdict:
        self._sweep()
        key = request.reservation_key
        try:
            verdict = await self._guarded(key, lambda: self.primary.admit(request))
        except QuotaMisconfigured:
            raise  # fail closed even on an open plan: no allowance hides a broken ACL
        except CircuitOpen:
            if not request.fail_open:
                self._remember_unsent(key)
                raise
            return await self._admit_locally(request, sent=False)
        except QuotaUnavailable:
            if not request.fail_open:
                raise
            return await self._admit_locally(request, sent=True)
        if verdict.admitted and request.token_counters and request.fail_open:
            self._tracked.setdefault(
                key,
                _Tracked(created=self._clock(), redis_reserved=request.tokens, usage=request.usage),
            )
        return verdict

    async def _admit_locally(self, request: AdmitRequest, sent: bool) -> Verdict:
        """Admit from the local allowance; ``sent``: Redis may have seen the admission."""
        key = request.reservation_key
        verdict = await self.local.admit(
            AdmitRequest(
                key,
                _local(request.request_counters, self.fail_open_workers),
                _local(request.token_counters, self.fail_open_workers),
                request.tokens,
                count_refused_attempts=False,
                record_ttl_s=request.record_ttl_s,
            )
        )
        if not verdict.admitted:
            self.metrics.fail_open_refusals_total += 1
            if not sent:
                self._remember_unsent(key)  # the caller's cancel has nothing to do
            raise QuotaUnavailable(
                f"quota backend unavailable; fail-open allowance ({verdict.refused_by}) used up"
            )
        now = self._clock()
        if sent:
            # The admission may have run in Redis (or may still run, from a paused server):
            # cancel it there. What is served here is charged by the absorb at settlement.
            self._enqueue(_Op("cancel", key, request.token_counters))
        tracked = _Tracked(
            created=now,
            local=True,
            local_record=True,
            request_counters=() if sent else request.request_counters,
            admitted_at=now,
            usage=request.usage,
            charges=[(now, request.tokens)] if request.tokens else [],
        )
        self.metrics.fail_open_admissions_total += 1
        self.metrics.fail_open_tokens_total += request.tokens
        if request.token_counters:
            self._tracked[key] = tracked
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
        tracked = self._tracked.get(reservation_key)
        if tracked is not None and (tracked.local or tracked.redis_lost):
            return await self._reserve_locally(
                tracked, reservation_key, seq, token_counters, amount, minimum
            )
        try:
            grant = await self._guarded(
                reservation_key,
                lambda: self.primary.reserve(reservation_key, seq, token_counters, amount, minimum),
            )
        except QuotaUnavailable as exc:
            if tracked is None or isinstance(exc, QuotaMisconfigured):
                raise
            return await self._reserve_locally(
                tracked, reservation_key, seq, token_counters, amount, minimum
            )
        if tracked is not None:
            if grant.granted == 0 and not grant.states:
                # Not a refusal (that carries states): Redis lost the admitted record (it
                # restarted). The stream goes on from the local allowance.
                tracked.redis_lost = True
                log.warning("quota_record_lost", request_id=reservation_key)
                return await self._reserve_locally(
                    tracked, reservation_key, seq, token_counters, amount, minimum
                )
            if not grant.replayed:
                tracked.redis_reserved += grant.granted
        return grant

    async def _reserve_locally(
        self,
        tracked: _Tracked,
        key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int,
    ) -> Grant:
        counters = _local(token_counters, self.fail_open_workers)
        if not tracked.local_record:
            tracked.local_record = True
            await self.local.admit(AdmitRequest(key, (), counters, 0, count_refused_attempts=False))
        grant = await self.local.reserve(key, seq, counters, amount, minimum)
        if grant.granted == 0:
            self.metrics.fail_open_refusals_total += 1
            raise QuotaUnavailable("quota backend unavailable; fail-open allowance used up")
        if not grant.replayed:
            tracked.charges.append((self._clock(), grant.granted))
            self.metrics.fail_open_lease_batches_total += 1
            self.metrics.fail_open_tokens_total += grant.granted
        return Grant(granted=grant.granted, replayed=grant.replayed, local=True)

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
    ) -> Settlement:
        windows.check_settle(used, token_counters)
        windows.check_reason(reason, output_tokens, used)
        tracked = self._tracked.pop(reservation_key, None)
        if tracked is None or not tracked.local_record:
            return await self._settle_remote(
                reservation_key, token_counters, used, reason, output_tokens, cached_tokens
            )
        # Redis reserved the oldest part of the request, so it takes the oldest usage.
        used_remote = 0 if tracked.local else min(used, tracked.redis_reserved)
        used_local = used - used_remote
        local = await self.local.settle(
            reservation_key,
            _local(token_counters, self.fail_open_workers),
            used_local,
            reason=reason,
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
            reservation_key, token_counters, used_remote, reason, remote_output
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
    ) -> Settlement:
        try:
            return await self._guarded(
                key,
                lambda: self.primary.settle(
                    key,
                    token_counters,
                    used,
                    reason=reason,
                    output_tokens=output_tokens,
                    cached_tokens=cached_tokens,
                ),
            )
        except QuotaUnavailable as exc:
            op = _Op("settle", key, token_counters, used=used, reason=reason)
            op.output_tokens = output_tokens
            op.cached_tokens = cached_tokens
            queued = self._enqueue(op)
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
        if reservation_key in self._unsent:  # the admission never left this process
            del self._unsent[reservation_key]
            return Settlement(reserved=0, used=0, refunded=0, refunded_per_counter=zeros)
        tracked = self._tracked.get(reservation_key)
        if tracked is not None and tracked.local:
            return await self.settle(reservation_key, token_counters, 0)
        if tracked is not None and tracked.local_record:
            del self._tracked[reservation_key]
            await self.local.cancel(reservation_key, _local(token_counters, self.fail_open_workers))
        try:
            return await self._guarded(
                reservation_key,
                lambda: self.primary.cancel(reservation_key, token_counters, tombstone_ttl_s),
            )
        except QuotaUnavailable:
            queued = self._enqueue(
                _Op("cancel", reservation_key, token_counters, ttl_s=tombstone_ttl_s)
            )
            return Settlement(
                reserved=0, used=0, refunded=0, refunded_per_counter=zeros, queued=queued
            )

    # -- reconciliation --------------------------------------------------------------------

    def _absorb(
        self,
        key: str,
        tracked: _Tracked,
        token_counters: tuple[Counter, ...],
        used: int,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
    ) -> None:
        """Queue the charge of what a reservation used locally, window by window."""
        now = self._clock()
        entries: dict[tuple[str, int, int], int] = {}

        def add(counter: Counter, at: float, amount: int) -> None:
            start = windows.window_start(math.floor(at), counter.window_s)
            where = (counter.key, counter.window_s, start)
            entries[where] = entries.get(where, 0) + amount

        for counter in tracked.request_counters:
            add(counter, tracked.admitted_at, 1)
        for counter in token_counters:
            left = used
            for at, amount in tracked.charges:  # usage fills the oldest charges first
                if left <= 0:
                    break
                take = min(left, amount)
                add(counter, at, take)
                left -= take
            if left > 0:  # beyond the reservation: the window it settles in
                add(counter, now, left)
        if entries:
            flat = tuple((p, w, s, n) for (p, w, s), n in entries.items())
            op = _Op("absorb", absorb_key(key), entries=flat, tokens=used)
            if token_counters:  # a settlement's local part: the ledger gets its entry
                tags = tracked.usage or UsageTags()
                output = (
                    output_tokens
                    if output_tokens is not None
                    else max(0, used - tags.prompt_tokens)
                )
                output = min(output, used)
                admitted_us = str(round(tracked.admitted_at * 1_000_000)) if tracked.local else ""
                op.ledger = (tags.plan, tags.model, tags.client_request_id, reason,
                             used - output, output, admitted_us)  # fmt: skip
            self._enqueue(op)

    async def _absorb_call(self, op: _Op) -> Any:
        """Every entry is charged to its counter's current window on the server (the only
        live one), whose key is passed; a wrong guess of the server's clock is retried."""
        now_s = self.primary.server_now_s()
        ledger = self.primary.ledger
        on = op.ledger is not None and ledger.enabled
        fields = op.ledger or ("", "", "", "completed", 0, 0, "")
        for _ in range(WINDOW_RETRIES + 1):
            keys = [op.key]
            args: list[Any] = [RECORD_TTL_S, windows.EXPIRY_MARGIN_S, 1 if on else 0,
                               ledger.max_len, ledger.retention_s * 1000, *fields]  # fmt: skip
            for prefix, window_s, start, amount in op.entries:
                current = windows.window_start(now_s, window_s)
                keys.append(window_key(prefix, current))
                args += (window_s, current, start, amount)
            keys.append(usage_stream_key(op.key))
            reply = await self.primary.run("absorb", self._absorb_script, keys, args)
            if int(reply[0]) != 2:
                return reply
            self.primary.window_retries += 1
            now_s = int(self.primary.learn_clock(reply[2], reply[3]))
        raise WrongWindow("quota absorb: window keys kept missing the server's clock")

    # -- queue -----------------------------------------------------------------------------

    def _enqueue(self, op: _Op) -> bool:
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

    async def _apply(self, op: _Op) -> None:
        if op.kind == "settle":
            await self._guarded(
                op.key,
                lambda: self.primary.settle(
                    op.key,
                    op.counters,
                    op.used,
                    reason=op.reason,
                    output_tokens=op.output_tokens,
                    cached_tokens=op.cached_tokens,
                ),
            )
        elif op.kind == "cancel":
            await self._guarded(op.key, lambda: self.primary.cancel(op.key, op.counters, op.ttl_s))
        else:
            await self._guarded(op.key, lambda: self._absorb_call(op))
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
            ready = (op for op in self._pending.values() if not self._is_open(op.key))
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
                await asyncio.sleep(self.probe_interval_s)

    def _give_up(self, op: _Op, error: BaseException) -> None:
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
            log.error("quota_queue_unflushed", pending=len(self._pending), **self._lost())
            return False
        return True

    def _lost(self) -> dict[str, int]:
        kinds = [op.kind for op in self._pending.values()]
        return {
            "settlements": kinds.count("settle"),
            "cancels": kinds.count("cancel"),
            "absorbs": kinds.count("absorb"),
            "absorb_tokens": sum(op.tokens for op in self._pending.values()),
        }

    # -- housekeeping ----------------------------------------------------------------------

    def _remember_unsent(self, key: str) -> None:
        self._unsent[key] = None
        if len(self._unsent) > UNSENT_MAX:
            self._unsent.popitem(last=False)

    def _sweep(self) -> None:
        """Forget fail-open requests that never settled (their records expired anyway)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        horizon = now - RECORD_TTL_S
        self._tracked = {k: t for k, t in self._tracked.items() if t.created > horizon}

    async def ping(self) -> bool:
        return await self.primary.ping()

    async def check(self) -> None:
        await self.primary.check()

    async def close(self) -> None:
        probers = [b.prober for b in self._breakers.values()]
        for task in (self._worker, *probers):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._pending:
            log.error("quota_queue_lost", pending=len(self._pending), **self._lost())
        await self.primary.close()
        await self.local.close()
