"""CPU per script call for each Redis topology, side by side: one server, Cluster, Sentinel.

Runs a small script (one INCRBY on a tenant's key) through the ``scripts`` object the quota
backend uses for each topology: ``RespConnection`` (``redis://``), ``ClusterConnection``
(``redis+cluster://``: one pipelined connection per master) and ``SentinelConnection``
(``redis+sentinel://``); and, as the baseline the last two replaced, redis-py's own
``RedisCluster`` and ``Sentinel.master_for`` clients (what the backend ran the scripts on
before). ``concurrency`` calls are in flight; the keys spread over 64 tenants, so every
master of the cluster gets its share. Rounds alternate between the variants, so load on
the machine affects all alike; the processor's CPU time (``time.process_time``) per call
is summed over the rounds. Servers are started here (loadlab) on free ports and
stopped by PID.

    python benchmarks/bench_topologies.py [--calls 20000] [--concurrency 16] [--rounds 5]

Target (issue 21): Cluster and Sentinel ≤ 1.5 × the CPU per call of one server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.exceptions import NoScriptError

from extproc.quota.factory import backend_from_url
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.redis.resp import Script
from extproc.quota.redis.topology import build_client, parse_redis_url
from loadlab.redis_cluster import RedisClusterSet, SentinelSet
from loadlab.redis_server import RedisServer

SCRIPT = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
KEYS = [f"bench:{{t{i}}}:k" for i in range(64)]  # tenants over every slot range
TARGET = 1.5


class RedisPyScripts:
    """The baseline: EVALSHA (EVAL on NOSCRIPT) on a redis-py client, as before."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.execute_command("EVAL", script.text, len(keys), *keys, *args)

    async def close(self) -> None:
        await self.client.aclose()


async def round_of(scripts: Any, calls: int, concurrency: int) -> tuple[float, int]:
    """(CPU seconds, calls done) of one round."""
    per_task = calls // concurrency

    async def worker(offset: int) -> None:
        for i in range(per_task):
            await scripts.run_script(SCRIPT, [KEYS[(offset + i) % len(KEYS)]], [1])

    cpu = time.process_time()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return time.process_time() - cpu, per_task * concurrency


async def run(urls: dict[str, str], calls: int, concurrency: int, rounds: int) -> None:
    variants: dict[str, Any] = {}
    backends: list[RedisQuotaBackend] = []
    for name, url in urls.items():
        backend = backend_from_url(url, command_timeout_s=5.0)
        assert isinstance(backend, RedisQuotaBackend)
        backends.append(backend)
        variants[name] = backend._scripts  # the object under measurement
    for name in ("cluster", "sentinel"):
        variants[f"{name} (redis-py, before)"] = RedisPyScripts(
            build_client(parse_redis_url(urls[name]), command_timeout_s=5.0)
        )
    for scripts in variants.values():  # warm: connections open, script loaded on every node
        for key in KEYS:
            await scripts.run_script(SCRIPT, [key], [1])
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, scripts in variants.items():
            spent, done = await round_of(scripts, calls // rounds, concurrency)
            cpu[name].append(spent / done * 1e6)
    single = statistics.median(cpu["single"])
    print(f"{'variant':28s} {'µs CPU/call':>12s} {'× single':>9s}   (median of {rounds} rounds)")
    for name, per_round in cpu.items():
        median = statistics.median(per_round)
        target = "" if "before" in name or name == "single" else (
            "  ok" if median <= TARGET * single else f"  ABOVE {TARGET}×"
        )  # fmt: skip
        print(f"{name:28s} {median:12.1f} {median / single:9.2f}{target}")
    for scripts in variants.values():
        if isinstance(scripts, RedisPyScripts):
            await scripts.close()
    for backend in backends:
        await backend.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000, help="per variant, over all rounds")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = RedisServer.start(root / "single")
        cluster = RedisClusterSet.start(root / "cluster")
        sentinel = SentinelSet.start(root / "sentinel")
        try:
            urls = {"single": single.url, "cluster": cluster.url, "sentinel": sentinel.url}
            asyncio.run(run(urls, args.calls, args.concurrency, args.rounds))
        finally:
            sentinel.stop()
            cluster.stop()
            single.stop()


if __name__ == "__main__":
    main()
