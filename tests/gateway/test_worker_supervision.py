"""Workers a supervisor can trust: a hung worker is replaced and its books still balance; the
fail-open allowance is the host's, whatever the number of workers.

Real parts: ``serve --workers 2`` behind Envoy (one endpoint, a processor connection per
stream), redis-server, the simulator. Every wait is on an event (a log record, a pid, a
count), with deadlines derived from the settings the test gives.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import openai
import pytest
import redis

from loadlab.gateway import wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, tenant_key, write_processor_config
from tests.gateway.test_crash_books import (
    HEARTBEAT_TTL_S,
    MODELS,
    REQUEST,
    SWEEP_S,
    Books,
    owner_pid,
    settle_deadline_s,
)
from tests.gateway.test_workers import (
    READY_S,
    WORKERS,
    _record,
    start_envoy_one_endpoint,
    start_workers,
)

pytestmark = pytest.mark.slow

TENANT = "hung"
PREFIX = "tq-hung"
WORKER_TIMEOUT_S = 2.0


def test_a_sigstopped_worker_is_replaced_and_its_open_records_settled_by_a_peer(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "20ms", log_dir=tmp_path)
    plan = {"window_s": WINDOW_S, "batch_tokens": 16, "limits": {"*": {"tpm": 10_000_000}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", {TENANT: plan}, redis_url=redis_server.url, models=MODELS,
        key_prefix=PREFIX, heartbeat_ttl_s=HEARTBEAT_TTL_S, orphan_sweep_s=SWEEP_S,
    )  # fmt: skip
    workers = start_workers(config, tmp_path, "--worker-timeout-s", str(WORKER_TIMEOUT_S))
    envoy = None
    try:
        envoy = start_envoy_one_endpoint(tmp_path, workers.port, [sim.port])
        victim = workers.pids()[0]
        books = Books(redis_client, TENANT, PREFIX)
        url = envoy.base_url + "/v1/chat/completions"
        request = {**REQUEST, "max_tokens": 150}  # 3 s at 20 ms per token

        def victim_holds_streams() -> bool:
            open_now = books.open_records()
            return any(owner_pid(books.admitted[k].get("o", "x-0-0")) == victim for k in open_now)

        async def run() -> list[StreamResult]:
            tasks = [
                asyncio.create_task(stream_http1(url, tenant_key(TENANT), request))
                for _ in range(12)
            ]
            assert await asyncio.to_thread(wait_until, victim_holds_streams, 30.0, 0.02)
            os.kill(victim, signal.SIGSTOP)  # alive, silent: only its beats tell
            return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        # Replaced: killed for its silence, started again, serving again.
        assert wait_until(lambda: workers.pids().get(0) not in (None, victim), READY_S)
        assert wait_until(lambda: workers.answers(0), READY_S)
        log = workers.process.log_text()
        hung = [r for r in map(_record, log.splitlines()) if r and r.get("event") == "worker_hung"]
        assert [(r["worker"], r["pid"]) for r in hung] == [(0, victim)], log[-3000:]
        assert not os.path.exists(f"/proc/{victim}")
        cut = [r for r in results if not r.done]
        assert cut, "the hung worker's streams"
        # Its records: settled by the live worker from Redis; the books balance.
        assert wait_until(lambda: not books.open_records(), timeout_s=settle_deadline_s())
        books.balance()
        orphaned = [e for e in books.ledger() if e["reason"] == "orphaned"]
        assert orphaned and all(e["used"] == e["reserved"] for e in orphaned)
        print(
            f"\nhung worker: killed after {hung[0]['silent_s']}s of silence "
            f"(--worker-timeout-s {WORKER_TIMEOUT_S}); {len(orphaned)} records settled by "
            f"its peer; {len(cut)} client streams cut"
        )
    finally:
        if envoy is not None:
            envoy.stop()
        workers.stop()
        sim.stop()


def test_the_fail_open_allowance_is_the_hosts_whatever_the_number_of_workers(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    """rpm 100 with fail_open_fraction 0.1: 10 requests per window for the host while Redis
    is dead, 5 from each of its 2 workers (was 10 from each: 20)."""
    server = RedisServer.start(tmp_path / "redis")
    plan = {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100}}, "on_backend_failure": "open"}
    config = write_processor_config(
        tmp_path / "quota.yaml", {"open": plan}, redis_url=server.url, quota_timeout_ms=200,
        circuit_breaker={"failures": 1, "probe_interval_ms": 100},
    )  # fmt: skip
    workers = start_workers(config, tmp_path)
    envoy = None
    try:
        envoy = start_envoy_one_endpoint(tmp_path, workers.port, [s.port for s in simulators])
        os.kill(server.pid, signal.SIGKILL)
        server.process.proc.wait(10)
        client = openai.OpenAI(
            base_url=envoy.base_url + "/v1", api_key=tenant_key("open"), max_retries=0
        )
        admitted = refused = 0
        for _ in range(40):
            try:
                client.chat.completions.create(
                    model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                admitted += 1
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                refused += 1
        per_worker = [workers.counter(i, "extproc_fail_open_admissions_total") for i in range(2)]
        took = [
            workers.counter(i, "extproc_fail_open_admissions_total")
            + workers.counter(i, "extproc_fail_open_refusals_total")
            for i in range(WORKERS)
        ]
        assert min(took) >= 5, took  # each worker was asked for more than its share
        assert (admitted, refused) == (10, 30), per_worker
        assert per_worker == [5, 5]
    finally:
        if envoy is not None:
            envoy.stop()
        workers.stop()
        server.stop()
