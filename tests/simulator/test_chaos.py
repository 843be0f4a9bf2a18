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

from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import parse_sse, read_metric, wait_for_metric

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
            session, sim, "vllm:request_success_total", finish_reason="abort"
        )
        raw, clean = await _raw_stream(sim)
        counted = await wait_for_metric(
            session,
            sim,
            "vllm:request_success_total",
            lambda v: v > aborts,
            finish_reason="abort",
        )
    events = parse_sse(raw)
    assert not clean, "the connection should be cut, not finished"
    assert b"[DONE]" not in events
    chunks = [orjson.loads(e) for e in events]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    # The role event comes first; the cut lands before the last of the max_tokens token
    # events, after at least one of them.
    role, *tokens = chunks
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert 1 <= len(tokens) < BODY["max_tokens"]
    assert counted == aborts + 1

    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(**SDK_ARGS):
            pass
    await client.close()


async def _arrivals(sim: Simulator) -> tuple[float, list[float]]:
    """When the request was sent and when each ``data:`` event arrived (monotonic)."""
    arrivals = []
    sent = time.monotonic()
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url("/v1/chat/completions"), json=BODY) as resp,
    ):
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
    return sent, arrivals


async def test_stall_pauses_one_stream_once_for_the_configured_time(sim: Simulator, chaos):
    stall_s = 0.6
    # What the same stream takes on this machine right now, without a stall.
    base_sent, base_arrivals = await _arrivals(sim)
    baseline = base_arrivals[-1] - base_sent
    await chaos({"ext-stall-rate": 100, "ext-stall-duration": f"{int(stall_s * 1000)}ms"})
    sent, arrivals = await _arrivals(sim)
    assert len(arrivals) == len(base_arrivals)  # a stall delays events, it drops none
    # The pause really elapsed: the stream cannot end sooner than the configured stall.
    assert arrivals[-1] - sent >= stall_s
    # One pause, not one per event: exactly one gap is even half as long as the stall
    # (a client that reads late can shorten the gap it sees, never by half a stall).
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    long_gaps = [g for g in gaps if g >= stall_s / 2]
    assert len(long_gaps) == 1, gaps
    # Of the configured length, not a multiple of it: bounded by what this machine needed.
    assert long_gaps[0] < 3 * stall_s + baseline, (long_gaps, baseline)


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


async def _chunked_stream(sim: Simulator, max_tokens: int) -> tuple[bytes, list[bytes]]:
    """A stream over a raw socket: the response head and its HTTP chunks, one per write."""
    body = orjson.dumps({**BODY, "max_tokens": max_tokens})
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    raw = await reader.read()
    writer.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    return head, _dechunk(chunked)


def _events_cut_by_a_write(chunks: list[bytes]) -> list[bool]:
    """For each SSE event of the body: does a write (chunk) boundary fall inside it?"""
    ends = set(itertools.accumulate(len(c) for c in chunks))
    payload = b"".join(chunks)
    cut = []
    start = 0
    while (stop := payload.find(b"\n\n", start)) >= 0:
        stop += 2
        cut.append(any(start < end < stop for end in ends))
        start = stop
    return cut


async def test_split_writes_cut_events_across_tcp_reads(sim: Simulator, chaos):
    # Without the fault every event leaves in one write: the check below can tell.
    head, chunks = await _chunked_stream(sim, 10)
    assert b"200 OK" in head
    assert not any(_events_cut_by_a_write(chunks))

    await chaos({"ext-split-writes-rate": 100})
    head, chunks = await _chunked_stream(sim, 10)
    events = parse_sse(b"".join(chunks))
    assert b"200 OK" in head
    assert events[-1] == b"[DONE]"
    assert all(orjson.loads(e) for e in events[:-1])
    # The server writes every token event in two or three pieces, each its own HTTP chunk
    # (so its own TCP send). The first piece also carries the role event and the closing
    # events leave whole: every event from the second token to the last token is cut.
    cut = _events_cut_by_a_write(chunks)
    assert len(cut) == len(events) == 10 + 3
    assert all(cut[2:-2]), cut

    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x")
    text = ""
    async for chunk in await client.chat.completions.create(**{**SDK_ARGS, "max_tokens": 10}):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    await client.close()
    assert text


def _dechunk(data: bytes) -> list[bytes]:
    """The chunks of a complete chunked body, in order."""
    chunks = []
    pos = 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        if size == 0:
            return chunks
        chunks.append(data[end + 2 : end + 2 + size])
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
