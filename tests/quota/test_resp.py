"""The pipelined script connection (``extproc.quota.resp``) against a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.quota.resp import RespConnection, Script, pack
from tests.support.redis_server import RedisServer

ECHO = Script("return {KEYS[1], ARGV[1]}")


def test_commands_are_packed_as_resp_bulk_strings() -> None:
    assert pack(("SET", "k", 12, b"\x00v", 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$2\r\n\x00v\r\n$3\r\n1.5\r\n"
    )


async def test_concurrent_calls_on_one_connection_each_get_their_own_reply(
    redis_server: RedisServer,
) -> None:
    conn = RespConnection.from_url(redis_server.url)
    try:
        replies = await asyncio.gather(
            *(conn.run_script(ECHO, [f"key-{i}"], [i]) for i in range(500))
        )
        assert replies == [[f"key-{i}", str(i)] for i in range(500)]
    finally:
        await conn.close()


async def test_an_error_reply_raises_and_the_next_call_reads_its_own_reply(
    redis_server: RedisServer,
) -> None:
    conn = RespConnection.from_url(redis_server.url)
    try:
        bad, good = await asyncio.gather(
            conn.execute("INCRBY", "resp-not-a-number", "x"),
            conn.execute("ECHO", "after"),
            return_exceptions=True,
        )
        assert isinstance(bad, ResponseError) and "not an integer" in str(bad)
        assert good == "after"
    finally:
        await conn.close()


@pytest.mark.timeout(60)
async def test_silence_with_a_reply_owed_drops_the_connection_and_the_next_call_reconnects(
    tmp_path: Path,
) -> None:
    """A paused server stands for a half-open connection: the call fails as a timeout
    (not retried: its outcome is unknown), and once the server answers again so does the
    connection, without a stale reply read as the next call's."""
    server = RedisServer.start(tmp_path)
    conn = RespConnection.from_url(server.url, socket_timeout_s=0.3)
    try:
        assert await conn.execute("SET", "resp-k", "before") == "OK"
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await conn.execute("SET", "resp-k", "during")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await conn.execute("GET", "resp-k") in ("before", "during")
        assert await conn.execute("ECHO", "mine") == "mine"
    finally:
        await conn.close()
        server.stop()


async def test_a_stopped_server_fails_calls_as_connection_errors(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path)
    conn = RespConnection.from_url(server.url, connect_timeout_s=1)
    try:
        assert await conn.execute("PING") == "PONG"
        server.stop()
        with pytest.raises(RedisConnectionError):
            await conn.execute("PING")
    finally:
        await conn.close()
        server.stop()


async def test_a_script_the_server_forgot_is_loaded_again(redis_server: RedisServer) -> None:
    conn = RespConnection.from_url(redis_server.url)
    try:
        assert await conn.run_script(ECHO, ["a"], [1]) == ["a", "1"]
        assert await conn.execute("SCRIPT", "FLUSH") == "OK"
        assert await conn.run_script(ECHO, ["b"], [2]) == ["b", "2"]
        assert await conn.execute("SCRIPT", "EXISTS", ECHO.sha) == [1]
    finally:
        await conn.close()
