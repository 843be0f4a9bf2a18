"""Reading the usage ledger: connecting, finding the tenant streams, parsing entries.

Each tenant has one Redis Stream, ``<prefix>:{<tenant>}:usage`` (``keys.usage_stream_key``),
written by settle.lua; entry ids are the server's milliseconds at settlement.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from redis.cluster import RedisCluster

from extproc.quota.base import LEDGER_FIELDS
from extproc.quota.keys import DEFAULT_PREFIX

INT_FIELDS = frozenset(
    {
        "prompt_tokens",
        "output_tokens",
        "reserved",
        "used",
        "refunded",
        "admitted_at_us",
        "settled_at_us",
    }
)
# What every exported record holds: where it came from, then the entry's fields.
COLUMNS: tuple[str, ...] = ("stream", "id", *LEDGER_FIELDS)


class UsageError(Exception):
    """Bad input or an unreachable server: one line for the user, exit status 2."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """A connection to the server (or cluster) that holds the ledger streams."""

    client: Any  # redis.Redis or RedisCluster
    scanners: tuple[redis.Redis, ...]  # one per primary: SCAN is per node
    prefix: str = DEFAULT_PREFIX

    def streams(self) -> list[str]:
        """Every tenant's ledger stream under ``prefix`` (SCAN, TYPE stream), sorted."""
        found: set[str] = set()
        for node in self.scanners:
            for key in node.scan_iter(
                match=f"{_glob_escape(self.prefix)}:{{*}}:usage", _type="stream"
            ):
                found.add(key)
        return sorted(found)

    def close(self) -> None:
        self.client.close()


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def connect(
    url: str,
    prefix: str = DEFAULT_PREFIX,
    *,
    username: str | None = None,
    password: str | None = None,
) -> Ledger:
    """A client for ``url``; on a cluster, one scanner per primary. ``username`` and
    ``password`` override the URL's (an ACL user such as deploy/redis/users.acl's
    read-only ``ledger-exporter``)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(f"not a Redis URL (redis://, rediss://, unix://): {url!r}")
    if not prefix or any(c in prefix for c in "{}"):
        raise UsageError(f"key prefix must be non-empty and brace-free, got {prefix!r}")
    auth = {k: v for k, v in (("username", username), ("password", password)) if v is not None}
    try:
        client = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, **auth)
        cluster = client.info("cluster").get("cluster_enabled") == 1
    except ValueError as exc:
        raise UsageError(f"bad Redis URL {url!r}: {exc}") from exc
    except redis.RedisError as exc:
        raise UsageError(f"cannot reach Redis at {url}: {exc}") from exc
    if not cluster:
        return Ledger(client, (client,), prefix)
    client.close()
    try:
        rc = RedisCluster.from_url(url, decode_responses=True, **auth)
        primaries = tuple(rc.get_redis_connection(node) for node in rc.get_primaries())
    except redis.RedisError as exc:
        raise UsageError(f"cannot reach the Redis cluster at {url}: {exc}") from exc
    return Ledger(rc, primaries, prefix)


def parse_time(text: str, what: str) -> int:
    """ISO 8601 (``2026-12-01T10:00:00Z``; no zone = UTC) → milliseconds since the epoch."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UsageError(f"{what}: not an ISO 8601 time: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def time_range(since: str | None, until: str | None) -> tuple[int | None, int | None]:
    since_ms = None if since is None else parse_time(since, "--since")
    until_ms = None if until is None else parse_time(until, "--until")
    if since_ms is not None and until_ms is not None and since_ms >= until_ms:
        raise UsageError(f"--since ({since}) must be before --until ({until})")
    return since_ms, until_ms


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def record(stream: str, entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """One exported record: its stream and id, then every ledger field (ints as ints)."""
    out: dict[str, Any] = {"stream": stream, "id": entry_id}
    for name in LEDGER_FIELDS:
        value = fields.get(name, "")
        out[name] = int(value) if name in INT_FIELDS and value.lstrip("-").isdigit() else value
    return out


def read_range(
    client: Any, stream: str, since_ms: int | None, until_ms: int | None, batch: int = 1000
) -> Iterator[tuple[str, dict[str, str]]]:
    """Entries of ``stream`` settled in [since, until), oldest first, ``batch`` at a time."""
    low = "-" if since_ms is None else str(since_ms)
    high = "+" if until_ms is None else str(until_ms - 1)
    while True:
        entries = client.xrange(stream, min=low, max=high, count=batch)
        yield from entries
        if len(entries) < batch:
            return
        low = "(" + entries[-1][0]
