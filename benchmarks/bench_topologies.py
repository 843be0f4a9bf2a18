"""CPU per EVALSHA for each Redis topology: one server, Redis Cluster, Sentinel.

Runs a small script (one INCRBY on the tenant's key) through the ``scripts`` object the
quota backend uses for each topology (``RespConnection`` for ``redis://``, ``ClientScripts``
on redis-py's ``RedisCluster`` / Sentinel client otherwise), with ``concurrency`` calls in
flight, and prints the processor's CPU time (``time.process_time``) per call. Servers are
started here (tests/support) on free ports and stopped by PID.

    python benchmarks/bench_topologies.py [--calls 20000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.quota.factory import backend_from_url
from extproc.quota.resp import Script
from tests.support.redis_cluster import RedisClusterSet, SentinelSet
from tests.support.redis_server import RedisServer

SCRIPT = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")


async def measure(url: str, calls: int, concurrency: int) -> tuple[float, float]:
    """(µs of CPU per call, calls per wall second)."""
    backend = backend_from_url(url, command_timeout_s=5.0)
    scripts = backend._scripts  # the object under measurement
    keys = [f"bench:{{t{i}}}:k" for i in range(64)]  # tenants over every slot range
    for key in keys:  # warm: connections open, script loaded on every node
        await scripts.run_script(SCRIPT, [key], [1])
    per_task = calls // concurrency

    async def worker(offset: int) -> None:
        for i in range(per_task):
            await scripts.run_script(SCRIPT, [keys[(offset + i) % len(keys)]], [1])

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await backend.close()
    done = per_task * concurrency
    return cpu / done * 1e6, done / wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = RedisServer.start(root / "single")
        cluster = RedisClusterSet.start(root / "cluster")
        sentinel = SentinelSet.start(root / "sentinel")
        try:
            for name, url in (
                ("single (RespConnection)", single.url),
                ("cluster (RedisCluster)", cluster.url),
                ("sentinel (master_for)", sentinel.url),
            ):
                cpu_us, rate = asyncio.run(measure(url, args.calls, args.concurrency))
                print(f"{name:26s} {cpu_us:7.1f} µs CPU/call  {rate:8.0f} calls/s")
        finally:
            sentinel.stop()
            cluster.stop()
            single.stop()


if __name__ == "__main__":
    main()
