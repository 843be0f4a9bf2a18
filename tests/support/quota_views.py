"""What a tenant's counters, records and ledger hold, read from either backend.

The Redis readers look at the keys the scripts wrote (a plain client, bypassing the
backend); the memory readers at the memory backend's own tables. Both give the same shape,
so a test can compare the two backends' state.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import redis

from extproc.quota import keys, windows
from extproc.quota.base import Counter, Period
from extproc.quota.calendar import compute_calendar_bounds
from extproc.quota.memory.backend import MemoryQuotaBackend


def counter_total(client: redis.Redis, tenant: str, kind: str) -> int:
    """Sum over every stored window of one kind of counter of a tenant (a sliding counter
    is one hash: its live buckets' ``sum``)."""
    total = 0
    for key in client.scan_iter(match=f"tq:{{{tenant}}}:c:{kind}:*"):
        if client.type(key) == "hash":
            total += int(client.hget(key, "sum") or 0)
        else:
            total += int(client.get(key) or 0)
    return total


def server_now(client: redis.Redis) -> float:
    """Redis's clock (``TIME``), in seconds."""
    seconds, micros = cast(tuple[int, int], client.time())
    return seconds + micros / 1e6


def ledger(
    client: redis.Redis, tenant: str, prefix: str = keys.DEFAULT_PREFIX
) -> list[dict[str, str]]:
    """The tenant's usage ledger entries, oldest first."""
    stream = keys.usage_stream_key(keys.reservation_key(tenant, "x", prefix))
    return [fields for _, fields in client.xrange(stream)]


def _window_nets(entries: list[dict[str, str]], kind: str) -> Iterator[tuple[str, str, int]]:
    """(span, start, net) of each window of ``kind`` the entries list."""
    for fields in entries:
        for part in filter(None, fields["windows"].split(";")):
            part_kind, rest = part.split(":", 1)
            if part_kind == kind:
                where, net = rest.rsplit(":", 1)
                span, _, start = where.rpartition(":")
                yield span, start, int(net)


def ledger_net(entries: list[dict[str, str]], kind: str) -> int:
    """What the ledger says the tenant's ``kind`` counters keep, summed over its windows."""
    return sum(net for _, _, net in _window_nets(entries, kind))


Window = tuple[int, int]  # (window_s, start) of a fixed window


def live_books(
    client: redis.Redis, tenant: str, kind: str, prefix: str = keys.DEFAULT_PREFIX
) -> tuple[dict[Window, int], dict[Window, int]]:
    """(counters, ledger) of a tenant's fixed windows of ``kind``: (window_s, start) -> what
    the counters hold and what the ledger's entries say those windows keep, over the
    windows whose counter keys live through the whole read.

    A window's counter key expires ``EXPIRY_MARGIN_S`` after the window ends; its ledger
    entries stay. A test that runs across a window boundary would otherwise find the ended
    window in the ledger but not in the counters. Windows ending by Redis's clock read after
    both are left out of both sides; every other window is compared whole.
    """
    head = f"{_glob_escape(keys.tenant_tag(tenant, prefix))}:c:{kind}:*"
    counted: dict[Window, int] = {}
    for key in client.scan_iter(match=head, count=1000):
        *_, span, start = key.split(":")
        if span.isdigit() and start.isdigit():
            window = (int(span), int(start))
            counted[window] = counted.get(window, 0) + int(client.get(key) or 0)
    listed: dict[Window, int] = {}
    for span, start, net in _window_nets(ledger(client, tenant, prefix), kind):
        window = (int(span), int(start))
        listed[window] = listed.get(window, 0) + net
    now = server_now(client)

    def live(window: Window) -> bool:
        span, start = window
        return start + span + windows.EXPIRY_MARGIN_S > now

    return (
        {w: v for w, v in counted.items() if live(w) and v},
        {w: v for w, v in listed.items() if live(w) and v},
    )


# --- one view of both backends: what a differential test compares ----------------------

_GLOB = re.compile(r"([*?\[\]\\])")


def _glob_escape(key: str) -> str:
    # A tenant-wide counter's model part is "*", a glob character for SCAN MATCH.
    return _GLOB.sub(r"\\\1", key)


def _window_end(counter: Counter, start: int) -> int:
    if counter.shape == "calendar":
        period = cast(Period, counter.period)
        return compute_calendar_bounds(period, counter.timezone, start)[1]
    return start + counter.window_s


def _live_window(counter: Counter, start: int, now: float) -> bool:
    """A window's key outlives the window by ``EXPIRY_MARGIN_S`` (what the memory backend
    expires by its clock; Redis keys expire by the server's own, a test-shifted TIME aside)."""
    return _window_end(counter, start) + windows.EXPIRY_MARGIN_S > now


def _live_buckets(counter: Counter, buckets: dict[int, int], now: float) -> dict[int, int]:
    now_s = int(now)
    cutoff = now_s - now_s % counter.bucket_s - counter.window_s
    return {start: v for start, v in buckets.items() if start >= cutoff and v != 0}


def redis_windows(client: redis.Redis, counter: Counter, now: float) -> dict[int, int]:
    """A counter's windows (fixed, calendar) or buckets (sliding) that count at ``now``:
    start -> value, zeros left out (a window refunded to 0 holds nothing)."""
    return redis_windows_of(client, (counter,), now)[0]


def redis_windows_of(
    client: redis.Redis, counters: tuple[Counter, ...], now: float
) -> list[dict[int, int]]:
    """``redis_windows`` of several counters in two round trips (a SCAN per tenant, then
    one pipeline)."""
    tags = {c.key[: c.key.index("}") + 1] for c in counters if c.shape != "sliding"}
    stored = [
        key
        for tag in sorted(tags)
        for key in client.scan_iter(match=_glob_escape(tag) + ":c:*", count=1000)
    ]
    pipe = client.pipeline(transaction=False)
    asked: list[list[tuple[int, str]]] = []
    for c in counters:
        if c.shape == "sliding":
            pipe.hgetall(c.key)
            asked.append([])
            continue
        head = c.key + ":"
        starts = [(k[len(head) :], k) for k in stored if k.startswith(head)]
        live = [(int(t), k) for t, k in starts if t.isdigit() and _live_window(c, int(t), now)]
        asked.append(live)
        for _, key in asked[-1]:
            pipe.get(key)
    replies = iter(pipe.execute())
    out: list[dict[int, int]] = []
    for c, windows_asked in zip(counters, asked, strict=True):
        if c.shape == "sliding":
            fields = next(replies)
            buckets = {int(f): int(v) for f, v in fields.items() if f.isdigit()}
            out.append(_live_buckets(c, buckets, now))
            continue
        values = {start: int(next(replies) or 0) for start, _ in windows_asked}
        out.append({start: v for start, v in values.items() if v})
    return out


def memory_windows(backend: MemoryQuotaBackend, counter: Counter, now: float) -> dict[int, int]:
    """``redis_windows`` for the memory backend (read at its own clock: pass it as ``now``)."""
    if counter.shape == "sliding":
        h = backend._sliding.get(counter.key)
        if h is None or h.expires_at <= now:
            return {}
        return _live_buckets(counter, h.buckets, now)
    head = counter.key + ":"
    found: dict[int, int] = {}
    for key, value in backend.counters().items():
        start = key[len(head) :]
        live = key.startswith(head) and start.isdigit() and value
        if live and _live_window(counter, int(start), now):
            found[int(start)] = value
    return found


@dataclass(frozen=True, slots=True)
class RecordView:
    """A reservation record's content, whatever the backend's encoding."""

    admitted: bool  # an admission ran and admitted (False: refused, or a tombstone)
    reserved: int
    charged: dict[str, int]  # window key -> what the request was charged there
    grants: dict[int, int]  # lease seq -> tokens granted
    settled: bool
    cancelled: bool
    tombstone: bool  # written by a cancel that met no admission
    # An admission block: request slots left, and per request counter's window key the
    # slots it can give back.
    slots: int = 0
    slot_windows: dict[str, int] | None = None


def redis_record(client: redis.Redis, reservation_key: str) -> RecordView | None:
    rec = client.hgetall(reservation_key)
    if not rec:
        return None
    return RecordView(
        admitted=rec.get("v", "").startswith("1"),
        reserved=int(rec.get("res", 0)),
        charged={f[1:]: int(v) for f, v in rec.items() if f.startswith("k")},
        grants={int(f[1:]): int(v) for f, v in rec.items() if f[:1] == "q" and f[1:].isdigit()},
        settled="st" in rec,
        cancelled="c" in rec,
        tombstone="v" not in rec,
        slots=int(rec.get("rq", 0)),
        slot_windows={
            f[1:]: int(v) for f, v in rec.items() if f[:1] == "q" and not f[1:].isdigit()
        },
    )


def memory_record(backend: MemoryQuotaBackend, reservation_key: str) -> RecordView | None:
    record = backend._record(reservation_key, backend._clock())
    if record is None:
        return None
    return RecordView(
        admitted=record.admitted,
        reserved=record.reserved,
        charged=dict(record.charged),
        grants=dict(record.grants),
        settled=record.settlement is not None,
        cancelled=record.cancelled,
        tombstone=record.tombstone,
        slots=record.slots,
        slot_windows=dict(record.slot_windows),
    )


def redis_ledger_entries(client: redis.Redis, stream_key: str) -> list[dict[str, str]]:
    """A usage ledger stream's entries (``keys.usage_stream_key``), oldest first, no ids."""
    return [fields for _, fields in client.xrange(stream_key)]


def memory_ledger_entries(backend: MemoryQuotaBackend, stream_key: str) -> list[dict[str, str]]:
    return [fields for _, fields in backend.ledger_entries(stream_key)]
