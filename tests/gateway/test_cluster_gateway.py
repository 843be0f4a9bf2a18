"""Envoy → processor → Redis Cluster: streams of tenants on all three masters are billed
exactly, before and after a master fails over (``CLUSTER FAILOVER`` on its replica).

The processor runs with a ``redis+cluster://`` URL of six real cluster nodes. Each tenant's
TPM counter, read on the master that holds its slot, must equal the ``total_tokens`` the
upstream reported for its streams, and its RPM counter the number of its requests.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import redis

from extproc.quota import keys
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.gateway import start_gateway, wait_until
from tests.support.redis_cluster import RedisClusterSet
from tests.support.simulator import Simulator
from tests.support.sse_client import StreamResult, stream_http1

STREAMS = 4  # per tenant and batch
REQUEST = {
    "model": "gpt-4.1",
    "max_tokens": 24,
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "Tell me about clusters"}],
}


def one_tenant_per_master(cluster: RedisClusterSet) -> dict[int, str]:
    found: dict[int, str] = {}
    for i in itertools.count():
        name = f"cl{i}"
        found.setdefault(cluster.master_of(keys.tenant_tag(name)), name)
        if len(found) == len(cluster.topology()):
            return found
    raise AssertionError("unreachable")


def master_client(cluster: RedisClusterSet, tenant: str) -> redis.Redis:
    return cluster.node(cluster.master_of(keys.tenant_tag(tenant))).client()


async def batch(url: str, tenants: list[str]) -> dict[str, list[StreamResult]]:
    calls = {
        t: [stream_http1(url, tenant_key(t), REQUEST) for _ in range(STREAMS)] for t in tenants
    }
    results = await asyncio.gather(*(c for cs in calls.values() for c in cs))
    out: dict[str, list[StreamResult]] = {}
    for i, tenant in enumerate(t for t in tenants for _ in range(STREAMS)):
        out.setdefault(tenant, []).append(results[i])
    return out


def test_streams_on_every_master_are_billed_exactly_across_a_failover(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    cluster = RedisClusterSet.start(tmp_path / "cluster")
    try:
        cluster.wait_replicas_synced()
        by_master = one_tenant_per_master(cluster)
        tenants = list(by_master.values())
        plan = {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1000, "tpm": 1_000_000}}}
        config = write_processor_config(
            tmp_path / "quota.yaml", {t: plan for t in tenants}, redis_url=cluster.url
        )
        gateway = start_gateway(config, tmp_path, [s.port for s in simulators])
        billed = dict.fromkeys(tenants, 0)
        try:
            url = gateway.base_url + "/v1/chat/completions"
            for phase in ("before", "after"):
                if phase == "after":  # the master of the first tenant hands over
                    victim = next(iter(by_master))
                    replica = cluster.node(cluster.topology()[victim][0])
                    replica.client().execute_command("CLUSTER FAILOVER")
                    cluster.wait_master_changed(victim)
                answers = asyncio.run(batch(url, tenants))
                for tenant, results in answers.items():
                    for result in results:
                        assert result.status == 200 and result.done, (phase, tenant, result)
                        assert result.usage is not None
                        billed[tenant] += result.usage["total_tokens"]
                for tenant in tenants:
                    client = master_client(cluster, tenant)
                    assert wait_until(
                        lambda c=client, t=tenant: (
                            counter_value(c, t, "tpm", "gpt-4.1") == billed[t]
                        ),
                        timeout_s=30,
                    ), (phase, tenant, counter_value(client, tenant, "tpm", "gpt-4.1"), billed)
                    requests = STREAMS * (1 if phase == "before" else 2)
                    assert counter_value(client, tenant, "rpm", "gpt-4.1") == requests
        finally:
            gateway.stop()
    finally:
        cluster.stop()
