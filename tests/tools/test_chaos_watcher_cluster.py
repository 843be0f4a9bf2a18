"""The chaos report's watcher on a real Redis Cluster: it reads every master, and while a
master is SIGKILLed and not yet replaced it reads that shard from its replica, so a window
ending during a failover is still read final (tests/tools/test_chaos_crash.py runs it
under load; this is the mechanism alone)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from extproc.quota import keys
from loadlab.integrity import Watcher
from loadlab.redis_cluster import RedisClusterSet

pytestmark = pytest.mark.slow


def counter_on(cluster: RedisClusterSet, master: int) -> tuple[str, str]:
    """(tenant, a live TPM window key of it) whose slot ``master`` serves."""
    for i in range(10_000):
        tenant = f"w{i}"
        if cluster.master_of(keys.tenant_tag(tenant)) == master:
            head = keys.counter_key(tenant, "tpm", "m", 60)
            return tenant, keys.window_key(head, int(time.time()) // 60 * 60)
    raise AssertionError("no tenant on that master")


def test_a_killed_masters_shard_is_read_from_its_replica_until_and_after_the_failover(
    tmp_path: Path,
) -> None:
    cluster = RedisClusterSet.start(tmp_path / "cluster")
    try:
        cluster.wait_replicas_synced()
        topology = cluster.topology()
        shards = [[m, *r] for m, r in sorted(topology.items())]
        victim = shards[1][0]
        written: dict[str, int] = {}
        for master in topology:
            tenant, key = counter_on(cluster, master)
            client = cluster.node(master).client()
            client.set(key, 100 + len(written), ex=600)
            # On the replica before the kill: what the read below must find there.
            assert client.execute_command("WAIT", 1, 10_000) == 1
            written[tenant] = 100 + len(written)

        async def run() -> tuple[bool, bool, Watcher]:
            w = Watcher(
                "",
                cluster_ports=[n.port for n in cluster.nodes],
                cluster_shards=lambda: shards,
            )
            try:
                before = await w.read(None)  # type: ignore[arg-type]
                cluster.node(victim).kill()
                during = await w.read(None)  # type: ignore[arg-type]
                return before, during, w
            finally:
                await w.close()

        before, during, w = asyncio.run(run())
        assert before and during  # every shard read, the dead master's from its replica
        assert w.replica_reads == 1
        seen = {x.tenant: x.value for x in w.windows.values()}
        assert seen == {keys.encode_name(t): v for t, v in written.items()}
        cluster.wait_master_changed(victim)
    finally:
        cluster.stop()
