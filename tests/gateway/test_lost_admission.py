"""An admission whose Redis reply was lost: a clear 503 in time, and nothing left charged.

A paused redis-server (SIGSTOP) keeps the admission script in its socket buffer: the
processor gives up at its own deadline, well inside Envoy's message timeout, answers 503
``quota_unavailable``, and cancels the request's key until Redis answers. When Redis
resumes it runs the buffered admission and then the cancel (or the cancel first, leaving a
tombstone the admission then respects): either way nothing stays charged.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import orjson
import redis

from loadlab.gateway import start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import stream_http1
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config

REQUEST = {
    "model": "gpt-4.1",
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 30,
}


def records(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    return [client.hgetall(k) for k in client.scan_iter(match=f"tq:{{{tenant}}}:r:*")]


def test_a_lost_admission_is_answered_503_in_time_and_leaves_nothing_charged(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    server = RedisServer.start(tmp_path / "redis")
    client = redis.Redis(port=server.port, decode_responses=True)
    tenants = {"hung": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100, "tpm": 100_000}}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=server.url, quota_timeout_ms=200
    )
    gateway = start_gateway(config, tmp_path, [s.port for s in simulators])
    url = gateway.base_url + "/v1/chat/completions"
    try:
        warm = asyncio.run(stream_http1(url, tenant_key("hung"), REQUEST))
        assert warm.status == 200
        wait_until(lambda: all("st" in r for r in records(client, "hung")), timeout_s=10)
        charged_before = counter_value(client, "hung", "tpm", "gpt-4.1")

        os.kill(server.pid, signal.SIGSTOP)
        try:
            lost = asyncio.run(stream_http1(url, tenant_key("hung"), REQUEST))
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # The processor's answer, not Envoy's empty 504 at its 5 s message timeout.
        assert lost.status == 503, lost.body
        assert orjson.loads(lost.body)["error"]["code"] == "quota_unavailable"
        assert int(lost.headers["retry-after"]) >= 1

        def reconciled() -> bool:
            found = records(client, "hung")
            return len(found) == 2 and any(r.get("c") == "1" for r in found)

        assert wait_until(reconciled, timeout_s=60)
        assert counter_value(client, "hung", "tpm", "gpt-4.1") == charged_before
        assert gateway.processors[0].metrics()["extproc_lost_admissions_total"] == 1
    finally:
        gateway.stop()
        client.close()
        server.stop()
