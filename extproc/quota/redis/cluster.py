"""Redis Cluster on the pipelined connection: one ``RespConnection`` per master.

A call goes to the master of its first key's slot (``slots.key_slot``; every key of a
quota script shares its tenant's hash tag) on that master's one pipelined connection, so
it costs what a call to a single server costs plus the slot lookup.

The slot map comes from ``CLUSTER SLOTS``, asked of the masters it names first, then of
their replicas, then of the seeds. It is read

* at the first call;
* after ``MOVED`` (the slot is pointed at the node named at once, the whole map read again
  in the background: a failover or a resharding moves many slots);
* while a master is *suspect*: its connection failed or timed out, or a call to it was cut
  off by its deadline while it had answered nothing for ``SILENT_S``. Every ``HEAL_MIN_S``
  .. ``HEAL_MAX_S`` the map is read again until no slot is served by the suspect any more
  (its replica was promoted) or a call or probe to it succeeds. A failing call also waits
  for one fresh read (at most one per ``REFRESH_MIN_S`` for all callers) and is sent again
  when its slot has a new master.

``ASK`` is followed for that call alone (``ASKING`` pipelined before it), at most
``REDIRECTS`` redirections per call. ``TRYAGAIN`` (a script whose keys are split between
the two masters of a slot being migrated, or missing on the importing one: a new tenant
of that slot) is retried with a growing pause, ``TRYAGAIN_RETRIES`` times (about 0.75 s).
The caller's deadline bounds all of it. A call sent again after an outcome-unknown failure
is safe: every quota script is idempotent on its record key (and ``seq``).

A connection whose server left the master set is closed: calls still waiting on it fail
with ``ConnectionError`` and go to the slot's new master.

``shard_of(key)`` is the address of the master that serves the key now; the resilient
wrapper keeps one circuit breaker per shard, so a dead master stops only its own slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import structlog
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.quota.redis.resp import RespConnection, Script, pack
from extproc.quota.redis.slots import SLOTS, Address, SlotMap, key_slot

log = structlog.get_logger("extproc.cluster")

REDIRECTS = 5  # MOVED / ASK followed per call
REFRESH_MIN_S = 0.05  # failing calls share one fresh read of the map at most this often
HEAL_MIN_S = 0.05  # first re-read after a master turned suspect; doubles up to
HEAL_MAX_S = 0.2
# A call cut off (its deadline) on a connection that owed replies this long with nothing
# heard makes that master suspect; a busy one that answers others does not.
SILENT_S = 0.1
TRYAGAIN_RETRIES = 10
TRYAGAIN_PAUSE_S = (0.01, 0.1)  # first pause, longest
# Errors after which the slot's master may have changed: the map is read again.
_FAILOVER_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError)


class ClusterConnection:
    """The quota scripts' connection to a Redis Cluster (the ``ScriptRunner`` interface)."""

    def __init__(
        self,
        seeds: Sequence[Address],
        template: RespConnection,
        *,
        refresh_timeout_s: float = 1.0,
    ) -> None:
        if not seeds:
            raise ValueError("a cluster needs at least one seed node")
        self._seeds = list(seeds)
        self._template = template  # credentials, TLS and timeouts of every node
        self._refresh_timeout_s = refresh_timeout_s
        self._slots: list[RespConnection | None] = [None] * SLOTS
        self._nodes: dict[Address, RespConnection] = {}  # masters (and ASK targets)
        self._by_name: dict[str, RespConnection] = {}
        self._owners: set[RespConnection] = set()  # the connections the map names
        self._replicas: frozenset[Address] = frozenset()
        self._suspects: set[RespConnection] = set()
        self._refreshing: asyncio.Future[None] | None = None
        self._refreshed_at = -1e9
        self._background: asyncio.Task[None] | None = None
        self._healer: asyncio.Task[None] | None = None
        self._closed = False
        self.refreshes = 0  # slot-map reads that changed or confirmed the map

    # -- calls -------------------------------------------------------------------------

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        key = keys[0]
        try:
            return await self._send(key, pack(("EVALSHA", script.sha, len(keys), *keys, *args)))
        except NoScriptError:  # a promoted replica or a restarted node: EVAL loads it
            return await self._send(key, pack(("EVAL", script.text, len(keys), *keys, *args)))

    async def execute(self, *args: Any) -> Any:
        """``PING``: every master must answer (the whole cluster's health); any other
        command goes to the master of its first argument's slot."""
        if args and str(args[0]).upper() == "PING":
            if not self._nodes:
                await self._refresh()
            await asyncio.gather(*(self._ping(conn) for conn in set(self._nodes.values())))
            return "PONG"
        if len(args) < 2:
            raise ValueError(f"a cluster routes commands by key: {args!r}")
        return await self._send(str(args[1]), pack(args))

    async def _ping(self, conn: RespConnection) -> None:
        reply = await conn.execute("PING")
        if reply != "PONG":
            raise RedisConnectionError(f"{conn.address} answered PING with {reply!r}")

    async def _send(self, key: str, payload: bytes) -> Any:
        slot = key_slot(key)
        asking: RespConnection | None = None
        redirects = retries = 0
        while redirects <= REDIRECTS:
            conn = asking or self._slots[slot] or await self._owner(slot)
            try:
                if asking is None:
                    reply = await conn.request(payload)
                else:
                    reply = await conn.request_asking(payload)
            except MovedError as exc:
                asking = None
                redirects += 1
                self._moved(slot, exc, conn)
            except AskError as exc:
                redirects += 1
                asking = self._node((exc.host or conn.host, exc.port))
            except TryAgainError:
                if retries == TRYAGAIN_RETRIES:
                    raise
                asking = None
                first, longest = TRYAGAIN_PAUSE_S
                await asyncio.sleep(min(first * 2**retries, longest))
                retries += 1
                redirects = 0  # the ASK that led here is asked again
            except _FAILOVER_ERRORS:
                asking = None
                self._suspect(conn)
                if not await self._moved_on(slot, conn):
                    raise
            except asyncio.CancelledError:
                if conn.silent_s() >= SILENT_S:  # cut off by its deadline, nothing heard
                    self._suspect(conn)
                raise
            else:
                if self._suspects:
                    self._suspects.discard(conn)
                return reply
        raise ClusterError(f"slot {slot}: more than {REDIRECTS} redirections")

    async def _owner(self, slot: int) -> RespConnection:
        """The slot's master once the map is read; ``ClusterDownError`` when it has none."""
        await self._refresh(REFRESH_MIN_S)
        conn = self._slots[slot]
        if conn is None:
            raise ClusterDownError(f"CLUSTERDOWN no master serves slot {slot}")
        return conn

    async def _moved_on(self, slot: int, failed: RespConnection) -> bool:
        """After a failure on ``failed``: has the slot another master (reading the map once)?"""
        if self._slots[slot] is failed:
            with contextlib.suppress(RedisError, OSError):
                await self._refresh(REFRESH_MIN_S)
        now = self._slots[slot]
        return now is not None and now is not failed and not now.closed

    def _moved(self, slot: int, exc: MovedError, conn: RespConnection) -> None:
        target = self._node((exc.host or conn.host, exc.port))
        self._slots[slot] = target
        self._owners.add(target)
        self._refresh_later()

    # -- shards and probes ---------------------------------------------------------------

    def shard_of(self, key: str) -> str:
        conn = self._slots[key_slot(key)]
        return conn.address if conn is not None else ""

    async def probe(self, shard: str) -> bool:
        """May calls for ``shard`` be sent again? Yes once it answers PING, or once no slot
        is served by it any more (they go to its successor); ``""`` (no map): once read."""
        if not shard:
            try:
                await self._refresh(REFRESH_MIN_S)
            except (RedisError, OSError):
                return False
            return any(c is not None for c in self._slots)
        conn = self._by_name.get(shard)
        if conn is None or conn not in self._owners:
            return True
        try:
            await self._ping(conn)
        except (RedisError, OSError):
            self._suspect(conn)
            return False
        self._suspects.discard(conn)
        return True

    # -- the slot map ----------------------------------------------------------------------

    def _node(self, address: Address) -> RespConnection:
        conn = self._nodes.get(address)
        if conn is None:
            conn = self._template.to(*address)
            self._nodes[address] = conn
            self._by_name[conn.address] = conn
        return conn

    def _suspect(self, conn: RespConnection) -> None:
        if self._closed or conn in self._suspects or conn.closed:
            return
        self._suspects.add(conn)
        if self._healer is None or self._healer.done():
            self._healer = asyncio.get_running_loop().create_task(self._heal())

    async def _heal(self) -> None:
        pause = HEAL_MIN_S
        while self._suspects and not self._closed:
            await asyncio.sleep(pause)
            try:
                await self._refresh()
            except (RedisError, OSError) as exc:
                log.warning("cluster_slots_unread", error=repr(exc))
            pause = min(pause * 2, HEAL_MAX_S)

    def _refresh_later(self) -> None:
        if self._refreshing is None and (self._background is None or self._background.done()):
            self._background = asyncio.get_running_loop().create_task(self._quiet_refresh())

    async def _quiet_refresh(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._refresh(REFRESH_MIN_S)

    async def _refresh(self, max_age_s: float = 0.0) -> None:
        """Read the map (one read at a time, shared by concurrent callers); none when the
        last one finished less than ``max_age_s`` ago."""
        if self._refreshing is None:
            if time.monotonic() - self._refreshed_at < max_age_s:
                return
            self._refreshing = asyncio.ensure_future(self._load())
            self._refreshing.add_done_callback(_retrieve)
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if refreshing.done() and self._refreshing is refreshing:
                self._refreshing = None

    async def _load(self) -> None:
        try:
            masters = [a for a, c in self._nodes.items() if c not in self._suspects]
            suspects = [a for a, c in self._nodes.items() if c in self._suspects]
            candidates = dict.fromkeys([*masters, *self._replicas, *self._seeds, *suspects])
            last: BaseException | None = None
            for address in candidates:
                conn = self._nodes.get(address)
                temporary = conn is None
                if conn is None:
                    conn = self._template.to(*address)
                try:
                    async with asyncio.timeout(self._refresh_timeout_s):
                        reply = await conn.execute("CLUSTER", "SLOTS")
                except (RedisError, OSError, TimeoutError) as exc:
                    last = exc
                    continue
                finally:
                    if temporary:
                        conn.abort()
                found = SlotMap.from_cluster_slots(reply, address)
                if found.masters:
                    self._install(found)
                    return
            raise RedisConnectionError(f"no cluster node answered CLUSTER SLOTS: {last!r}")
        finally:
            self._refreshed_at = time.monotonic()

    def _install(self, found: SlotMap) -> None:
        nodes = {a: self._node(a) for a in found.masters}
        before = self._owners
        self._slots = [nodes[a] if a is not None else None for a in found.owners]
        self._owners = set(nodes.values())
        self._replicas = found.replicas
        self.refreshes += 1
        for address, conn in list(self._nodes.items()):
            if address not in nodes:
                del self._nodes[address]
                self._by_name.pop(conn.address, None)
                self._suspects.discard(conn)
                conn.abort()  # its waiting calls fail and go to the slots' new master
        after = self._owners
        if before and before != after:
            log.warning(
                "cluster_masters_changed",
                gone=sorted(c.address for c in before - after),
                new=sorted(c.address for c in after - before),
            )

    async def close(self) -> None:
        self._closed = True
        for task in (self._healer, self._background, self._refreshing):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task
        for conn in self._nodes.values():
            conn.abort()
        self._nodes.clear()
        self._by_name.clear()


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # a read nobody waits for any more must not warn
