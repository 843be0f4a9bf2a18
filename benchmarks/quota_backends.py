"""Latency and throughput of the quota backends, memory and Redis side by side.

Run: .venv/bin/python benchmarks/quota_backends.py [--n 3000]
Starts its own redis-server on a free loopback port (stopped by PID at the end).
Figures: p50/p99 of admit, reserve (lease batch) and settle with one call in flight;
admissions/s with 50 in flight; Redis round trips per operation from INFO commandstats.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis

from extproc.quota.base import AdmitRequest, Counter, QuotaBackend
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.figures import percentile
from loadlab.redis_server import RedisServer

BIG = 10**12


def counters(tenant: str) -> tuple[Counter, tuple[Counter, ...]]:
    rpm = Counter("rpm", counter_key(tenant, "rpm", "gpt-4.1", 60), BIG, 60)
    tokens = (
        Counter("tpm", counter_key(tenant, "tpm", "gpt-4.1", 60), BIG, 60),
        Counter("tenant_tpm", counter_key(tenant, "tenant_tpm", None, 60), BIG, 60),
        Counter("daily", counter_key(tenant, "daily", None, 86400), BIG, 86400),
    )
    return rpm, tokens


def pct(samples: list[float], p: float) -> float:
    """The percentile in ms of samples in seconds."""
    return percentile(samples, p) * 1000


async def sequential(backend: QuotaBackend, n: int, tag: str) -> dict[str, list[float]]:
    rpm, tokens = counters("bench")
    times: dict[str, list[float]] = {"admit": [], "reserve": [], "settle": []}
    for i in range(n):
        key = reservation_key("bench", f"{tag}-{i}")
        t0 = time.perf_counter()
        await backend.admit(AdmitRequest(key, (rpm,), tokens, 4096 + 32))
        t1 = time.perf_counter()
        await backend.reserve(key, 1, tokens, 32)
        t2 = time.perf_counter()
        await backend.settle(key, tokens, used=4096 + 40)
        t3 = time.perf_counter()
        times["admit"].append(t1 - t0)
        times["reserve"].append(t2 - t1)
        times["settle"].append(t3 - t2)
    return times


async def concurrent_admits(backend: QuotaBackend, n: int, in_flight: int, tag: str) -> float:
    rpm, tokens = counters("bench")
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            key = reservation_key("bench", f"{tag}-c{i}")
            await backend.admit(AdmitRequest(key, (rpm,), tokens, 4096))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return n / (time.perf_counter() - t0)


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as server:
        plain = aioredis.Redis(port=server.port, decode_responses=True)
        results: dict[str, tuple[dict[str, list[float]], float]] = {}
        commands_per_op = 0.0
        server_us = 0.0
        for name in ("memory", "redis"):
            backend: QuotaBackend = (
                MemoryQuotaBackend() if name == "memory" else RedisQuotaBackend.from_url(server.url)
            )
            await sequential(backend, 200, f"{name}-warm")  # loads scripts, fills the pool
            await plain.config_resetstat()
            times = await sequential(backend, n, name)
            if name == "redis":
                stats = await plain.info("commandstats")
                # Commands run inside scripts are counted too; a round trip is one
                # command sent by the client, i.e. everything but the scripts' own calls.
                sent = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script", "cmdstat_ping")
                calls = sum(stats.get(k, {}).get("calls", 0) for k in sent)
                commands_per_op = calls / (3 * n)
                server_us = stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0)
            rate = await concurrent_admits(backend, n, 50, name)
            results[name] = (times, rate)
            await backend.close()
        await plain.aclose()

    print(f"quota backends, {n} requests (admit 4k-token reservation on 4 counters)")
    print(f"{'op':<10}{'memory p50/p99 ms':>22}{'redis p50/p99 ms':>22}{'ratio p99':>12}")
    for op in ("admit", "reserve", "settle"):
        m, r = results["memory"][0][op], results["redis"][0][op]
        print(
            f"{op:<10}{pct(m, 50):>10.3f} /{pct(m, 99):>8.3f}  {pct(r, 50):>10.3f} /"
            f"{pct(r, 99):>8.3f}  {pct(r, 99) / pct(m, 99):>10.1f}x"
        )
    print(
        f"admits/s with 50 in flight: memory {results['memory'][1]:,.0f}, "
        f"redis {results['redis'][1]:,.0f}"
    )
    print(f"redis round trips per admit/reserve/settle (client commands): {commands_per_op:.2f}")
    print(f"redis server time per script call (usec_per_call of EVALSHA): {server_us:.1f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=3000)
    asyncio.run(main(parser.parse_args().n))
