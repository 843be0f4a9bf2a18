"""Redis faults mid-stream: the client is told the quota service failed, not its budget."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import redis

from loadlab.gateway import wait_until
from loadlab.redis_server import RedisServer
from tests.gateway.conftest import counter_value
from tests.gateway.test_stream_end_races import (
    PIECE,
    PROMPT,
    start_processor,
    stream_through,
)
from tests.support.raw_upstream import RawUpstream
from tests.support.scripted_upstream import chat_stream


def test_a_lease_the_backend_cannot_answer_ends_the_stream_as_quota_unavailable(
    tmp_path: Path,
) -> None:
    server = RedisServer.start(tmp_path / "redis")
    processor = start_processor(tmp_path, server.url, quota_timeout_ms=200)
    client = redis.Redis(port=server.port, decode_responses=True)

    async def run() -> object:
        def pause_redis() -> None:  # admission is done: every lease from here times out
            os.kill(server.pid, signal.SIGSTOP)

        chunks = chat_stream([PIECE] * 80, None)
        async with RawUpstream(lambda _: chunks, trailers=True, on_request=pause_redis) as up:
            try:
                return await stream_through(tmp_path, processor, up)
            finally:
                os.kill(server.pid, signal.SIGCONT)

    try:
        result = asyncio.run(run())
        assert result.status == 200 and result.done  # type: ignore[attr-defined]
        error = result.error  # type: ignore[attr-defined]
        assert error is not None and error["code"] == "quota_unavailable"
        assert error["type"] == "api_error"
        delivered = result.content.count(PIECE)  # type: ignore[attr-defined]
        assert 0 < delivered <= 32  # what admission reserved, nothing leased since

        def charged() -> int:
            return counter_value(client, "edge", "tpm", "gpt-4.1")

        wait_until(lambda: charged() == PROMPT + delivered, timeout_s=10)
        assert charged() == PROMPT + delivered
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        processor.stop()
        client.close()
        server.stop()
