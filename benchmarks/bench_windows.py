"""Cost per admission of sliding vs fixed windows, side by side, on a real redis-server.

Per window length (60 s and 3600 s) and shape (fixed; sliding in 1 s buckets; for the hour
sliding in 6 s buckets, the 600 the loader allows at most, and in 60 s buckets, its default
of window_s // 60), each request is one
admit + one settle on two counters of that shape (requests and tokens, as a plan's
``rpm``/``tpm`` sugar gives), from one client, one call in flight:

* admit+settle per second, and Redis-side µs per script call (``INFO commandstats``,
  EVALSHA ``usec_per_call``), on a tenant charging all the time in real time;
* keys and bytes (``MEMORY USAGE``) per tenant once its window is full: one charge in every
  bucket of the window. Filled on a Redis-side test clock (``EXTPROC_TEST_CLOCK_KEY``),
  moved one bucket per request, so an hour of traffic takes seconds;
* the dearest calls on that full window: a refusal (a sliding refusal works out when the
  charge would fit, walking the buckets) and the first call after the tenant was idle for
  most of a window (it drops the buckets that left, one by one).

Ratios are sliding / fixed of the same length, from this one run.

    .venv/bin/python benchmarks/bench_windows.py [--quick] [--n 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis

from extproc.quota import keys
from extproc.quota.base import AdmitRequest, Counter
from extproc.quota.redis.backend import TEST_CLOCK_ENV, RedisQuotaBackend
from loadlab.figures import fmt, ratio, table
from loadlab.redis_server import RedisServer

BIG = 10**12
PROMPT, OUTPUT = 100, 40
CLOCK_KEY = "bench:windows:clock"
REPEATS = 20  # refusals averaged
IDLE_REPEATS = 3  # idle gaps averaged (each is a jump of most of a window)


@dataclass(frozen=True)
class Shape:
    name: str
    window_s: int
    sliding: bool
    bucket_s: int = 1

    def counters(self, tenant: str, limit: int = BIG) -> tuple[Counter, Counter]:
        shape = "sliding" if self.sliding else "fixed"
        span = keys.window_span(shape, self.window_s, self.bucket_s)

        def counter(kind: str, limit: int) -> Counter:
            key = keys.counter_key(tenant, kind, "gpt-4.1", self.window_s, span=span)
            return Counter(kind, key, limit, self.window_s, shape=shape, bucket_s=self.bucket_s)

        return counter("rpm", limit), counter("tpm", limit)


SHAPES = (
    Shape("fixed 60 s", 60, False),
    Shape("sliding 60 s / 1 s", 60, True),
    Shape("fixed 3600 s", 3600, False),
    Shape("sliding 3600 s / 6 s", 3600, True, 6),  # 600 buckets: the most the loader allows
    Shape("sliding 3600 s / 60 s", 3600, True, 60),
)


async def request(backend: RedisQuotaBackend, shape: Shape, tenant: str, i: int) -> bool:
    rpm, tpm = shape.counters(tenant)
    key = keys.reservation_key(tenant, f"r{i}")
    verdict = await backend.admit(AdmitRequest(key, (rpm,), (tpm,), PROMPT + OUTPUT))
    await backend.settle(key, (tpm,), used=PROMPT + OUTPUT, output_tokens=OUTPUT)
    return verdict.admitted


async def script_us(plain: aioredis.Redis) -> tuple[float, int]:
    stats = (await plain.info("commandstats")).get("cmdstat_evalsha", {})
    return float(stats.get("usec_per_call", 0.0)), int(stats.get("calls", 0))


async def steady(
    backend: RedisQuotaBackend, plain: aioredis.Redis, shape: Shape, n: int
) -> tuple[float, float]:
    """Requests per second and Redis µs per script call, charging in real time."""
    tenant = f"steady-{uuid.uuid4().hex[:6]}"
    for i in range(50):  # warm: scripts loaded, clock offset learned
        await request(backend, shape, tenant, -1 - i)
    await plain.config_resetstat()
    t0 = time.perf_counter()
    for i in range(n):
        await request(backend, shape, tenant, i)
    rate = n / (time.perf_counter() - t0)
    us, _ = await script_us(plain)
    return rate, us


async def tenant_memory(plain: aioredis.Redis, tenant: str) -> tuple[int, int]:
    """Counter keys of a tenant and their bytes (records and ledger are alike for every
    shape and left out)."""
    found = [k async for k in plain.scan_iter(match=f"{keys.tenant_tag(tenant)}:c:*")]
    sizes = [await plain.memory_usage(k, samples=0) or 0 for k in found]
    return len(found), sum(sizes)


async def per_call_us(plain: aioredis.Redis, calls: Callable[[], Awaitable[object]]) -> float:
    """Redis µs per script call of what ``calls`` runs."""
    await plain.config_resetstat()
    await calls()
    return (await script_us(plain))[0]


async def full_window(
    backend: RedisQuotaBackend, plain: aioredis.Redis, shape: Shape
) -> tuple[int, int, float, float]:
    """Fill one bucket after another for a whole window on the test clock; then the
    tenant's keys and bytes, a refusal's cost and the first call after a long idle."""
    tenant = f"full-{uuid.uuid4().hex[:6]}"

    async def clock_at(instant: int) -> None:
        """The scripts' clock reads ``instant`` (plus this second's fraction); the backend
        is told, so no call pays a "wrong window" retry for the jump."""
        seconds, micros = await plain.time()
        await plain.set(CLOCK_KEY, instant - seconds)
        backend.clock_offset_s = instant + micros / 1e6 - time.time()

    # Start on a fresh window boundary in the future: every shape fills alike.
    start = ((await plain.time())[0] // 86400 + 2) * 86400
    steps = shape.window_s // shape.bucket_s
    for i in range(steps):
        await clock_at(start + i * shape.bucket_s)
        await request(backend, shape, tenant, i)
    count, size = await tenant_memory(plain, tenant)
    now = start + (steps - 1) * shape.bucket_s

    # A refusal: a limit the window is already over.
    rpm, tpm = shape.counters(tenant, limit=steps // 2)

    async def refused() -> None:
        for i in range(REPEATS):
            key = keys.reservation_key(tenant, f"refused-{i}")
            verdict = await backend.admit(AdmitRequest(key, (rpm,), (tpm,), PROMPT))
            assert not verdict.admitted

    await clock_at(now)
    refusal_us = await per_call_us(plain, refused)

    # Idle for all but the last bucket of the window, then one admit + settle.
    idle_us = 0.0
    for i in range(IDLE_REPEATS):
        now += shape.window_s - shape.bucket_s
        await clock_at(now)
        idle_us += await per_call_us(plain, lambda i=i: request(backend, shape, tenant, -1 - i))
    await plain.delete(CLOCK_KEY)
    return count, size, refusal_us, idle_us / IDLE_REPEATS


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(Path(tmp)) as server:
        plain = aioredis.Redis(port=server.port, decode_responses=True)
        backend = RedisQuotaBackend.from_url(server.url)
        os.environ[TEST_CLOCK_ENV] = CLOCK_KEY  # read when a backend loads its scripts
        clocked = RedisQuotaBackend.from_url(server.url)
        del os.environ[TEST_CLOCK_ENV]
        print(
            f"sliding vs fixed windows: {n} admit+settle per shape (2 counters, one client), "
            f"Redis {server.url}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        results = {}
        t0 = time.perf_counter()
        for shape in SHAPES:
            rate, us = await steady(backend, plain, shape, n)
            results[shape] = (rate, us, *await full_window(clocked, plain, shape))
        elapsed = time.perf_counter() - t0
        await backend.close()
        await clocked.close()
        await plain.aclose()

    headers = ["window", "req/s", "us/script", "keys", "bytes (full)",
               "us/refusal", "us/script after idle"]  # fmt: skip
    rows = [
        [
            shape.name,
            fmt(r[0], 0),
            fmt(r[1], 1),
            str(r[2]),
            f"{r[3]:,}",
            fmt(r[4], 1),
            fmt(r[5], 1),
        ]
        for shape, r in results.items()
    ]
    print(table(headers, rows))
    print("\nsliding / fixed of the same length:")
    ratio_rows = []
    for shape, r in results.items():
        if not shape.sliding:
            continue
        base = results[next(s for s in SHAPES if not s.sliding and s.window_s == shape.window_s)]
        ratio_rows.append([shape.name] + [fmt(ratio(r[i], base[i]), 2) for i in (0, 1, 2, 3, 4, 5)])
    print(table(headers, ratio_rows))
    print(f"\nrun took {elapsed:.1f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="500 requests per shape")
    parser.add_argument("--n", type=int, default=2000, help="requests per shape")
    args = parser.parse_args()
    asyncio.run(main(500 if args.quick else args.n))
