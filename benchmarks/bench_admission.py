"""Admission latency at the gRPC level: request headers + a 4k-token body → verdict.

This process plays Envoy against ONE processor process with a real redis-server: per
request it opens a Process stream, sends the request headers (API key), waits for the
answer, sends the buffered request body, and waits for the verdict. The time from the
headers' send to the verdict is the admission latency — identity, JSON parsing, counting
the prompt's tokens, the atomic Redis charge, and two gRPC round trips. The same exchange
against the no-op processor (``loadlab.noop_processor``) shows what the two round trips
alone cost, so the figure above it is the price of admission itself.

Processor on core 0, this client on core 1 (``taskset``) when there are two cores.
One request in flight is the target's measure; a run with several in flight shows queueing.

    .venv/bin/python benchmarks/bench_admission.py [--quick] [--n 2000] [--concurrency 8]

Target (issue 4): p99 ≤ 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import orjson

from loadlab import wire
from loadlab.figures import fmt, percentile, ratio, table, verdict
from loadlab.grpc_load import cores
from loadlab.machine import pin_self
from loadlab.procs import StopStack
from loadlab.prompts import prompt_of_tokens
from loadlab.redis_server import RedisServer
from loadlab.rig import (
    BENCH_KEY,
    MODEL,
    start_billing_processor,
    start_noop_processor,
    write_bench_config,
)

TARGET_P99_MS = 2.0
PROMPT_TOKENS = 4096


async def admissions(
    port: int, body: bytes, n: int, concurrency: int, tag: str
) -> tuple[list[float], list[float], int]:
    """Latencies (ms) of headers → answer and headers → verdict; refusals counted apart."""
    request_body = wire.request_body(body).SerializeToString()
    head_ms: list[float] = []
    verdict_ms: list[float] = []
    refused = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(wire.PROCESS_METHOD)
        queue = iter(range(n))

        async def worker() -> None:
            nonlocal refused
            for i in queue:
                headers = wire.request_headers(BENCH_KEY, f"{tag}-{i}", len(body))
                raw_headers = headers.SerializeToString()
                call = process()
                await call.wait_for_connection()
                t0 = time.perf_counter()
                await call.write(raw_headers)
                await call.read()
                t1 = time.perf_counter()
                await call.write(request_body)
                answer = await call.read()
                t2 = time.perf_counter()
                await call.done_writing()
                await call.code()
                if wire.verdict_kind(wire.response(answer)) != "request_body":
                    refused += 1
                    continue
                head_ms.append((t1 - t0) * 1000)
                verdict_ms.append((t2 - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return head_ms, verdict_ms, refused


async def in_process(config_path: Path, body: bytes, n: int) -> list[float]:
    """The processor's own admission work (ms): identity, parse, count, one Redis script.

    Runs the processor's Session in this process against the same real redis-server, so the
    figure excludes only the two gRPC hops between Envoy and the processor.
    """
    import gc

    from extproc.app.runtime import Runtime
    from extproc.config import load_config

    runtime = Runtime(load_config(config_path))
    runtime.warm_up()
    gc.collect()
    gc.freeze()
    body_request = wire.request_body(body)
    tag = uuid.uuid4().hex[:8]
    latencies: list[float] = []
    try:
        for i in range(n + 20):
            session = runtime.session()
            headers = wire.request_headers(BENCH_KEY, f"inproc-{tag}-{i}", len(body))
            t0 = time.perf_counter()
            await session.handle(headers)
            answer = await session.handle(body_request)
            elapsed = (time.perf_counter() - t0) * 1000
            if answer is None or answer.WhichOneof("response") != "request_body":
                raise RuntimeError(f"admission refused in the benchmark: {answer}")
            if i >= 20:  # the first ones warm the connection pool and script cache
                latencies.append(elapsed)
            await session.close("benchmark")
    finally:
        await runtime.close()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--n", type=int, default=2000, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=8, help="in flight for the 2nd run")
    args = parser.parse_args()
    n = 300 if args.quick else args.n
    server_cpus, client_cpus = cores()
    pin_self(client_cpus)

    prompt, prompt_tokens = prompt_of_tokens(PROMPT_TOKENS)
    body = orjson.dumps(
        {"model": MODEL, "stream": True, "max_tokens": 256, "messages": [
            {"role": "user", "content": prompt}
        ]}
    )  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    rows = []
    with StopStack() as stops:
        redis = stops.push(RedisServer.start(workdir / "redis"))
        noop, noop_port = start_noop_processor(workdir, server_cpus)
        stops.push(noop)
        config = write_bench_config(workdir / "quota.yaml", redis.url)
        billing = stops.push(start_billing_processor(config, workdir, redis.url, server_cpus))
        print(
            f"admission latency: {prompt_tokens}-token chat prompt ({len(body):,} bytes), "
            f"{n} requests per run, processor on core {server_cpus}, client on core "
            f"{client_cpus}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        tag = uuid.uuid4().hex[:8]
        results = {}
        for concurrency in (1, args.concurrency):
            for name, port in (("noop", noop_port), ("billing", billing.port)):
                # Warm: channel, tokenizer caches, Redis script load.
                asyncio.run(admissions(port, body, 20, 1, f"{tag}-warm-{name}-{concurrency}"))
                head, full, refused = asyncio.run(
                    admissions(port, body, n, concurrency, f"{tag}-{name}-{concurrency}")
                )
                results[(name, concurrency)] = full
                rows.append(
                    [
                        name,
                        str(concurrency),
                        f"{len(full):,}",
                        str(refused),
                        fmt(percentile(head, 50), 3),
                        fmt(percentile(full, 50), 3),
                        fmt(percentile(full, 90), 3),
                        fmt(percentile(full, 99), 3),
                        fmt(max(full) if full else float("nan"), 3),
                    ]
                )
        metrics = billing.metrics()
        inside = asyncio.run(in_process(config, body, n))

    print()
    print(
        table(
            [
                "processor", "in flight", "admitted", "refused", "headers p50",
                "verdict p50", "p90", "p99", "max",
            ],
            rows,
        )
    )  # fmt: skip
    print("(ms, from sending the request headers to the verdict on the request body)")
    p99 = percentile(results[("billing", 1)], 99)
    floor = percentile(results[("noop", 1)], 99)
    print(
        f"\nbilling, one in flight: p99 {fmt(p99, 3)} ms — target ≤ {TARGET_P99_MS} ms: "
        f"{verdict(p99 <= TARGET_P99_MS)}; {fmt(ratio(p99, floor), 1)}× the no-op processor's "
        f"p99 ({fmt(floor, 3)} ms: the two gRPC round trips alone)"
    )
    print(
        f"inside the processor (Session, real Redis, no gRPC hops): p50 "
        f"{fmt(percentile(inside, 50), 3)} ms, p99 {fmt(percentile(inside, 99), 3)} ms — "
        f"target p99 ≤ {TARGET_P99_MS} ms: {verdict(percentile(inside, 99) <= TARGET_P99_MS)}"
    )
    print(
        f"billing processor: {int(metrics.get('extproc_requests_admitted_total', 0)):,} admitted, "
        f"{int(metrics.get('extproc_quota_round_trips_total', 0)):,} Redis round trips; "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
