"""A Sentinel-managed master on the pipelined connection (one ``RespConnection`` to it).

The master is the one the sentinels name (``SENTINEL MASTER <service>``, asked of all of
them): among those that see it up (flags ``master``, neither ``s_down`` nor ``o_down``), the
one with the highest config epoch. Each new connection asks the server its ``ROLE`` and
refuses one that is not a master.

Sentinel's failover is not coordinated with clients: after the replica is promoted the old
master stays a master until Sentinel reconfigures it (seconds; never while it is cut off),
and what is written there then is lost when it resyncs from the new master. So every
``check_s`` all sentinels are asked again:

* while any reports ``failover_in_progress`` (set before the replica is promoted), the
  connection is dropped and calls fail at once (``ConnectionError``: ``QuotaUnavailable``
  for the caller, as for any unreachable Redis): a short 503 window instead of charges
  lost without a trace;
* when the master they name changes, the connection is dropped and calls go to the new
  one. A call cut off by the drop fails with ``ConnectionError``; one answered
  ``READONLY`` (a demoted master) makes the sentinels be asked at once, and either is sent
  once more to the new master (the quota scripts are idempotent).

Deadlines and cancellation are the connection's own (``extproc.quota.redis.resp``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError

from extproc.quota.redis.resp import RespConnection, Script
from extproc.quota.redis.slots import Address

log = structlog.get_logger("extproc.sentinel")

CHECK_S = 0.1  # how often the sentinels are asked which server is the master


def _fields(reply: Any) -> dict[str, str]:
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    return {str(k): str(v) for k, v in zip(reply[::2], reply[1::2], strict=True)}


class SentinelConnection:
    """The quota scripts' connection to a Sentinel-managed master (``ScriptRunner``)."""

    def __init__(
        self,
        sentinels: Sequence[RespConnection],
        service: str,
        template: RespConnection,
        *,
        check_s: float = CHECK_S,
        on_change: Callable[[Address | None], Awaitable[None]] | None = None,
    ) -> None:
        if not sentinels:
            raise ValueError("Sentinel needs at least one sentinel")
        self._sentinels = list(sentinels)
        self.service = service
        self._template = template
        self._check_s = check_s
        self._on_change = on_change  # told of each new master (None: fenced)
        self._master: RespConnection | None = None
        self._address: Address | None = None
        self._resolving: asyncio.Future[RespConnection] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        self.fenced = False  # a failover is under way: calls fail at once
        self.fences = 0  # failovers fenced so far

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        conn = self._master
        if conn is None or self.fenced or self._watcher is None:
            conn = await self._current()
        try:
            return await conn.run_script(script, keys, args)
        except ReadOnlyError:
            return await (await self._replaced(conn, asked=True)).run_script(script, keys, args)
        except RedisConnectionError:
            return await (await self._replaced(conn)).run_script(script, keys, args)

    async def execute(self, *args: Any) -> Any:
        conn = await self._current()
        try:
            return await conn.execute(*args)
        except ReadOnlyError:
            return await (await self._replaced(conn, asked=True)).execute(*args)
        except RedisConnectionError:
            return await (await self._replaced(conn)).execute(*args)

    def shard_of(self, key: str) -> str:
        return ""  # one master serves every key

    async def probe(self, shard: str) -> bool:
        try:
            reply: object = await self.execute("PING")
            return reply == "PONG"
        except (RedisError, OSError):
            return False

    async def _current(self) -> RespConnection:
        if self._closed:
            raise RedisConnectionError("Sentinel client closed")
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        if self.fenced:
            raise RedisConnectionError("Sentinel failover in progress")
        if self._master is not None:
            return self._master
        if self._resolving is None:
            self._resolving = asyncio.ensure_future(self._resolve())
            # Retrieved even when every caller was cut off by its deadline meanwhile.
            self._resolving.add_done_callback(lambda f: f.cancelled() or f.exception())
        resolving = self._resolving
        try:
            return await asyncio.shield(resolving)
        finally:
            if resolving.done() and self._resolving is resolving:
                self._resolving = None

    async def _replaced(self, failed: RespConnection, asked: bool = False) -> RespConnection:
        """The master to send a failed call to once more; raises when there is none other.

        ``asked``: ``failed`` said it is no master (READONLY): drop it and ask the
        sentinels now. Otherwise only a master the watcher has moved to meanwhile counts.
        """
        if asked:
            if self._master is failed:
                self._drop()
            conn: RespConnection | None = await self._current()
        else:
            conn = self._master
        if conn is None or conn is failed or self.fenced:
            raise RedisConnectionError(f"Redis master {failed.address} failed; no other yet")
        return conn

    async def _resolve(self) -> RespConnection:
        found = await self._survey()
        if found is None:
            raise RedisConnectionError(f"no sentinel names a master for {self.service!r}")
        failing_over, address = found
        if failing_over:
            raise RedisConnectionError("Sentinel failover in progress")
        return self._use(address)

    async def _survey(self) -> tuple[bool, Address] | None:
        """(a failover is in progress, the master) from all sentinels; None: none answers."""

        async def ask(sentinel: RespConnection) -> tuple[bool, int, Address] | None:
            try:
                async with asyncio.timeout(self._check_s * 4):
                    reply = await sentinel.execute("SENTINEL", "MASTER", self.service)
            except (RedisError, OSError, TimeoutError):
                return None
            state = _fields(reply)
            flags = state.get("flags", "").split(",")
            failing_over = "failover_in_progress" in flags
            if not failing_over and (
                "master" not in flags or "s_down" in flags or "o_down" in flags
            ):
                return None
            address = (state["ip"], int(state["port"]))
            return failing_over, int(state.get("config-epoch", 0)), address

        answers = [a for a in await asyncio.gather(*map(ask, self._sentinels)) if a]
        if not answers:
            return None
        if any(a[0] for a in answers):
            return True, max(answers, key=lambda a: a[1])[2]
        return False, max(answers, key=lambda a: a[1])[2]

    def _use(self, address: Address) -> RespConnection:
        if self._master is not None and self._address == address:
            return self._master
        if self._address is not None and self._address != address:
            log.warning("sentinel_master_changed", old=self._address, new=address)
        self._drop()
        self._master = self._template.to(*address, require_master=True)
        self._address = address
        self._tell(address)
        return self._master

    def _tell(self, address: Address | None) -> None:
        """``on_change`` in the background: nothing it waits for may hold the watcher."""
        if self._on_change is not None:
            task = asyncio.ensure_future(self._on_change(address))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _drop(self) -> None:
        if self._master is not None:
            self._master.abort()  # its waiting calls fail (ConnectionError)
            self._master = None

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._check_s)
            found = await self._survey()
            if found is None:
                continue  # no sentinel answers now: keep what we have
            failing_over, address = found
            if failing_over:
                if not self.fenced:
                    log.warning("sentinel_failover_fenced", master=self._address)
                    self.fenced = True
                    self.fences += 1
                    self._drop()
                    self._tell(None)
                continue
            self._use(address)
            self.fenced = False

    async def close(self) -> None:
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        self._drop()
        for sentinel in self._sentinels:
            sentinel.abort()
