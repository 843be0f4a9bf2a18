"""Fail open: what this processor may serve on its own while Redis cannot answer.

A request whose counters all carry ``fail_open_limit`` is admitted, when Redis cannot
answer, from an in-process ``MemoryQuotaBackend`` whose limits are this process's share of
those allowances (``⌈allowance / workers⌉``: the workers of one ``serve --workers N`` share
the host's). What each request was served here, and when, is tracked from its admission
to its settlement, so that it can be charged into Redis afterwards (``absorption``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.metrics import Metrics
from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    AbsorbedUsage,
    Absorption,
    AdmitRequest,
    Counter,
    Grant,
    LedgerSettings,
    QuotaUnavailable,
    SettleReason,
    UsageTags,
)
from extproc.quota.memory.backend import MemoryQuotaBackend

UNSENT_MAX = 100_000  # remembered keys whose admission never reached Redis
SWEEP_INTERVAL_S = 60.0


def absorb_key(reservation_key: str) -> str:
    """Record of a reservation's reconciliation; an encoded request id never holds ``:``."""
    return reservation_key + ":absorb"


def local_counters(counters: tuple[Counter, ...], workers: int = 1) -> tuple[Counter, ...]:
    """The counters with this process's share of the host's allowance as their limits."""
    return tuple(
        Counter(c.kind, c.key, -(-(c.fail_open_limit or 0) // workers), c.window_s)
        for c in counters
    )


@dataclass(slots=True)
class Tracked:
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


class Allowance:
    def __init__(self, metrics: Metrics, workers: int, clock: Callable[[], float] = time.time):
        self.metrics = metrics
        self.workers = workers
        self._clock = clock
        # The allowance keeps no ledger: Redis's is the one (nothing to bound here).
        self.local = MemoryQuotaBackend(clock=clock, ledger=LedgerSettings(enabled=False))
        self.tracked: dict[str, Tracked] = {}
        self._unsent: OrderedDict[str, None] = OrderedDict()
        self._next_sweep = 0.0

    def counters(self, counters: tuple[Counter, ...]) -> tuple[Counter, ...]:
        return local_counters(counters, self.workers)

    async def admit(self, request: AdmitRequest, sent: bool) -> Tracked:
        """Admit from the allowance (``QuotaUnavailable`` when it cannot cover the request);
        ``sent``: Redis may have seen the admission."""
        key = request.reservation_key
        verdict = await self.local.admit(
            AdmitRequest(
                key,
                self.counters(request.request_counters),
                self.counters(request.token_counters),
                request.tokens,
                count_refused_attempts=False,
                record_ttl_s=request.record_ttl_s,
            )
        )
        if not verdict.admitted:
            self.metrics.fail_open_refusals_total += 1
            if not sent:
                self.remember_unsent(key)  # the caller's cancel has nothing to do
            raise QuotaUnavailable(
                f"quota backend unavailable; fail-open allowance ({verdict.refused_by}) used up"
            )
        now = self._clock()
        self.metrics.fail_open_admissions_total += 1
        self.metrics.fail_open_tokens_total += request.tokens
        return Tracked(
            created=now,
            local=True,
            local_record=True,
            request_counters=() if sent else request.request_counters,
            admitted_at=now,
            usage=request.usage,
            charges=[(now, request.tokens)] if request.tokens else [],
        )

    async def reserve(
        self,
        tracked: Tracked,
        key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int,
    ) -> Grant:
        """A lease batch from the allowance (``QuotaUnavailable`` when it is used up)."""
        counters = self.counters(token_counters)
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

    def absorption(
        self,
        key: str,
        tracked: Tracked,
        token_counters: tuple[Counter, ...],
        used: int,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
    ) -> Absorption | None:
        """What a reservation used locally, window by window (None: nothing)."""
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
        if not entries:
            return None
        usage = None
        if token_counters:  # a settlement's local part: the ledger gets its entry
            tags = tracked.usage or UsageTags()
            output = (
                output_tokens if output_tokens is not None else max(0, used - tags.prompt_tokens)
            )
            output = min(output, used)
            admitted_us = str(round(tracked.admitted_at * 1_000_000)) if tracked.local else ""
            usage = AbsorbedUsage(tags.plan, tags.model, tags.client_request_id, reason,
                                  used - output, output, admitted_us)  # fmt: skip
        flat = tuple((p, w, s, n) for (p, w, s), n in entries.items())
        return Absorption(absorb_key(key), flat, usage)

    def is_unsent(self, key: str) -> bool:
        return key in self._unsent

    def forget_unsent(self, key: str) -> None:
        del self._unsent[key]

    def remember_unsent(self, key: str) -> None:
        self._unsent[key] = None
        if len(self._unsent) > UNSENT_MAX:
            self._unsent.popitem(last=False)

    def sweep(self) -> None:
        """Forget fail-open requests that never settled (their records expired anyway)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        horizon = now - RECORD_TTL_S
        self.tracked = {k: t for k, t in self.tracked.items() if t.created > horizon}

    def track(self, key: str, request: AdmitRequest) -> None:
        """A fail-open request Redis admitted: what Redis reserved for it, so far."""
        self.tracked.setdefault(
            key, Tracked(created=self._clock(), redis_reserved=request.tokens, usage=request.usage)
        )
