"""A usage chunk that arrives with events still waiting for a lease does not settle the
request: a stream that ends during the wait (Envoy cancels it: the client hung up, Envoy
restarted) is billed what it delivered, never the upstream's count of what it was never sent.

Found by ``extproc chaos``: an Envoy restart while a message held its events for a lease
charged a window one token over its budget (used above the reservation goes to the current
window unchecked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis

from extproc.app.runtime import Runtime
from extproc.billing.meter import ResponseMeter
from extproc.config import TenantSpec, parse_config
from extproc.quota import keys
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer
from tests.billing.streams import REQUEST, config_doc


class HeldLeases:
    """The real Redis backend, with each lease batch held until ``release`` (a slow Redis)."""

    def __init__(self, backend: RedisQuotaBackend) -> None:
        self.backend = backend
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting.set()
        await self.gate.wait()
        return await self.backend.reserve(*args, **kwargs)


async def held_then_cancelled(
    redis_url: str, stream: bytes, end: Callable[[ResponseMeter], Awaitable[None]]
) -> tuple[int, int, int]:
    """The whole stream in one body message (events + usage chunk), its lease held, the
    message cancelled mid-wait; ``end`` settles. Returns (charged, prompt, delivered)."""
    config = parse_config(config_doc(redis_url))
    held = HeldLeases(RedisQuotaBackend.from_url(redis_url))
    runtime = Runtime(config, held)  # type: ignore[arg-type]
    tenant = TenantSpec(id=f"held-{id(held)}", plan=config.plans["roomy"], key_sha256=())
    try:
        admitted = await runtime.admission.admit(tenant, "chat", "req-h", orjson.dumps(REQUEST))
        meter = ResponseMeter(admitted, runtime)
        meter.on_headers(200, "text/event-stream")
        message = asyncio.create_task(meter.on_body(stream, False))
        await held.waiting.wait()
        assert meter.final_usage is None  # parsed, but held with the events it follows
        message.cancel()  # as grpc does when Envoy ends the stream
        await asyncio.gather(message, return_exceptions=True)
        held.gate.set()  # the lease call in flight completes; settlement waits for it
        await end(meter)
        client = redis.asyncio.Redis.from_url(redis_url)
        prefix = keys.counter_key(tenant.id, "tpm", "gpt-4.1", 3600)
        charged = sum(
            [int(await client.get(k) or 0) async for k in client.scan_iter(prefix + ":*")]
        )
        await client.aclose()
        return charged, admitted.prompt_tokens, meter.delivered
    finally:
        await runtime.close()


def whole_stream(redis_server: RedisServer, recorded_stream: bytes) -> tuple[int, int, int]:
    async def settle(meter: ResponseMeter) -> None:
        await meter.settle("cancelled")

    return asyncio.run(held_then_cancelled(redis_server.url, recorded_stream, settle))


def test_a_stream_cancelled_while_its_events_wait_for_a_lease_is_billed_what_it_delivered(
    redis_server: RedisServer, recorded_stream: bytes
) -> None:
    charged, prompt, delivered = whole_stream(redis_server, recorded_stream)
    # The message needed more than admission's first lease: none of it went out.
    assert delivered == 0
    assert charged == prompt + delivered
