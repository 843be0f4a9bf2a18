"""What a tenant's counters and ledger hold in Redis, whatever the window shape."""

from __future__ import annotations

import redis


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


def ledger(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    """The tenant's usage ledger entries, oldest first."""
    return [fields for _, fields in client.xrange(f"tq:{{{tenant}}}:usage")]


def ledger_net(entries: list[dict[str, str]], kind: str) -> int:
    """What the ledger says the tenant's ``kind`` counters keep, summed over its windows."""
    total = 0
    for fields in entries:
        for part in filter(None, fields["windows"].split(";")):
            if part.split(":", 1)[0] == kind:
                total += int(part.rsplit(":", 1)[1])
    return total
