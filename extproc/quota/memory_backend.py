"""Quota backend in process memory: the embedded default for a single processor.

Same semantics as the Redis scripts, step for step (the conformance suite runs against
both). Every method runs to completion without awaiting, so on one event loop each call is
atomic just like a Lua script; nothing here is shared across threads or processes.

Records live as in Redis: an open record ``record_ttl_s``, a settled one at most
``settled_ttl_s`` (``SETTLED_TTL_S``), a cancelled one keeps its TTL. A processor that dies
takes this backend with it, so it has no orphans to reconcile.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    SETTLED_TTL_S,
    AdmitRequest,
    Counter,
    CounterKind,
    CounterState,
    Grant,
    LedgerSettings,
    Settlement,
    SettleReason,
    UsageTags,
    Verdict,
)
from extproc.quota.keys import decode_name, records_prefix, usage_stream_key, window_key

# kind, window_s, window_start of a window key (keys.counter_key + ":<start>").
_WINDOW_KEY = re.compile(r":c:([a-z_]+):[^:]*:(\d+):(\d+)$")
_KIND_RANK = {"tpm": 1, "tenant_tpm": 2, "daily": 3}
LedgerEntry = tuple[str, dict[str, str]]


@dataclass(slots=True)
class _Record:
    """What the Redis reservation hash holds."""

    admitted: bool
    refused_by: CounterKind | None
    # First verdict as (kind, limit, window_s, value, window_start), replayed verbatim.
    verdict: tuple[tuple[CounterKind, int, int, int, int], ...]
    expires_at: float
    reserved: int = 0
    charged: dict[str, int] = field(default_factory=dict)  # window key -> tokens
    grants: dict[int, int] = field(default_factory=dict)  # seq -> tokens
    settlement: Settlement | None = None
    cancelled: bool = False  # 'c' in Redis: admissions of this key charge nothing
    tombstone: bool = False  # written by cancel before any admission ran (no 'v')
    tags: UsageTags = field(default_factory=UsageTags)
    admitted_at_us: str = ""
    net: dict[str, int] = field(default_factory=dict)  # window key -> kept after settling


class MemoryQuotaBackend:
    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 5.0,
        settled_ttl_s: int = SETTLED_TTL_S,
        ledger: LedgerSettings | None = None,
    ) -> None:
        if settled_ttl_s <= 0:
            raise ValueError(f"settled_ttl_s must be > 0, got {settled_ttl_s}")
        self.ledger = ledger if ledger is not None else LedgerSettings()
        # The usage ledger: per tenant stream key, (entry id, fields) as Redis XRANGE lists.
        self._ledgers: dict[str, deque[LedgerEntry]] = {}
        self._last_id = (0, -1)
        self._clock = clock
        self.settled_ttl_s = settled_ttl_s
        self._counters: dict[str, tuple[int, float]] = {}  # window key -> (value, expires_at)
        self._records: dict[str, _Record] = {}
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = 0.0

    def counters(self) -> dict[str, int]:
        """Live window keys and their values, as Redis would list them (for inspection)."""
        now = self._clock()
        return {k: v for k, (v, exp) in self._counters.items() if exp > now}

    def ledger_entries(self, stream_key: str) -> list[LedgerEntry]:
        """The ledger entries of one tenant stream (``keys.usage_stream_key``), oldest first."""
        return list(self._ledgers.get(stream_key, ()))

    def ledger_streams(self) -> list[str]:
        return sorted(self._ledgers)

    def stored_entries(self) -> tuple[int, int]:
        """(window counters, reservation records) held, expired or not: the memory in use."""
        return len(self._counters), len(self._records)

    def _tick(self) -> tuple[float, int]:
        now = self._clock()
        if now >= self._next_sweep:
            # Amortised expiry: one pass every few seconds keeps memory bounded by the live
            # windows without a timer task.
            self._counters = {k: e for k, e in self._counters.items() if e[1] > now}
            self._records = {k: r for k, r in self._records.items() if r.expires_at > now}
            self._next_sweep = now + self._sweep_interval_s
        return now, math.floor(now)

    def _get(self, key: str, now: float) -> int:
        entry = self._counters.get(key)
        return entry[0] if entry is not None and entry[1] > now else 0

    def _incr(self, key: str, amount: int, start: int, window_s: int, now: float) -> int:
        entry = self._counters.get(key)
        if entry is None or entry[1] <= now:
            entry = (0, start + window_s + windows.EXPIRY_MARGIN_S)
        value = entry[0] + amount
        self._counters[key] = (value, entry[1])
        return value

    def _record(self, key: str, now: float) -> _Record | None:
        record = self._records.get(key)
        return record if record is not None and record.expires_at > now else None

    async def admit(self, request: AdmitRequest) -> Verdict:
        windows.check_admit(request)
        now, now_s = self._tick()
        prior = self._record(request.reservation_key, now)
        if prior is not None:
            return self._verdict(prior, now, replayed=not prior.tombstone)

        counters = request.request_counters + request.token_counters
        n_req = len(request.request_counters)
        starts = [windows.window_start(now_s, c.window_s) for c in counters]
        keys = [window_key(c.key, s) for c, s in zip(counters, starts, strict=True)]
        values = [self._get(k, now) for k in keys]
        refused_by: CounterKind | None = None
        refused_fits = False
        for i, c in enumerate(counters):
            cost = 1 if i < n_req else request.tokens
            if values[i] + cost > c.limit:
                refused_by = c.kind
                refused_fits = i >= n_req and cost <= c.limit
                break
        admitted = refused_by is None
        if (
            request.soft_refusal
            and refused_fits
            and self._others_open(request.reservation_key, now) > 0
        ):
            return Verdict(admitted=False, retry_soon=True)

        def charge(i: int, amount: int) -> None:
            values[i] = self._incr(keys[i], amount, starts[i], counters[i].window_s, now)

        if admitted or request.count_refused_attempts:
            for i in range(n_req):
                charge(i, 1)
        record = _Record(
            admitted=admitted,
            refused_by=refused_by,
            verdict=(),
            expires_at=now_s + request.record_ttl_s,
        )
        if admitted:
            record.tags = request.usage or UsageTags()
            record.admitted_at_us = _micros(now)
            if request.tokens > 0 and request.token_counters:
                record.reserved = request.tokens
                for i in range(n_req, len(counters)):
                    charge(i, request.tokens)
                    record.charged[keys[i]] = request.tokens
        record.verdict = tuple(
            (c.kind, c.limit, c.window_s, values[i], starts[i]) for i, c in enumerate(counters)
        )
        self._records[request.reservation_key] = record
        return self._verdict(record, now, replayed=False)

    @staticmethod
    def _verdict(record: _Record, now: float, replayed: bool) -> Verdict:
        states = tuple(
            windows.counter_state(kind, limit, window_s, value, start, now)
            for kind, limit, window_s, value, start in record.verdict
        )
        if record.cancelled:
            return Verdict(admitted=False, states=states, replayed=replayed, cancelled=True)
        return Verdict(
            admitted=record.admitted,
            refused_by=record.refused_by,
            states=states,
            replayed=replayed,
        )

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant:
        windows.check_reserve(seq, amount, minimum, token_counters)
        now, now_s = self._tick()
        record = self._record(reservation_key, now)
        if record is None or not record.admitted or record.settlement is not None:
            return Grant(granted=0)

        starts = [windows.window_start(now_s, c.window_s) for c in token_counters]
        keys = [window_key(c.key, s) for c, s in zip(token_counters, starts, strict=True)]
        values = [self._get(k, now) for k in keys]

        def states() -> tuple[CounterState, ...]:
            return tuple(
                windows.counter_state(c.kind, c.limit, c.window_s, values[i], starts[i], now)
                for i, c in enumerate(token_counters)
            )

        if seq in record.grants:
            return Grant(granted=record.grants[seq], states=states(), replayed=True)
        granted = min([amount, *(c.limit - v for c, v in zip(token_counters, values, strict=True))])
        if granted < minimum:
            others = self._others_open(reservation_key, now)
            return Grant(granted=0, states=states(), others_open=others)
        for i, c in enumerate(token_counters):
            values[i] = self._incr(keys[i], granted, starts[i], c.window_s, now)
            record.charged[keys[i]] = record.charged.get(keys[i], 0) + granted
        record.reserved += granted
        record.grants[seq] = granted
        return Grant(granted=granted, states=states())

    def _others_open(self, reservation_key: str, now: float) -> int:
        """Admitted, unsettled requests of the same tenant (only asked on a refusal)."""
        tag = records_prefix(reservation_key)
        return sum(
            1
            for key, r in self._records.items()
            if key != reservation_key
            and key.startswith(tag)
            and r.admitted
            and r.settlement is None
            and r.expires_at > now
        )

    async def settle(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        used: int,
        *,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
    ) -> Settlement:
        windows.check_settle(used, token_counters)
        windows.check_reason(reason, output_tokens, used)
        now, now_s = self._tick()
        record = self._record(reservation_key, now)
        if record is not None and record.settlement is not None:
            return self._already_settled(record.settlement)
        if record is None or not record.admitted:
            zeros = tuple(0 for _ in token_counters)
            return Settlement(reserved=0, used=used, refunded=0, refunded_per_counter=zeros)
        record.settlement = self._settle(record, token_counters, used, now, now_s)
        self._append(reservation_key, record, reason, output_tokens, now)
        # settle.lua: EXPIRE settled_ttl_s unless the record would expire sooner.
        record.expires_at = min(record.expires_at, now + self.settled_ttl_s)
        return record.settlement

    def record_ttl(self, reservation_key: str) -> float | None:
        """Seconds the record of a key has left (None: no live record), like Redis TTL."""
        now = self._clock()
        record = self._record(reservation_key, now)
        return None if record is None else record.expires_at - now

    async def cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        windows.check_cancel(tombstone_ttl_s, token_counters)
        now, now_s = self._tick()
        record = self._record(reservation_key, now)
        if record is not None and record.settlement is not None:
            return self._already_settled(record.settlement)
        if record is None:
            record = _Record(
                admitted=False,
                refused_by=None,
                verdict=(),
                expires_at=now_s + tombstone_ttl_s,
                tombstone=True,
            )
            self._records[reservation_key] = record
        if record.admitted:
            record.settlement = self._settle(record, token_counters, 0, now, now_s)
            self._append(reservation_key, record, "cancelled", None, now)
        else:
            zeros = tuple(0 for _ in token_counters)
            record.settlement = Settlement(
                reserved=0, used=0, refunded=0, refunded_per_counter=zeros
            )
        record.cancelled = True
        return record.settlement

    @staticmethod
    def _already_settled(first: Settlement) -> Settlement:
        return Settlement(
            reserved=first.reserved,
            used=first.used,
            refunded=first.refunded,
            already_settled=True,
            refunded_per_counter=first.refunded_per_counter,
        )

    def _settle(
        self,
        record: _Record,
        token_counters: tuple[Counter, ...],
        used: int,
        now: float,
        now_s: int,
    ) -> Settlement:
        """Commit ``used`` and refund the rest of an admitted record (settle.lua)."""
        refunds: list[int] = []
        record.net = dict(record.charged)
        for c in token_counters:
            head = c.key + ":"
            charged = sorted(
                (
                    (int(k[len(head) :]), amount)
                    for k, amount in record.charged.items()
                    if k.startswith(head) and k[len(head) :].isdigit()
                ),
                reverse=True,
            )
            left = record.reserved - used
            refunded = 0
            for start, amount in charged:
                if left <= 0:
                    break
                take = min(left, amount)
                left -= take
                if start + c.window_s > now_s:  # an ended window keeps its share
                    key = window_key(c.key, start)
                    take = min(take, self._get(key, now))
                    if take > 0:
                        value, expires_at = self._counters[key]
                        self._counters[key] = (value - take, expires_at)
                        refunded += take
                        record.net[key] -= take
            if used > record.reserved:
                start = windows.window_start(now_s, c.window_s)
                key = window_key(c.key, start)
                self._incr(key, used - record.reserved, start, c.window_s, now)
                record.net[key] = record.net.get(key, 0) + used - record.reserved
            refunds.append(refunded)

        return Settlement(
            reserved=record.reserved,
            used=used,
            refunded=refunds[0] if refunds else 0,
            refunded_per_counter=tuple(refunds),
        )

    def _append(
        self,
        reservation_key: str,
        record: _Record,
        reason: str,
        output_tokens: int | None,
        now: float,
    ) -> None:
        """One ledger entry, field for field what settle.lua writes."""
        if not self.ledger.enabled:
            return
        settlement = record.settlement
        assert settlement is not None
        used = settlement.used
        if output_tokens is None:  # admission's prompt count first (settle.lua)
            output_tokens = used - min(record.tags.prompt_tokens, used)
        prompt = used - output_tokens
        entries = []
        for key, net in record.net.items():
            match = _WINDOW_KEY.search(key)
            if match is not None:
                kind, window, start = match.groups()
                rank = _KIND_RANK.get(kind, 9)
                entries.append((rank, int(start), f"{kind}:{window}:{start}:{net}"))
        fields = {
            "tenant": decode_name(reservation_key.partition("{")[2].partition("}")[0]),
            "plan": record.tags.plan,
            "model": record.tags.model,
            "request_id": decode_name(reservation_key.rpartition(":r:")[2]),
            "client_request_id": record.tags.client_request_id,
            "prompt_tokens": str(prompt),
            "output_tokens": str(output_tokens),
            "reserved": str(settlement.reserved),
            "used": str(used),
            "refunded": str(settlement.refunded),
            "windows": ";".join(e[2] for e in sorted(entries)),
            "reason": reason,
            "admitted_at_us": record.admitted_at_us,
            "settled_at_us": _micros(now),
        }
        ms = math.floor(now * 1000)
        seq = self._last_id[1] + 1 if ms <= self._last_id[0] else 0
        ms = max(ms, self._last_id[0])
        self._last_id = (ms, seq)
        stream = self._ledgers.setdefault(usage_stream_key(reservation_key), deque())
        stream.append((f"{ms}-{seq}", fields))
        if self.ledger.max_len > 0:
            while len(stream) > self.ledger.max_len:
                stream.popleft()
        if self.ledger.retention_s > 0:
            horizon = math.floor(now * 1000) - self.ledger.retention_s * 1000
            while stream and int(stream[0][0].split("-")[0]) < horizon:
                stream.popleft()

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._counters.clear()
        self._records.clear()
        self._ledgers.clear()


def _micros(now: float) -> str:
    """Microseconds since the epoch, as settle.lua writes TIME (seconds + 6 digits)."""
    return str(round(now * 1_000_000))
