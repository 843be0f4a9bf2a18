"""Redis restarted under load: once the first request succeeds again, none gets 503.

A bounded closed loop of clients keeps sending requests through Envoy + processor while
redis-server is stopped and started again on the same port (empty, as after a restart
without persistence). During the outage requests are refused 503 ``quota_unavailable``
(fail closed). The processor's pooled connections sat through the outage; none may fail a
request once Redis is back: every request sent after the first post-restart 200 must be
answered 200. Counts are asserted, never timings; the time from the restart to the first
200 is printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loadlab.gateway import start_gateway
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config

TENANT = "restart"
CLIENTS = 8  # concurrent closed-loop clients: several pooled Redis connections in use
AFTER_RECOVERY = 300  # requests sent after the first post-restart 200 that must all pass
REQUEST = {
    "model": "gpt-4.1",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "ping"}],
}


@dataclass
class Answer:
    sent_at: float
    done_at: float
    status: int


@pytest.mark.parametrize(
    "breaker",
    [
        pytest.param({}, id="breaker"),
        # Every call tries Redis through the outage: the backend's own reconnection alone.
        pytest.param({"circuit_breaker": {"failures": 1_000_000_000}}, id="no-breaker"),
    ],
)
def test_no_request_fails_once_redis_is_back_after_a_restart(
    tmp_path: Path, simulators: list[Simulator], breaker: dict[str, Any]
) -> None:
    redis_dir = tmp_path / "redis"
    server = RedisServer.start(redis_dir)
    tenants = {
        TENANT: {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1_000_000, "tpm": 100_000_000}}}
    }
    # A generous deadline: this test is about connection errors, not a slow (hogged) host.
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=server.url, quota_timeout_ms=3000, **breaker
    )
    gateway = start_gateway(config, tmp_path, [simulators[0].port])
    answers: list[Answer] = []
    marks: dict[str, float] = {}
    try:

        async def client(stop: asyncio.Event) -> None:
            url = gateway.base_url + "/v1/chat/completions"
            while not stop.is_set():
                sent = time.monotonic()
                result = await stream_http1(url, tenant_key(TENANT), REQUEST)
                answers.append(Answer(sent, time.monotonic(), result.status))

        def count(predicate: object) -> int:
            return sum(1 for a in answers if predicate(a))  # type: ignore[operator]

        async def until(predicate: object, what: str, limit_s: float = 120) -> None:
            deadline = time.monotonic() + limit_s
            while not predicate():  # type: ignore[operator]
                assert time.monotonic() < deadline, f"never {what}: {summary(answers)}"
                await asyncio.sleep(0.01)

        async def run() -> None:
            nonlocal server
            stop = asyncio.Event()
            clients = [asyncio.create_task(client(stop)) for _ in range(CLIENTS)]
            try:
                await until(lambda: count(lambda a: a.status == 200) >= 5 * CLIENTS, "warm")
                server.stop()
                marks["stopped"] = time.monotonic()
                # Refused (fail closed) while Redis is away; let the outage last a while.
                await until(
                    lambda: (
                        count(lambda a: a.sent_at > marks["stopped"] and a.status == 503)
                        >= 4 * CLIENTS
                    ),
                    "refused during the outage",
                )
                await asyncio.sleep(1.5)
                marks["restart"] = time.monotonic()
                server = RedisServer.start(redis_dir, port=server.port)
                marks["up"] = time.monotonic()

                def first_ok() -> float | None:
                    done = [
                        a.done_at for a in answers if a.status == 200 and a.done_at > marks["up"]
                    ]
                    return min(done) if done else None

                await until(lambda: first_ok() is not None, "recovered")
                marks["first_ok"] = first_ok()  # type: ignore[assignment]
                await until(
                    lambda: count(lambda a: a.sent_at > marks["first_ok"]) >= AFTER_RECOVERY,
                    "done after recovery",
                )
            finally:
                stop.set()
                await asyncio.gather(*clients, return_exceptions=True)

        asyncio.run(run())

        during = [a for a in answers if marks["stopped"] < a.sent_at < marks["restart"]]
        after = [a for a in answers if a.sent_at > marks["first_ok"]]
        assert during and {a.status for a in during} <= {200, 503}
        assert sum(a.status == 503 for a in during) >= 4 * CLIENTS
        failed_after = [a.status for a in after if a.status != 200]
        assert len(after) >= AFTER_RECOVERY
        assert failed_after == [], f"{len(failed_after)} failed after recovery: {failed_after}"
        print(
            f"\nredis restart: first 200 {marks['first_ok'] - marks['restart']:.3f}s after the "
            f"restart began ({marks['first_ok'] - marks['up']:.3f}s after redis accepted "
            f"connections); 503s during the outage: {sum(a.status == 503 for a in during)}; "
            f"requests after recovery: {len(after)}, answered 503: "
            f"{sum(a.status == 503 for a in after)}"
        )
    finally:
        gateway.stop()
        server.stop()


def summary(answers: list[Answer]) -> dict[int, int]:
    out: dict[int, int] = {}
    for a in answers:
        out[a.status] = out.get(a.status, 0) + 1
    return out
