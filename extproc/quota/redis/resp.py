"""One pipelined Redis connection for the quota scripts: the hot path's only Redis client.

Measured on this machine (one EVALSHA, one core): redis-py's asyncio client costs 110-160 µs
of CPU per call (pool checkout, retry wrapper, StreamReader, per-call locks), this client
10-30 µs. A streamed response makes ~⌈output/batch⌉ + 2 calls, so that difference was a
third of what billing added per body message. redis-py stays for everything off the hot
path (the orphan reconciler's pipelines, the absorb script).

Design: every call is written at once to one connection (no pool, no lock) and its future
queued; replies arrive in order and resolve the futures in order (hiredis parses them). A
caller cut off by its deadline leaves its future in the queue, so its reply, when it comes,
is read and dropped: the stream never desynchronises. The connection is replaced when it
is lost (every pending call then fails with ``ConnectionError``; the caller may retry:
the quota scripts are idempotent) or when a reply is owed and nothing at all has been
heard for ``socket_timeout_s`` (a half-open connection: the pending calls fail with
``TimeoutError``). A closed connection stays closed: a call on it fails at once with
``ConnectionError`` (a Cluster or Sentinel client closes the connection of a server that is
no longer a master, so a caller holding it retries on the new one, never on the old).
Errors are redis-py's exception classes, so callers map one set; a Cluster's redirections
and state errors get their own (``MovedError``, ``AskError``, ``TryAgainError``, ...).

A Cluster (``extproc.quota.redis.cluster``) keeps one such connection per master and a Sentinel
client (``extproc.quota.redis.sentinel``) one to the current master: every topology has this
cost per call.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from typing import Any, Protocol, cast

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

_CRLF = b"\r\n"
_pack_command = hiredis.pack_command


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP: an array of bulk strings.

    hiredis packs str, int, float and bytes in C (6 µs for an admission's 68 arguments
    against 16 µs in Python); anything else (a bool, say) takes the Python path."""
    try:
        return _pack_command(args)  # type: ignore[no-any-return]
    except TypeError:
        return _pack_any(args)


def _pack_any(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        if kind is bytes:
            data = arg
        elif kind is str:
            data = arg.encode()
        elif kind is int:
            data = b"%d" % arg
        else:
            data = str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, _CRLF)
    return b"".join(parts)


_ASKING = pack(("ASKING",))


_ERRORS: tuple[tuple[str, type[Exception]], ...] = (
    ("NOSCRIPT", NoScriptError),
    ("TRYAGAIN", TryAgainError),
    ("CLUSTERDOWN", ClusterDownError),
    ("MASTERDOWN", MasterDownError),
    ("READONLY", ReadOnlyError),
    ("LOADING", BusyLoadingError),
    ("WRONGPASS", AuthenticationError),
    ("NOAUTH", AuthenticationError),
    ("invalid password", AuthenticationError),
    ("invalid username", AuthenticationError),
)


def _error(reply: ResponseError) -> Exception:
    """The redis-py exception class for an error reply, as redis-py would raise it."""
    message = str(reply)
    if message.startswith("MOVED "):
        return MovedError(message[6:])
    if message.startswith("ASK "):
        return AskError(message[4:])
    for prefix, kind in _ERRORS:
        if message.startswith(prefix):
            return kind(message)
    return reply


class ScriptRunner(Protocol):
    """What ``RedisQuotaBackend`` runs its scripts on: one server (``RespConnection``), a
    Cluster (``ClusterConnection``) or a Sentinel-managed master (``SentinelConnection``).

    ``shard_of`` names the server that serves a key now (its master's address on a
    Cluster, ``""`` elsewhere): callers keep one circuit breaker per shard. ``probe`` says
    whether calls for that shard may be sent again (it answers, or no key is served by it
    any more).
    """

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any: ...

    async def execute(self, *args: Any) -> Any: ...

    def shard_of(self, key: str) -> str: ...

    async def probe(self, shard: str) -> bool: ...

    async def close(self) -> None: ...


class Script:
    """A Lua script run by EVALSHA; loaded by EVAL when the server doesn't know it."""

    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


class _Protocol(asyncio.Protocol):
    def __init__(self, socket_timeout_s: float | None) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.sent_at: deque[float] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.last_heard = 0.0
        self.socket_timeout_s = socket_timeout_s
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # ``create_connection`` hands its protocol a stream transport (TCP, TLS or unix).
        self.transport = cast(asyncio.Transport, transport)

    def send(self, payload: bytes, future: asyncio.Future[Any]) -> None:
        """Write one packed command; ``future`` gets its reply. Raises ``ConnectionError``
        (nothing sent) on a connection already lost or closing: it can be lost between
        being opened and the first command (a server or proxy that accepts, then hangs up),
        and a write then raises (uvloop) or goes nowhere and is never answered (asyncio)."""
        transport = self.transport
        assert transport is not None
        if self.lost or transport.is_closing():
            self.lost = True
            raise RedisConnectionError("Redis connection lost before the command was sent")
        now = time.monotonic()
        if not self.pending:
            self.last_heard = now  # the silence that matters starts with this call
        self.pending.append(future)
        self.sent_at.append(now)
        transport.write(payload)
        if self._timer is None and self.socket_timeout_s is not None:
            self._arm(now)

    def data_received(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        self.reader.feed(data)
        pending = self.pending
        while pending:
            reply = self.reader.gets()
            if reply is False:
                break
            future = pending.popleft()
            self.sent_at.popleft()
            if not future.done():  # a caller cut off by its deadline: its reply is dropped
                if isinstance(reply, ResponseError):
                    future.set_exception(_error(reply))
                else:
                    future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"Redis connection lost: {exc or 'closed by the server'}"))

    def _fail(self, error: Exception) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)
        self.sent_at.clear()

    def _arm(self, now: float) -> None:
        assert self.socket_timeout_s is not None
        oldest = max(self.sent_at[0], self.last_heard)
        delay = max(0.0, oldest + self.socket_timeout_s - now)
        self._timer = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        self._timer = None
        if not self.pending or self.lost:
            return
        now = time.monotonic()
        assert self.socket_timeout_s is not None
        if now - max(self.sent_at[0], self.last_heard) >= self.socket_timeout_s:
            self._fail(RedisTimeoutError(f"no reply from Redis for {self.socket_timeout_s}s"))
            if self.transport is not None:
                self.transport.abort()
            return
        self._arm(now)

    def close(self) -> None:
        """Drop the connection now: what is not sent is not, pending calls fail."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        self._fail(RedisConnectionError("connection closed by the client"))


class RespConnection:
    """A lazily (re)connected, pipelined connection to one Redis server."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float | None = 2.0,
        socket_timeout_s: float | None = 5.0,
        retries: int = 1,
        require_master: bool = False,
    ) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password = username, password
        self.ssl_context = ssl_context
        self.connect_timeout_s = connect_timeout_s
        self.socket_timeout_s = socket_timeout_s
        self.retries = retries
        # Each new connection asks ROLE and refuses a server that is not a master (Sentinel:
        # a demoted master must never take writes that its resync will drop).
        self.require_master = require_master
        self.closed = False
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self.address = path if path is not None else f"{host}:{port}"

    def to(self, host: str, port: int, *, require_master: bool | None = None) -> RespConnection:
        """A connection with these settings (credentials, TLS, timeouts) to another server."""
        return RespConnection(
            host=host,
            port=port,
            db=self.db,
            username=self.username,
            password=self.password,
            ssl_context=self.ssl_context,
            connect_timeout_s=self.connect_timeout_s,
            socket_timeout_s=self.socket_timeout_s,
            retries=self.retries,
            require_master=self.require_master if require_master is None else require_master,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float | None = 2.0,
        socket_timeout_s: float | None = 5.0,
        retries: int = 1,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str | None = None,
        ssl_check_hostname: bool | None = None,
    ) -> RespConnection:
        """``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, read by redis-py's parser."""
        parts = parse_url(url)
        context = None
        if url.startswith("rediss://"):
            # The URL's ?ssl_ca_certs= as redis-py's pool reads it (a private CA).
            url_ca = parts.get("ssl_ca_certs")  # a query argument: a str when given
            cafile = ssl_ca_certs or (url_ca if isinstance(url_ca, str) else None)
            context = ssl.create_default_context(cafile=cafile)
            reqs = str(ssl_cert_reqs or parts.get("ssl_cert_reqs") or "required").lower()
            context.check_hostname = (
                ssl_check_hostname if ssl_check_hostname is not None else reqs == "required"
            )
            context.verify_mode = {
                "none": ssl.CERT_NONE,
                "optional": ssl.CERT_OPTIONAL,
                "required": ssl.CERT_REQUIRED,
            }[reqs]
            if ssl_certfile:
                context.load_cert_chain(ssl_certfile, ssl_keyfile)
        return cls(
            host=parts.get("host", "127.0.0.1"),
            port=parts.get("port", 6379),
            path=parts.get("path"),
            db=parts.get("db", 0),
            username=username if username is not None else parts.get("username") or None,
            password=password if password is not None else parts.get("password") or None,
            ssl_context=context,
            connect_timeout_s=connect_timeout_s,
            socket_timeout_s=socket_timeout_s,
            retries=retries,
        )

    async def execute(self, *args: Any) -> Any:
        """Run one command; a lost connection is retried ``retries`` times on a new one."""
        return await self.request(pack(args))

    async def request(self, payload: bytes) -> Any:
        """Send one packed command (``pack``) and return its reply; retried as ``execute``."""
        attempt = 0
        while True:
            try:
                return await self._send(payload)
            except RedisConnectionError:
                attempt += 1
                if attempt > self.retries or self.closed:
                    raise

    async def request_asking(self, payload: bytes) -> Any:
        """``ASKING`` and the command, pipelined: a Cluster's ``ASK`` redirection."""
        protocol = self._protocol
        if protocol is None or protocol.lost:
            protocol = await self._connect()
        loop = asyncio.get_running_loop()
        asking, future = loop.create_future(), loop.create_future()
        protocol.send(_ASKING, asking)
        protocol.send(payload, future)
        try:
            return await future
        finally:
            if asking.done() and not asking.cancelled():
                asking.exception()  # retrieved: the command's own reply tells what happened

    def silent_s(self) -> float:
        """How long a reply has been owed with nothing heard (0: none owed)."""
        protocol = self._protocol
        if protocol is None or protocol.lost or not protocol.pending:
            return 0.0
        return time.monotonic() - max(protocol.sent_at[0], protocol.last_heard)

    def shard_of(self, key: str) -> str:
        return ""

    async def probe(self, shard: str) -> bool:
        reply: object = await self.execute("PING")
        return reply == "PONG"

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restarted or failed-over server: EVAL loads it again
            return await self.execute("EVAL", script.text, len(keys), *keys, *args)

    async def _send(self, payload: bytes) -> Any:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            if self.closed:
                raise RedisConnectionError(f"connection to {self.address} closed")
            protocol = await self._connect()
        future = asyncio.get_running_loop().create_future()
        protocol.send(payload, future)
        return await future

    async def _connect(self) -> _Protocol:
        if self.closed:
            raise RedisConnectionError(f"connection to {self.address} closed")
        # Concurrent callers share one connection attempt.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if connecting.cancelled() and (task is None or not task.cancelling()):
                # The attempt was cancelled by ``close``, not this caller: a lost connection.
                raise RedisConnectionError(f"connection to {self.address} closed") from None
            raise
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()

        def factory() -> _Protocol:
            return _Protocol(self.socket_timeout_s)

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.path is not None:
                    _, protocol = await loop.create_unix_connection(factory, self.path)
                else:
                    _, protocol = await loop.create_connection(
                        factory, self.host, self.port, ssl=self.ssl_context
                    )
                try:
                    await self._handshake(protocol)
                except BaseException:
                    protocol.close()
                    raise
        except TimeoutError as exc:  # builtin: the connect deadline
            raise RedisTimeoutError(
                f"connecting to Redis timed out after {self.connect_timeout_s}s"
            ) from exc
        except ssl.SSLError as exc:
            raise RedisConnectionError(f"TLS to Redis failed: {exc}") from exc
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        if self.closed:  # closed while connecting
            protocol.close()
            raise RedisConnectionError(f"connection to {self.address} closed")
        self._protocol = protocol
        return protocol

    async def _handshake(self, protocol: _Protocol) -> None:
        commands: list[tuple[Any, ...]] = []
        if self.password is not None:
            user = () if self.username is None else (self.username,)
            commands.append(("AUTH", *user, self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        if self.require_master:
            commands.append(("ROLE",))
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        for command, future in zip(commands, futures, strict=True):
            protocol.send(pack(command), future)
        for future in futures:
            await future
        if self.require_master and futures[-1].result()[0] != "master":
            raise ReadOnlyError(f"{self.address} is not a master (ROLE)")

    async def close(self) -> None:
        """Close for good: pending calls fail with ``ConnectionError``, later ones too."""
        self.abort()

    def abort(self) -> None:
        """``close`` without awaiting (nothing in it waits)."""
        self.closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None
