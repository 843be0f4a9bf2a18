"""The end of a stream: trailers after an unterminated event, and the idle watchdog racing
a lease that waits on a paused Redis (issue 8, item 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Envoy, Processor, wait_until
from loadlab.procs import free_ports
from loadlab.redis_server import RedisServer
from loadlab.sse_client import stream_http1
from stack.envoy import EnvoyPorts, render_bootstrap
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.raw_upstream import RawUpstream
from tests.support.scripted_upstream import chat_stream

MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = count_prompt_tokens(
    {"messages": MESSAGES},
    TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}]).counter_for(
        "gpt-4.1"
    ),
)
PIECE = " hello"  # one o200k token


def envoy_with_trailers(log_dir: Path, processor_port: int, backend_port: int) -> Envoy:
    """The shipped bootstrap with HTTP/1.1 trailers enabled towards the model server."""
    ports = EnvoyPorts(*free_ports(2))
    text = render_bootstrap(ports, [processor_port], [backend_port])
    anchor = "  - name: llm_backends\n"
    assert anchor in text
    options = (
        "    typed_extension_protocol_options:\n"
        "      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n"
        '        "@type": type.googleapis.com/'
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n"
        "        explicit_http_config:\n"
        "          http_protocol_options: {enable_trailers: true}\n"
    )
    text = text.replace(anchor, anchor + options)
    path = log_dir / f"envoy-trailers-{ports.listen}.yaml"
    path.write_text(text)
    return Envoy.launch(path, ports, log_dir / f"envoy-{ports.listen}.log")


async def stream_through(tmp_path: Path, processor: Processor, upstream: RawUpstream) -> Any:
    """One streamed chat request through a fresh Envoy (trailers on) in front of ``upstream``."""
    envoy = envoy_with_trailers(tmp_path, processor.port, upstream.port)
    try:
        payload = {"model": "gpt-4.1", "stream": True, "messages": MESSAGES}
        url = envoy.base_url + "/v1/chat/completions"
        return await stream_http1(url, tenant_key("edge"), payload)
    finally:
        envoy.stop()


@pytest.fixture()
def paused_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path / "redis")
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def start_processor(tmp_path: Path, redis_url: str, **top: object) -> Processor:
    tenants = {"edge": {"window_s": WINDOW_S, "limits": {"*": {"tpm": 1_000_000}}}}
    config = write_processor_config(tmp_path / "quota.yaml", tenants, redis_url=redis_url, **top)
    return Processor.start(config, tmp_path)


def test_an_event_still_buffered_when_trailers_arrive_is_delivered_and_billed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    chunks = chat_stream([PIECE] * 6, None)[:-1]  # no [DONE]: the stream ends in trailers
    tail = b'data: {"choices":[{"index":0,"delta":{"content":"' + PIECE.encode() + b'"}}]}'
    chunks.append(tail)  # no blank line after it: the reassembler still holds it
    processor = start_processor(tmp_path, redis_server.url)
    client = redis.Redis(port=redis_server.port, decode_responses=True)

    async def run() -> object:
        async with RawUpstream(lambda _: chunks, trailers=True) as upstream:
            return await stream_through(tmp_path, processor, upstream)

    try:
        result = asyncio.run(run())
        assert result.status == 200  # type: ignore[attr-defined]
        assert result.body.endswith(tail)  # type: ignore[attr-defined]
        expected = PROMPT + 7
        wait_until(lambda: counter_value(client, "edge", "tpm", "gpt-4.1") == expected, 10)
        assert counter_value(client, "edge", "tpm", "gpt-4.1") == expected
    finally:
        processor.stop()
        client.close()


def test_the_idle_watchdog_never_ends_a_stream_while_its_lease_is_pending(
    tmp_path: Path, paused_redis: RedisServer
) -> None:
    # The idle timeout is below the time a lease waits on Redis (a pending lease must not look
    # idle) but well above a loaded machine's gap between two body messages of one answer.
    processor = start_processor(
        tmp_path, paused_redis.url, stream_idle_timeout_s=1.0, quota_timeout_ms=4000
    )
    client = redis.Redis(port=paused_redis.port, decode_responses=True)
    chunks = chat_stream([PIECE] * 80, None)

    async def run() -> object:
        loop = asyncio.get_running_loop()

        def pause_redis() -> None:
            # Admission is done; every lease from here waits on Redis for 2.5 s, while
            # the upstream sends the whole answer at once (it is never idle).
            os.kill(paused_redis.pid, signal.SIGSTOP)
            loop.call_later(2.5, os.kill, paused_redis.pid, signal.SIGCONT)

        async with RawUpstream(lambda _: chunks, trailers=True, on_request=pause_redis) as upstream:
            return await stream_through(tmp_path, processor, upstream)

    try:
        result = asyncio.run(run())
        errors = [e["error"] for e in result.events if isinstance(e, dict) and "error" in e]  # type: ignore[attr-defined]
        assert [e for e in errors if e["code"] == "timeout"] == []  # the watchdog held off
        assert len(errors) <= 1
        delivered = result.content.count(PIECE)  # type: ignore[attr-defined]

        def settled() -> bool:
            found = [client.hgetall(k) for k in client.scan_iter(match="tq:{edge}:r:*")]
            return bool(found) and all("st" in r for r in found)

        assert wait_until(settled, timeout_s=30)
        assert counter_value(client, "edge", "tpm", "gpt-4.1") == PROMPT + delivered
        assert delivered >= 32  # the first batch went out before Redis was paused
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(paused_redis.pid, signal.SIGCONT)
        processor.stop()
        client.close()
