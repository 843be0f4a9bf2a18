"""Quota backend in process memory: the embedded default for a single processor.

Same semantics as the Redis scripts, step for step (the conformance suite runs against
both). Every method runs to completion without awaiting, so on one event loop each call is
atomic just like a Lua script; nothing here is shared across threads or processes.

Records live as in Redis: an open record ``record_ttl_s``, a settled one at most
``settled_ttl_s`` (``SETTLED_TTL_S``), a cancelled one keeps its TTL. An admitted record
names its owner (``owner_id``) and is listed in the owner's open set of its tenant until it
is settled, and ``settle_orphan`` settles it as a peer would, as in Redis; but a processor
that dies takes this backend with it, so nobody ever needs to.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    SETTLED_TTL_S,
    Absorption,
    AdmitRequest,
    Block,
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
from extproc.quota.keys import (
    open_set_key,
    records_prefix,
    reservation_names,
    usage_stream_key,
    window_key,
)

LedgerEntry = tuple[str, dict[str, str]]


@dataclass(slots=True)
class _Record:
    """What the Redis reservation hash holds."""

    admitted: bool
    refused_by: CounterKind | None
    # First verdict as (kind, limit, value, reset_at, retry_at or None), replayed verbatim.
    verdict: tuple[tuple[CounterKind, int, int, int, int | None], ...]
    expires_at: float
    lifetime_s: int = 0  # 'tl': an open record's lifetime, renewed by each granted lease
    reserved: int = 0
    charged: dict[str, int] = field(default_factory=dict)  # window key -> tokens
    grants: dict[int, int] = field(default_factory=dict)  # seq -> tokens
    settlement: Settlement | None = None
    cancelled: bool = False  # 'c' in Redis: admissions of this key charge nothing
    tombstone: bool = False  # written by cancel before any admission ran (no 'v')
    tags: UsageTags = field(default_factory=UsageTags)
    admitted_at_us: str = ""
    net: dict[str, int] = field(default_factory=dict)  # window key -> kept after settling
    shadow_refused_by: tuple[CounterKind, ...] = ()
    owner: str = ""  # 'o': the processor that admitted it
    # An admission block: 'rq' (request slots left) and per request counter's window key
    # the slots it can give back ('q' .. key).
    slots: int = 0
    slot_windows: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _OpenSet:
    """A tenant's records one owner holds open (the Redis set ``keys.open_set_key``)."""

    members: set[str]
    expires_at: float


@dataclass(slots=True)
class _SlidingHash:
    """What a sliding counter's Redis hash holds: buckets, their sum, the oldest present."""

    buckets: dict[int, int]
    lo: int
    total: int
    expires_at: float


class _Open:
    """One counter in one call, step for step what ``lua/counters.lua`` does."""

    __slots__ = ("b", "c", "cur", "cutoff", "key", "now", "start", "stop", "value")

    def __init__(self, backend: MemoryQuotaBackend, c: Counter, now_s: int, now: float) -> None:
        self.b, self.c, self.now = backend, c, now
        key, _, a, b = windows.script_window(c, now_s)
        self.key = key
        if c.shape == "sliding":
            self.cur = now_s - now_s % c.bucket_s
            self.cutoff = self.cur - c.window_s
            self.start, self.stop = self.cur, self.cur + c.window_s + c.bucket_s
        else:
            self.start, self.stop = a, b
        self.value = 0

    def _hash(self) -> _SlidingHash | None:
        h = self.b._sliding.get(self.key)
        return h if h is not None and h.expires_at > self.now else None

    def read(self) -> int:
        if self.c.shape != "sliding":
            self.value = self.b._get(self.key, self.now)
            return self.value
        h = self._hash()
        if h is None:
            self.value = 0
            return 0
        if self.cutoff - h.lo > self.c.window_s:
            del self.b._sliding[self.key]
            self.value = 0
            return 0
        for start in [k for k in h.buckets if k < self.cutoff]:
            h.total -= h.buckets.pop(start)
        h.lo = max(h.lo, self.cutoff)
        self.value = h.total
        return h.total

    def charge(self, amount: int) -> str:
        """Add to the current window or bucket; the record field (window key) it went to."""
        c = self.c
        if c.shape != "sliding":
            entry = self.b._counters.get(self.key)
            if entry is None or entry[1] <= self.now:
                entry = (0, self.stop + windows.EXPIRY_MARGIN_S)
            self.value = entry[0] + amount
            self.b._counters[self.key] = (self.value, entry[1])
            return self.key
        h = self._hash()
        if h is None:
            h = self.b._sliding[self.key] = _SlidingHash({}, self.cutoff, 0, 0.0)
        h.buckets[self.cur] = h.buckets.get(self.cur, 0) + amount
        h.total += amount
        h.expires_at = self.cur + c.window_s + c.bucket_s + windows.EXPIRY_MARGIN_S
        self.value = h.total
        return window_key(c.key, self.cur)

    def refund(self, start: int, amount: int) -> int:
        if self.c.shape != "sliding":
            if start != self.start:
                return 0
            take = min(amount, self.value)
            if take > 0:
                value, expires_at = self.b._counters[self.key]
                self.b._counters[self.key] = (value - take, expires_at)
                self.value -= take
            return take
        h = self._hash()
        if start < self.cutoff or h is None:
            return 0
        take = min(amount, h.buckets.get(start, 0))
        if take > 0:
            h.buckets[start] -= take
            h.total -= take
            self.value -= take
        return take

    def retry_at(self, cost: int) -> int | None:
        h = self._hash()
        if self.c.shape != "sliding" or h is None:
            return None
        return windows.sliding_retry_at(
            h.buckets, h.total, cost, self.c.limit, self.c.window_s, self.c.bucket_s
        )

    def charged(self, record: _Record) -> list[tuple[int, int, str]]:
        """The record's charges on this counter, newest first: (start, amount, key)."""
        return self.fields(record.charged)

    def fields(self, fields: dict[str, int]) -> list[tuple[int, int, str]]:
        """``fields``' windows of this counter, newest first: (start, amount, key)."""
        head = self.c.key + ":"
        return sorted(
            (
                (int(k[len(head) :]), amount, k)
                for k, amount in fields.items()
                if k.startswith(head) and k[len(head) :].isdigit()
            ),
            reverse=True,
        )


class MemoryQuotaBackend:
    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 5.0,
        settled_ttl_s: int = SETTLED_TTL_S,
        ledger: LedgerSettings | None = None,
        owner_id: str = "local",
    ) -> None:
        if settled_ttl_s <= 0:
            raise ValueError(f"settled_ttl_s must be > 0, got {settled_ttl_s}")
        if not owner_id:
            raise ValueError("owner_id must be non-empty")
        self.owner_id = owner_id
        self._open_sets: dict[str, _OpenSet] = {}
        self.ledger = ledger if ledger is not None else LedgerSettings()
        # The usage ledger: per tenant stream key, (entry id, fields) as Redis XRANGE lists.
        self._ledgers: dict[str, deque[LedgerEntry]] = {}
        self._last_id = (0, -1)
        self._clock = clock
        self.settled_ttl_s = settled_ttl_s
        self._counters: dict[str, tuple[int, float]] = {}  # window key -> (value, expires_at)
        self._sliding: dict[str, _SlidingHash] = {}
        self._records: dict[str, _Record] = {}
        self._absorbed: dict[str, float] = {}  # absorb record key -> expires_at
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
            self._sliding = {k: h for k, h in self._sliding.items() if h.expires_at > now}
            self._records = {k: r for k, r in self._records.items() if r.expires_at > now}
            self._absorbed = {k: e for k, e in self._absorbed.items() if e > now}
            self._open_sets = {
                k: o for k, o in self._open_sets.items() if o.expires_at > now and o.members
            }
            self._next_sweep = now + self._sweep_interval_s
        return now, math.floor(now)

    def _get(self, key: str, now: float) -> int:
        entry = self._counters.get(key)
        return entry[0] if entry is not None and entry[1] > now else 0

    def _record(self, key: str, now: float) -> _Record | None:
        record = self._records.get(key)
        return record if record is not None and record.expires_at > now else None

    def open_set(self, key: str) -> set[str]:
        """Members of an open set (``keys.open_set_key``), as Redis SMEMBERS would list them."""
        found = self._open_sets.get(key)
        return (
            set(found.members) if found is not None and found.expires_at > self._clock() else set()
        )

    def _unlist(self, reservation_key: str, owner_id: str) -> None:
        """settle.lua's SREM from the owner's open set (an emptied set is no key)."""
        key = open_set_key(reservation_key, owner_id)
        found = self._open_sets.get(key)
        if found is not None:
            found.members.discard(reservation_key)
            if not found.members:
                del self._open_sets[key]

    async def admit(self, request: AdmitRequest) -> Verdict:
        windows.check_admit(request)
        now, now_s = self._tick()
        return self._admit(request, now, now_s)

    def _admit(
        self,
        request: AdmitRequest,
        now: float,
        now_s: int,
        take: int = 0,
        block_key: str | None = None,
    ) -> Verdict:
        """admit.lua: ``take`` > 0 its take mode (a block of that many requests), with
        ``block_key`` its from mode."""
        prior = self._record(request.reservation_key, now)
        if prior is not None:
            return self._verdict(prior, now, replayed=not prior.tombstone)

        counters = request.request_counters + request.token_counters
        n_req = len(request.request_counters)
        opened = [_Open(self, c, now_s, now) for c in counters]
        prompt = min(request.usage.prompt_tokens if request.usage else 0, request.tokens)
        if take:
            costs = [
                take if i < n_req else windows.block_amount(c, request.tokens)
                for i, c in enumerate(counters)
            ]
        else:
            costs = [
                1 if i < n_req else prompt * c.weights[0] + (request.tokens - prompt) * c.weights[1]
                for i, c in enumerate(counters)
            ]
        block = None if block_key is None else self._record(block_key, now)
        moves = None if block is None else self._block_share(block, opened, costs, n_req)
        refused_by: CounterKind | None = None
        refused_at = -1
        refused_fits = False
        would: list[CounterKind] = []
        for i, c in enumerate(counters):
            if opened[i].read() + costs[i] > c.limit and moves is None:
                if c.shadow and not take:  # a take refuses on it, as admit.lua's does
                    would.append(c.kind)
                elif refused_by is None:
                    refused_by, refused_at = c.kind, i
                    refused_fits = i >= n_req and costs[i] <= c.limit
        admitted = refused_by is None
        if (
            request.soft_refusal
            and not take
            and refused_fits
            and self._others_open(request.reservation_key, now) > 0
        ):
            return Verdict(admitted=False, retry_soon=True)

        record = _Record(
            admitted=admitted,
            refused_by=refused_by,
            verdict=(),
            expires_at=now_s + request.record_ttl_s,
            lifetime_s=request.record_ttl_s if admitted else 0,
            shadow_refused_by=tuple(would) if admitted else (),
        )
        if block is not None and moves is not None:
            block.slots -= 1
            for i in range(n_req):
                slot = opened[i].fields(block.slot_windows)
                if slot and slot[0][1] > 0:
                    block.slot_windows[slot[0][2]] -= 1
            for key, cost in moves:
                block.charged[key] -= cost
                record.charged[key] = cost
            block.reserved = max(0, block.reserved - request.tokens)
        elif admitted or (request.count_refused_attempts and not take):
            for i in range(n_req):
                key = opened[i].charge(costs[i])
                if take:
                    record.slot_windows[key] = costs[i]
        if admitted:
            record.slots = take
            record.tags = request.usage or UsageTags()
            record.admitted_at_us = _micros(now)
            record.owner = self.owner_id
            listed = open_set_key(request.reservation_key, self.owner_id)
            found = self._open_sets.get(listed)
            if found is None or found.expires_at <= now:
                found = self._open_sets[listed] = _OpenSet(set(), 0.0)
            found.members.add(request.reservation_key)
            found.expires_at = max(found.expires_at, now_s + request.record_ttl_s)
            if moves is not None:
                record.reserved = request.tokens
            elif request.tokens > 0 and request.token_counters:
                record.reserved = request.tokens
                for i in range(n_req, len(counters)):
                    if costs[i] > 0:
                        record.charged[opened[i].charge(costs[i])] = costs[i]
        record.verdict = tuple(
            (
                c.kind,
                c.limit,
                opened[i].value,
                opened[i].stop,
                opened[i].retry_at(costs[i]) if i == refused_at else None,
            )
            for i, c in enumerate(counters)
        )
        self._records[request.reservation_key] = record
        verdict = self._verdict(record, now, replayed=False)
        return verdict if moves is None else dataclasses.replace(verdict, from_block=True)

    def _block_share(
        self, block: _Record, opened: list[_Open], costs: list[int], n_req: int
    ) -> list[tuple[str, int]] | None:
        """admit.lua's block_share: the block's window each cost moves from, or None."""
        if not block.admitted or block.settlement is not None or block.owner != self.owner_id:
            return None
        if block.slots < 1:
            return None
        moves = []
        for i in range(n_req, len(opened)):
            if costs[i] > 0:
                found = opened[i].charged(block)
                if not found or found[0][1] < costs[i]:
                    return None
                moves.append((found[0][2], costs[i]))
        return moves

    async def take_block(self, request: AdmitRequest, requests: int) -> Block:
        windows.check_block(request, requests)
        now, now_s = self._tick()
        strict = dataclasses.replace(request, count_refused_attempts=False, soft_refusal=False)
        verdict = self._admit(strict, now, now_s, take=requests)
        now_us = round(now * 1_000_000) - now_s * 1_000_000
        return windows.block_of(request, requests, verdict, now_s, now_us)

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict:
        windows.check_admit(request)
        if records_prefix(block_key) != records_prefix(request.reservation_key):
            raise ValueError(f"block {block_key!r} is not in the tenant of the request")
        now, now_s = self._tick()
        return self._admit(request, now, now_s, block_key=block_key)

    async def return_block(
        self,
        block_key: str,
        request_counters: tuple[Counter, ...],
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        """settle.lua's return mode: cancel's, and the unused request slots back."""
        windows.check_cancel(tombstone_ttl_s, request_counters)
        windows.check_counters(token_counters)
        now, now_s = self._tick()
        record = self._record(block_key, now)
        settlement = self._cancel(
            block_key, token_counters, tombstone_ttl_s, now, now_s, "returned"
        )
        if record is not None and record.admitted and not settlement.already_settled:
            for c in request_counters:
                o = _Open(self, c, now_s, now)
                o.read()
                for start, amount, _ in o.fields(record.slot_windows):
                    o.refund(start, amount)
            record.expires_at = min(record.expires_at, now + self.settled_ttl_s)
        return settlement

    @staticmethod
    def _verdict(record: _Record, now: float, replayed: bool) -> Verdict:
        states = tuple(
            windows.counter_state(kind, limit, value, reset_at, now, retry_at)
            for kind, limit, value, reset_at, retry_at in record.verdict
        )
        if record.cancelled:
            return Verdict(admitted=False, states=states, replayed=replayed, cancelled=True)
        return Verdict(
            admitted=record.admitted,
            refused_by=record.refused_by,
            states=states,
            replayed=replayed,
            shadow_refused_by=record.shadow_refused_by,
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

        opened = [_Open(self, c, now_s, now) for c in token_counters]
        granted = amount
        rooms: list[int] = []
        for o, c in zip(opened, token_counters, strict=True):
            room = c.limit - o.read()
            rooms.append(max(room, 0) // c.weights[1] if c.weights[1] > 0 else 0)
            if c.weights[1] > 0 and not c.shadow:
                granted = min(granted, rooms[-1])

        def states() -> tuple[CounterState, ...]:
            return tuple(
                windows.counter_state(c.kind, c.limit, o.value, o.stop, now)
                for o, c in zip(opened, token_counters, strict=True)
            )

        if seq in record.grants:
            return Grant(granted=record.grants[seq], states=states(), replayed=True)
        if granted < minimum or granted <= 0:
            others = self._others_open(reservation_key, now)
            return Grant(granted=0, states=states(), others_open=others)
        would: list[CounterKind] = []
        for i, (o, c) in enumerate(zip(opened, token_counters, strict=True)):
            if c.weights[1] > 0:
                if c.shadow and rooms[i] < granted:
                    would.append(c.kind)
                key = o.charge(granted * c.weights[1])
                record.charged[key] = record.charged.get(key, 0) + granted * c.weights[1]
        record.reserved += granted
        record.grants[seq] = granted
        if record.lifetime_s > 0:  # reserve.lua: the record, and the open set listing it
            record.expires_at = now_s + record.lifetime_s
            listed = self._open_sets.get(open_set_key(reservation_key, self.owner_id))
            if listed is not None and listed.expires_at > now:
                listed.expires_at = max(listed.expires_at, record.expires_at)
        return Grant(granted=granted, states=states(), shadow_cut_by=tuple(would))

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
        cached_tokens: int = 0,
        seen_admitted: bool = False,
        usage: UsageTags | None = None,
    ) -> Settlement:
        windows.check_settle(used, token_counters)
        windows.check_reason(reason, output_tokens, used)
        now, now_s = self._tick()
        record = self._record(reservation_key, now)
        self._unlist(reservation_key, self.owner_id)
        if record is not None and record.settlement is not None:
            return self._already_settled(record.settlement)
        lost = record is None and seen_admitted
        if lost:  # settle.lua's seen mode: the admission's record and charges were lost
            expires_at = now + self.settled_ttl_s
            record = _Record(
                admitted=True,
                refused_by=None,
                verdict=(),
                expires_at=expires_at,
                tags=usage or UsageTags(),
            )
            self._records[reservation_key] = record
        if record is None or not record.admitted:
            zeros = tuple(0 for _ in token_counters)
            return Settlement(reserved=0, used=used, refunded=0, refunded_per_counter=zeros)
        settlement = self._settle(
            record, token_counters, used, output_tokens, cached_tokens, now, now_s
        )
        record.settlement = dataclasses.replace(settlement, record_lost=lost)
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
        return self._cancel(reservation_key, token_counters, tombstone_ttl_s, now, now_s)

    def _cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int,
        now: float,
        now_s: int,
        reason: SettleReason = "cancelled",
    ) -> Settlement:
        record = self._record(reservation_key, now)
        self._unlist(reservation_key, self.owner_id)
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
            record.settlement = self._settle(record, token_counters, 0, None, 0, now, now_s)
            self._append(reservation_key, record, reason, None, now)
        else:
            zeros = tuple(0 for _ in token_counters)
            record.settlement = Settlement(
                reserved=0, used=0, refunded=0, refunded_per_counter=zeros
            )
        record.cancelled = True
        return record.settlement

    async def settle_orphan(
        self, reservation_key: str, owner_id: str
    ) -> tuple[str, Settlement | None]:
        """settle.lua's orphan mode: ``owner_id``'s open record, used = what it reserved."""
        if not owner_id:
            raise ValueError("owner_id must be non-empty")
        now, now_s = self._tick()
        record = self._record(reservation_key, now)
        self._unlist(reservation_key, owner_id)
        if record is not None and record.settlement is not None:
            return "already_settled", self._already_settled(record.settlement)
        if record is None or not record.admitted:
            return "no_record", None
        if record.owner != owner_id:
            return "not_owned", None
        record.settlement = self._settle(record, (), record.reserved, None, 0, now, now_s)
        self._append(reservation_key, record, "orphaned", None, now)
        record.expires_at = min(record.expires_at, now + self.settled_ttl_s)
        return "settled", record.settlement

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
        output_tokens: int | None,
        cached_tokens: int,
        now: float,
        now_s: int,
    ) -> Settlement:
        """Commit ``used`` and refund the rest of an admitted record (settle.lua)."""
        if output_tokens is None:
            output_tokens = used - min(record.tags.prompt_tokens, used)
        prompt = used - output_tokens
        cached = min(cached_tokens, prompt)
        refunds: list[int] = []
        record.net = dict(record.charged)
        for c in token_counters:
            o = _Open(self, c, now_s, now)
            o.read()
            w_in, w_out, w_cached = c.weights
            used_c = (prompt - cached) * w_in + output_tokens * w_out + cached * w_cached
            charged = o.charged(record)
            left = sum(amount for _, amount, _ in charged) - used_c
            refunded = 0
            for start, amount, key in charged:
                if left <= 0:
                    break
                take = min(left, amount)
                left -= take
                got = o.refund(start, take)
                if got > 0:
                    refunded += got
                    record.net[key] -= got
            if left < 0:
                key = o.charge(-left)
                record.net[key] = record.net.get(key, 0) - left
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
        tenant, request_id = reservation_names(reservation_key)
        fields = {
            "tenant": tenant,
            "plan": record.tags.plan,
            "model": record.tags.model,
            "request_id": request_id,
            "client_request_id": record.tags.client_request_id,
            "prompt_tokens": str(prompt),
            "output_tokens": str(output_tokens),
            "reserved": str(settlement.reserved),
            "used": str(used),
            "refunded": str(settlement.refunded),
            "windows": windows.ledger_windows(record.net.items()),
            "reason": reason,
            "admitted_at_us": record.admitted_at_us,
            "settled_at_us": _micros(now),
        }
        self._add_entry(usage_stream_key(reservation_key), fields, now)

    def _add_entry(self, stream_key: str, fields: dict[str, str], now: float) -> None:
        """XADD (an id after the last one) with the ledger's MAXLEN and MINID bounds."""
        ms = math.floor(now * 1000)
        seq = self._last_id[1] + 1 if ms <= self._last_id[0] else 0
        ms = max(ms, self._last_id[0])
        self._last_id = (ms, seq)
        stream = self._ledgers.setdefault(stream_key, deque())
        stream.append((f"{ms}-{seq}", fields))
        if self.ledger.max_len > 0:
            while len(stream) > self.ledger.max_len:
                stream.popleft()
        if self.ledger.retention_s > 0:
            horizon = math.floor(now * 1000) - self.ledger.retention_s * 1000
            while stream and int(stream[0][0].split("-")[0]) < horizon:
                stream.popleft()

    async def absorb(self, absorption: Absorption) -> bool:
        """absorb.lua: each entry into its counter's current window, once per record key."""
        now, now_s = self._tick()
        if absorption.key in self._absorbed and self._absorbed[absorption.key] > now:
            return False
        nets: dict[str, int] = {}
        for prefix, window_s, _, amount in absorption.entries:
            current = windows.window_start(now_s, window_s)
            key = window_key(prefix, current)
            value, expires = self._counters.get(key, (0, 0.0))
            value = (value if expires > now else 0) + amount
            if value == amount:  # INCRBY made the key (or found 0): PEXPIREAT
                expires = current + window_s + windows.EXPIRY_MARGIN_S
            self._counters[key] = (value, expires)
            nets[key] = nets.get(key, 0) + amount
        self._absorbed[absorption.key] = now + RECORD_TTL_S
        usage = absorption.usage
        if usage is not None and self.ledger.enabled:
            tenant, request_id = reservation_names(absorption.key.removesuffix(":absorb"))
            used = usage.prompt_tokens + usage.output_tokens
            self._add_entry(
                usage_stream_key(absorption.key),
                {
                    "tenant": tenant,
                    "plan": usage.plan,
                    "model": usage.model,
                    "request_id": request_id,
                    "client_request_id": usage.client_request_id,
                    "prompt_tokens": str(usage.prompt_tokens),
                    "output_tokens": str(usage.output_tokens),
                    "reserved": str(used),
                    "used": str(used),
                    "refunded": "0",
                    "windows": windows.ledger_windows(nets.items(), ranked_only=True),
                    "reason": usage.reason,
                    "admitted_at_us": usage.admitted_at_us,
                    "settled_at_us": _micros(now),
                },
                now,
            )
        return True

    async def flush(self, timeout_s: float) -> bool:
        return True  # every call is applied as it is made

    async def check(self) -> None:
        return None  # in process: always answers

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._counters.clear()
        self._records.clear()
        self._ledgers.clear()


def _micros(now: float) -> str:
    """Microseconds since the epoch, as settle.lua writes TIME (seconds + 6 digits)."""
    return str(round(now * 1_000_000))
