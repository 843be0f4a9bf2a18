"""A client that goes away mid-stream stops generation and is counted as an abort."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import read_metric, wait_for_metric

MODEL = {"model_name": "gpt-4.1"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[Simulator]:
    with running_simulator("fast.yaml", log_dir=tmp_path_factory.mktemp("disc")) as s:
        yield s


async def _admin(session: aiohttp.ClientSession, sim: Simulator, update: dict) -> None:
    async with session.post(sim.url("/admin/config"), json=update) as resp:
        assert resp.status == 200, await resp.text()


async def _read_events_then_close(sim: Simulator, events_to_read: int, max_tokens: int) -> int:
    """Read until ``events_to_read`` events arrived, then drop the connection.

    Returns the ``data:`` events that had reached the client by then: those read, and
    any already waiting in the socket (a client running late has more waiting). A raw
    socket, because an HTTP client library can't say what its connection holds unread.
    """
    body = orjson.dumps(
        {
            "model": "gpt-4.1",
            "messages": [{"role": "user", "content": "go on"}],
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", sim.port))
        await loop.sock_sendall(
            sock,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        )
        received = bytearray()
        while received.count(b"data: ") < events_to_read:
            data = await loop.sock_recv(sock, 65536)
            assert data, "the stream ended before the events were read"
            received += data
        while True:  # what arrived meanwhile, without waiting for more
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            if not data:
                break
            received += data
    finally:
        sock.close()  # drops the TCP connection, as Envoy does when its client leaves
    # Each event is one write of a few hundred bytes: one "data: " per event that arrived.
    return received.count(b"data: ")


async def test_disconnect_stops_generation_within_an_inter_token_interval(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        await _admin(session, sim, {"inter-token-latency": "50ms"})
        try:
            aborts = await read_metric(
                session, sim, "vllm:request_success_total", finish_reason="abort", **MODEL
            )
            before = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
            arrived = await _read_events_then_close(sim, 5, max_tokens=400)
            counted = await wait_for_metric(
                session,
                sim,
                "vllm:request_success_total",
                lambda v: v > aborts,
                finish_reason="abort",
                **MODEL,
            )
            assert counted == aborts + 1
            generated = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
            await asyncio.sleep(0.3)  # six more inter-token intervals
            later = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
            running = await read_metric(session, sim, "vllm:num_requests_running", **MODEL)
        finally:
            await _admin(session, sim, {"inter-token-latency": "0s"})
    # Counted against every event that had reached the client when it left (a client
    # running late has more than it read). The first event holds the role and the first
    # token; at most one more token may have been produced while the close was on its way.
    assert arrived >= 5
    assert generated - before <= arrived + 1
    assert later == generated
    assert running == 0


async def test_disconnect_at_zero_latency_stops_a_long_stream_early(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        aborts = await read_metric(
            session, sim, "vllm:request_success_total", finish_reason="abort", **MODEL
        )
        before = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
        await _read_events_then_close(sim, 20, max_tokens=100_000)
        counted = await wait_for_metric(
            session,
            sim,
            "vllm:request_success_total",
            lambda v: v > aborts,
            finish_reason="abort",
            **MODEL,
        )
        generated = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
        await asyncio.sleep(0.2)
        later = await read_metric(session, sim, "vllm:generation_tokens_total", **MODEL)
    assert counted == aborts + 1
    assert generated - before < 100_000, "generation ran to the end despite the disconnect"
    assert later == generated


async def test_disconnect_while_queued_leaves_the_queue_and_counts_abort(tmp_path):
    with running_simulator(
        "fast.yaml", "--max-num-seqs", "1", "--inter-token-latency", "20ms", log_dir=tmp_path
    ) as sim:
        async with aiohttp.ClientSession() as session:
            body = {
                "model": "gpt-4.1",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "max_tokens": 50,
                "ignore_eos": True,
            }
            holder = await session.post(sim.url("/v1/chat/completions"), json=body)
            queued = await session.post(sim.url("/v1/chat/completions"), json=body)
            waiting = await wait_for_metric(
                session, sim, "vllm:num_requests_waiting", lambda v: v == 1, **MODEL
            )
            assert waiting == 1
            queued.close()
            await wait_for_metric(
                session, sim, "vllm:num_requests_waiting", lambda v: v == 0, **MODEL
            )
            aborts = await wait_for_metric(
                session,
                sim,
                "vllm:request_success_total",
                lambda v: v == 1,
                finish_reason="abort",
                **MODEL,
            )
            text = await holder.text()  # the running stream is unaffected
            length = await wait_for_metric(
                session,
                sim,
                "vllm:request_success_total",
                lambda v: v == 1,
                finish_reason="length",
                **MODEL,
            )
    assert aborts == 1
    assert length == 1
    assert text.endswith("data: [DONE]\n\n")
