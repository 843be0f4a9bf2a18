"""Rolling restart of the processors behind one Envoy, under steady streaming load.

Each processor in turn gets SIGTERM while streams run through it: it answers NOT_SERVING,
keeps taking new streams until Envoy's health check has seen that (``drain_delay_s``), then
takes none and lets its open streams finish; a new processor takes its port and comes back
into rotation once its health check passes. Meanwhile, no request may fail, and every
admitted request is settled exactly once. A processor that is simply dead fails nothing
either: the health check takes it out, and a stream open that fails is retried elsewhere.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadlab.gateway import Envoy, Processor, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from stack.envoy import ProcessorHealthCheck
from tests.gateway.conftest import (
    FAST_PROFILE,
    WINDOW_S,
    counter_value,
    tenant_key,
    write_processor_config,
)

MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
LIMITS = {"rpm": 1_000_000, "tpm": 100_000_000}
# Faster than the shipped 1 s x 2 so the test is short; the processors' drain delay follows.
HEALTH = ProcessorHealthCheck(interval_s=0.2, unhealthy_threshold=2)
CLIENTS = 6
MAX_REQUESTS_PER_CLIENT = 400  # the load loop is bounded whatever happens
# Requests that must complete in each phase: before the first restart, while a processor
# is down (its port refused), after its successor is back, and at the end.
PHASE_REQUESTS = 12


def request(n: int) -> dict[str, Any]:
    # Random lengths (no ignore_eos): an unsettled reservation (whole lease batches) would
    # differ from what was delivered, so the counters show a missed or doubled settlement.
    return {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": 48,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"request {n}: tell me something"}],
    }


def complete(result: StreamResult) -> bool:
    """200 with the whole answer: usage chunk, ``[DONE]``, a clean end, no error event."""
    return (
        result.status == 200
        and result.clean_end
        and result.done
        and result.error is None
        and result.usage is not None
    )


def open_streams(processor: Processor) -> int:
    metrics = processor.metrics()
    settled = metrics.get("extproc_settlements_total", 0)
    return int(metrics.get("extproc_requests_admitted_total", 0) - settled)


@pytest.fixture(scope="module")
def streaming_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    """Streams that last a few hundred milliseconds: always some in flight on each processor."""
    sim = Simulator(
        FAST_PROFILE,
        "--inter-token-latency", "8ms",
        log_dir=tmp_path_factory.mktemp("rolling-sim"),
    )  # fmt: skip
    yield sim
    sim.stop()


def test_rolling_restart_under_load_fails_no_request_and_settles_each_once(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    streaming_simulator: Simulator,
) -> None:
    tenants = {"rolling": {"window_s": WINDOW_S, "limits": {"*": LIMITS}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS,
        shutdown_grace_s=60,
    )  # fmt: skip

    def start(port: int | None = None) -> Processor:
        return Processor.start(
            config, tmp_path, port=port, drain_delay_s=HEALTH.drain_delay_s, log_level="info"
        )

    processors = [start(), start()]
    stopped: list[Processor] = []
    envoy = Envoy.start(
        tmp_path, [p.port for p in processors], [streaming_simulator.port], health_check=HEALTH
    )
    results: list[StreamResult] = []
    stop_load = asyncio.Event()

    async def client(index: int) -> None:
        for n in range(MAX_REQUESTS_PER_CLIENT):
            if stop_load.is_set():
                return
            url = envoy.base_url + "/v1/chat/completions"
            results.append(
                await stream_http1(url, tenant_key("rolling"), request(index * 1000 + n))
            )

    async def completed_more(count: int) -> None:
        """Wait (by count, not time) until ``count`` more requests have completed."""
        target = len(results) + count
        while len(results) < target:
            assert not stop_load.is_set()
            await asyncio.sleep(0.02)

    async def restart(index: int) -> dict[str, Any]:
        old = processors[index]
        # Streams are running through it when it is told to stop.
        assert await asyncio.to_thread(wait_until, lambda: open_streams(old) > 0, 60)
        old.process.signal(signal.SIGTERM)
        code = await asyncio.to_thread(old.process.proc.wait, 120)
        assert code == 0, old.process.log_text()[-3000:]
        stopped.append(old)
        # Down: its port refuses connections. Load goes on through the other processor.
        await completed_more(PHASE_REQUESTS)
        new = await asyncio.to_thread(start, old.port)
        processors[index] = new
        # Back in rotation once its health check passes, and taking streams again.
        healthy = await asyncio.to_thread(
            wait_until, lambda: envoy.processor_health(new.port) == "healthy", 60
        )
        assert healthy, envoy.processor_health(new.port)
        assert await asyncio.to_thread(
            wait_until, lambda: new.metrics().get("extproc_requests_admitted_total", 0) > 0, 60
        )
        await completed_more(PHASE_REQUESTS)
        return old.stopped_record()

    async def run() -> list[dict[str, Any]]:
        load = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        try:
            await completed_more(PHASE_REQUESTS)
            records = [await restart(0), await restart(1)]
            await completed_more(PHASE_REQUESTS)
        finally:
            stop_load.set()
            await asyncio.gather(*load)
        return records

    try:
        records = asyncio.run(run())
        stats = envoy.stats()
    finally:
        envoy.stop()
        for p in processors:
            p.stop()

    failed = [r for r in results if not complete(r)]
    print(
        f"\nrolling restart: {len(results)} requests, {len(failed)} failed; stream opens "
        f"retried by Envoy: {stats.get('cluster.quota_extproc.upstream_rq_retry', 0)}; "
        f"health check failures: {stats.get('cluster.quota_extproc.health_check.failure', 0)}"
    )
    assert not failed, [(r.status, r.clean_end, r.done, r.error) for r in failed[:5]]
    # Each drained processor had streams in flight and let every one of them finish.
    for record in records:
        assert record["admitted"] > 0
        assert record["settled"] == {"completed": record["admitted"]}, record
    # Every request admitted once and settled once: the counters hold exactly what the
    # clients were served (upstream usage: prompt + completion), no reservation left over.
    assert counter_value(redis_client, "rolling", "rpm", "gpt-4.1") == len(results)
    assert counter_value(redis_client, "rolling", "tpm", "gpt-4.1") == sum(
        r.usage["prompt_tokens"] + r.usage["completion_tokens"] for r in results
    )
    reservations = list(redis_client.scan_iter(match="tq:{rolling}:r:*"))
    assert len(reservations) == len(results)
    assert all(redis_client.hget(key, "st") for key in reservations)


def test_a_processor_that_dies_fails_no_new_request(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    streaming_simulator: Simulator,
) -> None:
    """SIGKILL (no drain at all): the next requests go through, whether Envoy's health check
    has noticed yet (the dead one is out of rotation) or not (the refused stream open is
    retried on the other processor)."""
    tenants = {"dead_peer": {"window_s": WINDOW_S, "limits": {"*": LIMITS}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS
    )
    alive, doomed = Processor.start(config, tmp_path), Processor.start(config, tmp_path)
    envoy = Envoy.start(
        tmp_path, [alive.port, doomed.port], [streaming_simulator.port], health_check=HEALTH
    )
    url = envoy.base_url + "/v1/chat/completions"

    async def burst(first: int, count: int) -> list[StreamResult]:
        return await asyncio.gather(
            *(
                stream_http1(url, tenant_key("dead_peer"), request(n))
                for n in range(first, first + count)
            )
        )

    try:
        warm = asyncio.run(burst(0, 8))
        assert all(complete(r) for r in warm)
        assert doomed.metrics()["extproc_requests_admitted_total"] > 0  # both were in rotation
        doomed.process.signal(signal.SIGKILL)
        doomed.process.proc.wait(30)
        results = asyncio.run(burst(100, 40))
        stats = envoy.stats()
    finally:
        envoy.stop()
        alive.stop()
        doomed.stop()
    failed = [r for r in results if not complete(r)]
    print(
        f"\nprocessor killed: {len(results)} requests after, {len(failed)} failed; stream "
        f"opens retried: {stats.get('cluster.quota_extproc.upstream_rq_retry', 0)}"
    )
    assert not failed, [(r.status, r.error) for r in failed[:5]]
    assert counter_value(redis_client, "dead_peer", "rpm", "gpt-4.1") == len(warm) + len(results)
