"""The meter against a real redis-server: any split of a recorded stream, same bytes, same bill.

A stream is recorded once from the simulator over HTTP (with the usage chunk admission
forces), then fed to the meter cut into arbitrary body messages, as Envoy may deliver it.
"""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.app.runtime import Runtime
from extproc.billing.meter import ResponseMeter
from extproc.config import TenantSpec, parse_config
from extproc.quota import keys
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer
from loadlab.sse_client import parse_events
from tests.billing.streams import REQUEST, config_doc

_ids = itertools.count()


async def bill(
    redis_url: str, plan: str, stream: bytes, cuts: list[int], now_first: bool = False
) -> tuple[bytes, int, bool]:
    """Feed ``stream`` cut at ``cuts``; return forwarded bytes, tokens charged, stream cut.

    ``now_first``: each message is offered to ``on_body_now`` first, as the transport does,
    and goes to ``on_body`` only when declined; else ``on_body`` alone (the general path).
    """
    config = parse_config(config_doc(redis_url))
    backend = RedisQuotaBackend.from_url(redis_url)
    runtime = Runtime(config, backend)
    tenant = TenantSpec(id=f"split-{next(_ids)}", plan=config.plans[plan], key_sha256=())
    try:
        admitted = await runtime.admission.admit(tenant, "chat", "req-1", orjson.dumps(REQUEST))
        meter = ResponseMeter(admitted, runtime)
        meter.on_headers(200, "text/event-stream")
        bounds = [0, *sorted(set(cuts)), len(stream)]
        out = bytearray()
        ended = False
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            last = i == len(bounds) - 2
            message = stream[start:end]
            now = meter.on_body_now(message, last) if now_first else None
            if now is not None:
                out += now
                continue
            forwarded, ended = await meter.on_body(message, last)
            out += forwarded or b""
            if ended and not last:
                break
        await meter.settle("test")
        client = redis.asyncio.Redis.from_url(redis_url)
        prefix = keys.counter_key(tenant.id, "tpm", "gpt-4.1", 3600)
        charged = sum(
            [int(await client.get(k) or 0) async for k in client.scan_iter(prefix + ":*")]
        )
        await client.aclose()
        return bytes(out), charged, meter.finished
    finally:
        await runtime.close()


def cut_points(stream_len: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=1, max_value=stream_len - 1), max_size=40)


def test_within_budget_forwarded_bytes_are_the_stream_minus_the_usage_chunk(
    redis_server: RedisServer, recorded_stream: bytes
) -> None:
    out, charged, cut = asyncio.run(bill(redis_server.url, "roomy", recorded_stream, []))
    events = parse_events(recorded_stream)
    usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
    usage_block = next(
        block + b"\n\n"
        for block in recorded_stream.split(b"\n\n")
        if b'"usage"' in block and b'"choices":[]' in block
    )
    assert not cut
    assert out == recorded_stream.replace(usage_block, b"")
    assert charged == usage["prompt_tokens"] + usage["completion_tokens"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_split_gives_the_same_forwarded_bytes_and_the_same_bill(
    redis_server: RedisServer, recorded_stream: bytes, data: st.DataObject
) -> None:
    cuts = data.draw(cut_points(len(recorded_stream)))
    plan = data.draw(st.sampled_from(["roomy", "tight"]))
    now_first = data.draw(st.booleans())
    reference = asyncio.run(bill(redis_server.url, plan, recorded_stream, []))
    assert asyncio.run(bill(redis_server.url, plan, recorded_stream, cuts, now_first)) == reference
    if plan == "tight":
        assert reference[2], "a 100-token budget must cut a 120-token answer"
        assert reference[1] == 100


@pytest.mark.parametrize("plan", ["roomy", "tight"])
def test_one_event_per_message_billed_without_awaiting_matches_the_general_path(
    redis_server: RedisServer, recorded_stream: bytes, plan: str
) -> None:
    """The message shape nearly every stream has, through the path the transport takes for
    it (``on_body_now``, the cut-off included): same bytes, same bill as one whole message."""
    ends = [i + 2 for i in range(len(recorded_stream)) if recorded_stream.startswith(b"\n\n", i)]
    cuts = [end for end in ends if end < len(recorded_stream)]
    reference = asyncio.run(bill(redis_server.url, plan, recorded_stream, []))
    general = asyncio.run(bill(redis_server.url, plan, recorded_stream, cuts))
    now_first = asyncio.run(bill(redis_server.url, plan, recorded_stream, cuts, now_first=True))
    assert general == now_first == reference
