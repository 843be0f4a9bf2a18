"""Pick the quota backend from the configured URL."""

from __future__ import annotations

from typing import Any

from extproc.metrics import Metrics
from extproc.quota.base import QuotaBackend
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.redis.topology import backend_for, parse_redis_url
from extproc.quota.resilience.backend import Resilience, ResilientQuotaBackend


def backend_from_url(
    url: str,
    *,
    resilience: Resilience | None = None,
    metrics: Metrics | None = None,
    **redis_options: Any,
) -> QuotaBackend:
    """``memory://`` for the single-instance embedded backend; ``redis://``, ``rediss://``
    or ``unix://`` for the shared Redis backend (options go to ``RedisQuotaBackend.from_url``);
    ``redis+cluster://`` and ``redis+sentinel://`` (``rediss+…``: TLS) for the same backend on
    a Cluster (a pipelined connection per master) or a Sentinel-managed master
    (``extproc.quota.redis.topology``; same options).

    With ``resilience`` (the processor always passes it) a Redis backend is wrapped in
    ``ResilientQuotaBackend``: a circuit breaker per master, fail-open allowance, and a queue
    for what Redis cannot take yet; ``metrics`` receives its counters. ``memory://`` cannot fail and
    is never wrapped.
    """
    if url == "memory://" or url.startswith("memory://"):
        if url != "memory://":
            raise ValueError(f"memory:// takes no host, path or options: {url!r}")
        return MemoryQuotaBackend(ledger=redis_options.get("ledger"))
    topology = parse_redis_url(url)
    if topology.kind == "single":
        backend = RedisQuotaBackend.from_url(url, **redis_options)
    else:
        backend = backend_for(topology, **redis_options)
    if resilience is None:
        return backend
    return ResilientQuotaBackend(
        backend,
        failures=resilience.failures,
        probe_interval_s=resilience.probe_interval_s,
        queue_max=resilience.queue_max,
        fail_open_workers=resilience.fail_open_workers,
        metrics=metrics,
    )
