"""Pick the quota backend from the configured URL."""

from __future__ import annotations

from typing import Any

from extproc.quota.base import QuotaBackend
from extproc.quota.memory_backend import MemoryQuotaBackend
from extproc.quota.redis_backend import RedisQuotaBackend


def backend_from_url(url: str, **redis_options: Any) -> QuotaBackend:
    """``memory://`` for the single-instance embedded backend; ``redis://``, ``rediss://``
    or ``unix://`` for the shared Redis backend (options go to ``RedisQuotaBackend.from_url``)."""
    if url == "memory://" or url.startswith("memory://"):
        if url != "memory://":
            raise ValueError(f"memory:// takes no host, path or options: {url!r}")
        return MemoryQuotaBackend()
    return RedisQuotaBackend.from_url(url, **redis_options)
