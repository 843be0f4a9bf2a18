"""The pipelined script connection (``extproc.quota.redis.resp``) against a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.app.loop import LOOPS
from extproc.app.loop import run as run_loop
from extproc.quota.redis.resp import RespConnection, Script, _error, _pack_any, pack
from loadlab.redis_server import RedisServer
from tests.quota.test_resilient import TcpProxy

ECHO = Script("return {KEYS[1], ARGV[1]}")


def test_commands_are_packed_as_resp_bulk_strings() -> None:
    assert pack(("SET", "k", 12, b"\x00v", 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$2\r\n\x00v\r\n$3\r\n1.5\r\n"
    )


_ARGS = st.one_of(st.text(), st.binary(), st.integers(), st.floats(), st.booleans(), st.none())


@given(st.lists(_ARGS, min_size=1, max_size=70))
def test_hiredis_packs_every_argument_as_the_python_packer_does(args: list[object]) -> None:
    assert pack(tuple(args)) == _pack_any(tuple(args))


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


def test_cluster_and_state_error_replies_get_redis_pys_classes() -> None:
    moved = _error(ResponseError("MOVED 3999 127.0.0.1:6381"))
    assert isinstance(moved, MovedError)
    assert (moved.slot_id, moved.host, moved.port) == (3999, "127.0.0.1", 6381)
    ask = _error(ResponseError("ASK 12 10.0.0.2:7000"))
    assert isinstance(ask, AskError) and not isinstance(ask, MovedError)
    assert ask.node_addr == ("10.0.0.2", 7000)
    for message, kind in (
        ("TRYAGAIN Multiple keys request during rehashing of slot", TryAgainError),
        ("CLUSTERDOWN The cluster is down", ClusterDownError),
        ("READONLY You can't write against a read only replica.", ReadOnlyError),
        ("LOADING Redis is loading the dataset in memory", BusyLoadingError),
        ("NOSCRIPT No matching script.", NoScriptError),
    ):
        assert isinstance(_error(ResponseError(message)), kind), message
    plain = ResponseError("ERR wrong number of arguments")
    assert _error(plain) is plain


@pytest.mark.timeout(60)
async def test_closing_a_connection_fails_a_caller_waiting_for_its_connect(
    tmp_path: Path,
) -> None:
    """The caller whose connection attempt is under way when the connection is closed (a
    Sentinel fence, a master leaving a Cluster) gets ``ConnectionError``, not a
    ``CancelledError`` that would end its task (a breaker's prober did, and the breaker
    stayed open for good)."""
    server = RedisServer.start(tmp_path)
    os.kill(server.pid, signal.SIGSTOP)  # TCP connects; the AUTH of the handshake waits
    conn = RespConnection.from_url(server.url, password="pw", connect_timeout_s=30)
    try:
        call = asyncio.create_task(conn.execute("PING"))
        await asyncio.sleep(0)  # the call is now waiting for the connection attempt
        assert conn._connecting is not None
        await conn.close()
        with pytest.raises(RedisConnectionError):
            await call
        with pytest.raises(RedisConnectionError):  # closed for good: no new connection
            await conn.execute("PING")
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await conn.close()
        server.stop()


async def test_a_connection_that_requires_a_master_refuses_a_replica(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    replica = RedisServer.start(tmp_path / "replica")
    plain = aioredis.Redis(port=replica.port, decode_responses=True)
    master = RespConnection.from_url(redis_server.url).to(
        "127.0.0.1", redis_server.port, require_master=True
    )
    conn = RespConnection.from_url(replica.url).to("127.0.0.1", replica.port, require_master=True)
    try:
        assert await master.execute("PING") == "PONG"
        await plain.replicaof("127.0.0.1", redis_server.port)
        with pytest.raises(ReadOnlyError):
            await conn.execute("PING")
    finally:
        await master.close()
        await conn.close()
        await plain.aclose()
        replica.stop()


async def test_asking_is_pipelined_before_the_command(redis_server: RedisServer) -> None:
    """Outside a cluster ASKING is an error reply; the command's own reply comes back."""
    conn = RespConnection.from_url(redis_server.url)
    try:
        assert await conn.request_asking(pack(("ECHO", "after-asking"))) == "after-asking"
        assert await conn.execute("ECHO", "next") == "next"
    finally:
        await conn.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_hung_up_on_before_its_first_command_fails_as_lost_and_is_retried(
    tmp_path: Path, loop: str
) -> None:
    """A proxy in front of a dead Redis accepts, then hangs up: the connection can be lost
    between being opened and its first command. That command must fail as a lost
    connection (a ``ConnectionError``, which the quota layer retries or queues) on either
    loop: not a ``RuntimeError`` from uvloop's closed transport (a queued settlement would be
    given up), not a wait forever (asyncio drops the write). Once Redis is back, the same
    connection serves."""
    server = RedisServer.start(tmp_path / "redis")
    port = server.port
    server.stop()
    with TcpProxy(port) as proxy:

        async def scenario() -> tuple[dict[str, int], object]:
            conn = RespConnection(host="127.0.0.1", port=proxy.port, retries=2)
            outcomes: dict[str, int] = {}
            try:
                for _ in range(50):
                    try:
                        async with asyncio.timeout(10):  # a hang shows as TimeoutError
                            await conn.execute("PING")
                        outcomes["answered"] = outcomes.get("answered", 0) + 1
                    except Exception as exc:
                        kind = type(exc).__name__
                        outcomes[kind] = outcomes.get(kind, 0) + 1
                        if kind != "ConnectionError":
                            break
                revived = RedisServer.start(tmp_path / "revived", port=port)
                try:
                    return outcomes, await conn.execute("PING")
                finally:
                    revived.stop()
            finally:
                await conn.close()

        outcomes, after = run_loop(scenario(), loop)
    assert outcomes == {"ConnectionError": 50}
    assert after == "PONG"
    assert proxy.accepted >= 50 * 3  # each command: the first try and its two retries
