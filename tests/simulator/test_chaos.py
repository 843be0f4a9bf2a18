"""Each ``ext-`` chaos extension, switched on through /admin/config, as a client sees it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from tests.simulator.conftest import parse_sse, read_metric, wait_for_metric
from tests.support.simulator import Simulator, running_simulator

BODY = {
    "model": "gpt-4.1",
    "messages": [{"role": "user", "content": "chaos"}],
    "stream": True,
    "max_tokens": 40,
    "ignore_eos": True,
}
SDK_ARGS = {
    "model": "gpt-4.1",
    "messages": [{"role": "user", "content": "chaos"}],
    "stream": True,
    "max_tokens": 40,
    "extra_body": {"ignore_eos": True},
}
CHAOS_OFF = {
    "ext-disconnect-rate": 0,
    "ext-stall-rate": 0,
    "ext-malformed-event-rate": 0,
    "ext-split-writes-rate": 0,
}


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[Simulator]:
    with running_simulator("fast.yaml", log_dir=tmp_path_factory.mktemp("chaos")) as s:
        yield s


@pytest.fixture
async def chaos(sim: Simulator):
    """Set chaos keys for one test; all chaos is off again afterwards."""
    async with aiohttp.ClientSession() as session:

        async def apply(update: dict) -> None:
            async with session.post(sim.url("/admin/config"), json=update) as resp:
                assert resp.status == 200, await resp.text()

        yield apply
        await apply(CHAOS_OFF)


async def _raw_stream(sim: Simulator) -> tuple[bytes, bool]:
    """The body bytes received and whether the response ended cleanly."""
    received = bytearray()
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url("/v1/chat/completions"), json=BODY) as resp,
    ):
        try:
            async for data in resp.content.iter_any():
                received += data
        except aiohttp.ClientPayloadError:
            return bytes(received), False
    return bytes(received), True


async def test_disconnect_rate_cuts_streams_before_done(sim: Simulator, chaos):
    await chaos({"ext-disconnect-rate": 100})
    async with aiohttp.ClientSession() as session:
        aborts = await read_metric(
            session, sim, "vllm:request_success_total", finished_reason="abort"
        )
        raw, clean = await _raw_stream(sim)
        counted = await wait_for_metric(
            session,
            sim,
            "vllm:request_success_total",
            lambda v: v > aborts,
            finished_reason="abort",
        )
    events = parse_sse(raw)
    assert not clean, "the connection should be cut, not finished"
    assert b"[DONE]" not in events
    assert 1 <= len(events) < 40
    assert all(orjson.loads(e)["choices"][0]["finish_reason"] is None for e in events)
    assert counted == aborts + 1

    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(**SDK_ARGS):
            pass
    await client.close()


async def test_stall_pauses_one_stream_once_for_the_configured_time(sim: Simulator, chaos):
    await chaos({"ext-stall-rate": 100, "ext-stall-duration": "400ms"})
    arrivals = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url("/v1/chat/completions"), json=BODY) as resp,
    ):
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    long_gaps = [g for g in gaps if g >= 0.3]
    assert len(long_gaps) == 1, gaps
    assert long_gaps[0] < 2.0


async def test_malformed_event_rate_injects_one_unparseable_event(sim: Simulator, chaos):
    await chaos({"ext-malformed-event-rate": 100})
    raw, clean = await _raw_stream(sim)
    events = parse_sse(raw)
    broken = []
    for data in events:
        if data == b"[DONE]":
            continue
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            broken.append(data)
    assert clean
    assert events[-1] == b"[DONE]"
    assert len(broken) == 1


async def test_split_writes_cut_events_across_tcp_reads(sim: Simulator, chaos):
    await chaos({"ext-split-writes-rate": 100})
    body = orjson.dumps({**BODY, "max_tokens": 10})
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    reads = []
    while data := await reader.read(65536):
        reads.append(data)
    writer.close()
    raw = b"".join(reads)
    head, _, chunked = raw.partition(b"\r\n\r\n")
    payload = _dechunk(chunked)
    events = parse_sse(payload)
    assert b"200 OK" in head
    assert events[-1] == b"[DONE]"
    assert all(orjson.loads(e) for e in events[:-1])
    # Every event arrives in two or three pieces.
    assert len(reads) > 2 * (len(events) - 1)

    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x")
    text = ""
    async for chunk in await client.chat.completions.create(**{**SDK_ARGS, "max_tokens": 10}):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    await client.close()
    assert text


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


async def test_chaos_profile_loads_and_injects_failures_and_cuts(tmp_path):
    with running_simulator("chaos.yaml", log_dir=tmp_path) as sim:
        statuses: dict[int, int] = {}
        cut = 0
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url("/admin/config")) as resp:
                cfg = await resp.json()
            for _ in range(60):
                async with session.post(sim.url("/v1/chat/completions"), json=BODY) as resp:
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    if resp.status == 200:
                        try:
                            raw = await resp.read()
                            cut += b"[DONE]" not in raw
                        except aiohttp.ClientPayloadError:
                            cut += 1
    assert cfg["failure-injection-rate"] == 20
    assert cfg["ext-disconnect-rate"] == 20
    assert set(statuses) <= {200, 429, 503}
    assert statuses.get(429, 0) + statuses.get(503, 0) >= 2  # 20% of 60: expect ~12
    assert cut >= 1
