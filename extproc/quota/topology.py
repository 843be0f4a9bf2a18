"""Redis topologies: one server, a Redis Cluster, or a Sentinel-managed master.

URL forms (``redis_url``)::

    redis://[user:pass@]host:port[/db]                 one server (RespConnection fast path)
    redis+cluster://[user:pass@]host:port[,host:port...][?options]      (rediss+cluster: TLS)
    redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/db][?options]
                                                                         (rediss+sentinel)

``user:pass`` are the data nodes' credentials. Options: ``sentinel_username`` and
``sentinel_password`` (the sentinels' own AUTH, Sentinel only), ``ssl_cert_reqs``
(``none``/``optional``/``required``) and ``ssl_ca_certs`` (TLS forms only).

Cluster and Sentinel run the quota scripts on redis-py's own clients
(``RedisCluster``; ``Sentinel.master_for``), which follow MOVED/ASK and failovers;
``ClientScripts`` gives them the ``RespConnection`` interface the backend calls.

Deadlines. Each quota call is bounded by the backend's ``command_timeout_s`` (an outer
``asyncio.timeout``); redis-py's retries happen inside it. redis-py only re-reads the
topology when *it* sees a connection error or a socket timeout, never when the outer
deadline cancels it: so the socket timeout is set below the deadline (half of it), or a
stopped (SIGSTOP) master would hold its slots' calls until each deadline forever instead
of the client moving to the promoted replica. A retry after an outcome-unknown error is
safe: every script is idempotent on its record key (and ``seq``), and the record is
written by the same script, replicated with it, as the charge.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import parse_qsl, unquote

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.quota.base import SETTLED_TTL_S, LedgerSettings
from extproc.quota.redis_backend import RedisQuotaBackend
from extproc.quota.resp import Script

log = structlog.get_logger("extproc.topology")

TopologyKind = Literal["single", "cluster", "sentinel"]

_SINGLE_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_TLS_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs"})
_SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
_CERT_REQS = ("none", "optional", "required")
# redis-py's own retries inside one call (the deadline bounds them all): a few quick ones,
# so a call that lands in the seconds of a failover gets the new master when it is ready.
CLIENT_RETRIES = 3
_BACKOFF = ExponentialWithJitterBackoff(base=0.02, cap=0.2)
SENTINEL_CHECK_S = 0.1  # how often a Sentinel client re-asks which server is the master


@dataclass(frozen=True, slots=True)
class Topology:
    """A parsed ``redis_url``."""

    kind: TopologyKind
    nodes: tuple[tuple[str, int], ...] = ()  # seeds (cluster) or sentinels
    tls: bool = False
    username: str | None = None
    password: str | None = None
    service: str | None = None  # Sentinel's master name
    db: int = 0
    options: dict[str, str] = field(default_factory=dict)


def _split_scheme(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise ValueError(f"not a URL (scheme://...): {url!r}")
    return scheme.lower(), rest


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, sep, port = item[1:].partition("]:")
    else:
        host, sep, port = item.rpartition(":")
    if not sep or not host:
        raise ValueError(f"node {item!r} needs host:port in {_safe(url)}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"node {item!r} has no valid port (1-65535) in {_safe(url)}")
    return host, int(port)


def _safe(url: str) -> str:
    """The URL with its password replaced, for error messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not at or ":" not in credentials:
        return repr(url)
    user = credentials.split(":", 1)[0]
    return repr(f"{scheme}{sep}{user}:***@{hosts}")


def parse_redis_url(url: str) -> Topology:
    """Parse any ``redis_url`` form; ``ValueError`` says what is wrong (password hidden)."""
    scheme, rest = _split_scheme(url)
    if scheme in _SINGLE_SCHEMES:
        return Topology("single", tls=scheme == "rediss")
    if scheme not in _CLUSTER_SCHEMES + _SENTINEL_SCHEMES:
        known = ", ".join(f"{s}://" for s in _SINGLE_SCHEMES + _CLUSTER_SCHEMES + _SENTINEL_SCHEMES)
        raise ValueError(f"not a Redis URL: unknown scheme {scheme}:// (use {known} or memory://)")
    rest, _, query = rest.partition("?")
    credentials, at, location = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts, slash, path = location.partition("/")
    if not hosts:
        raise ValueError(f"no host:port in {_safe(url)}")
    nodes = tuple(_host_port(item, url) for item in hosts.split(","))
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    tls = scheme.startswith("rediss")
    allowed = (_TLS_OPTIONS if tls else frozenset()) | (
        _SENTINEL_OPTIONS if scheme in _SENTINEL_SCHEMES else frozenset()
    )
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} in {_safe(url)} "
            f"(allowed: {', '.join(sorted(allowed)) or 'none'})"
        )
    if "ssl_cert_reqs" in options and options["ssl_cert_reqs"] not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    if scheme in _CLUSTER_SCHEMES:
        if slash and path:
            raise ValueError(f"a cluster has no database or path (only db 0): {_safe(url)}")
        return Topology("cluster", nodes, tls, username, password, options=options)
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"Sentinel URL needs /<service> (the master's name): {_safe(url)}")
    if db and not db.isdigit():
        raise ValueError(f"database {db!r} is not a number in {_safe(url)}")
    return Topology(
        "sentinel", nodes, tls, username, password, unquote(service), int(db or 0), options
    )


def seeds_to_url(seeds: Sequence[Any]) -> str:
    """A list of ``redis://host:port`` (or ``rediss://``) seeds as one ``redis+cluster://`` URL.

    Every seed must have the same scheme and credentials, a port and no database.
    ``ValueError`` names the seed (``[i]``) that is wrong.
    """
    if not seeds:
        raise ValueError("a list of cluster seeds must not be empty")
    schemes: set[str] = set()
    credentials: set[str] = set()
    hosts: list[str] = []
    for i, seed in enumerate(seeds):
        if not isinstance(seed, str) or not seed:
            raise ValueError(f"[{i}]: must be a redis://host:port string, got {seed!r}")
        scheme, rest = _split_scheme(seed)
        if scheme not in ("redis", "rediss"):
            raise ValueError(
                f"[{i}]: a cluster seed must be redis:// or rediss://, got {_safe(seed)}"
            )
        cred, at, location = rest.rpartition("@")
        host, _, path = location.partition("/")
        if path not in ("", "0") or "?" in location:
            raise ValueError(f"[{i}]: a cluster seed takes no database or options: {_safe(seed)}")
        try:
            _host_port(host, seed)
        except ValueError as exc:
            raise ValueError(f"[{i}]: {exc}") from exc
        schemes.add(scheme)
        credentials.add(cred + at)
        hosts.append(host)
    if len(schemes) > 1:
        raise ValueError("cluster seeds mix redis:// and rediss://")
    if len(credentials) > 1:
        raise ValueError("cluster seeds carry different credentials")
    return f"{schemes.pop()}+cluster://{credentials.pop()}{','.join(hosts)}"


class ScriptRunner(Protocol):
    """What ``RedisQuotaBackend`` calls its ``scripts`` (``RespConnection`` has it)."""

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any: ...

    async def execute(self, *args: Any) -> Any: ...

    async def close(self) -> None: ...


class ClientScripts:
    """The ``scripts`` interface on a redis-py client (``RedisCluster`` or a Sentinel master).

    EVALSHA, and on NOSCRIPT (a promoted replica that never saw the script, a restarted
    node) EVAL. The cluster client routes both by their keys' slot (all keys of a script
    share the tenant's hash tag; redis-py refuses keys of different slots). The client
    is the backend's own and is closed by it, not here.
    """

    def __init__(
        self, client: aioredis.Redis | RedisCluster, master_check_s: float | None = None
    ) -> None:
        self.client = client
        self._cluster = isinstance(client, RedisCluster)
        # Sentinel only: how often to ask the sentinels which server is the master.
        self._master_check_s = master_check_s
        self._watcher: asyncio.Task[None] | None = None
        self.fenced = False  # a Sentinel failover is under way: calls fail at once
        self.fences = 0  # failovers fenced so far

    async def run_script(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self._command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._command("EVAL", script.text, len(keys), *keys, *args)

    async def execute(self, *args: Any) -> Any:
        if args and str(args[0]).upper() == "PING":
            # redis-py parses PONG into True; on a cluster every master must answer (the
            # breaker's probe: a master without a promoted replica still fails calls).
            if self._cluster:
                await self._command("PING", target_nodes=RedisCluster.PRIMARIES)
            else:
                await self._command("PING")
            return "PONG"
        return await self._command(*args)

    async def _command(self, *args: Any, **options: Any) -> Any:
        if self._master_check_s is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_master())
        if self.fenced:
            raise RedisConnectionError("Sentinel failover in progress")
        for attempt in itertools.count():
            try:
                return await self.client.execute_command(*args, **options)
            except (AttributeError, TypeError) as exc:
                # redis-py 8.1's asyncio write path leaks these for a connection closed
                # under it (a failover's reconnects; redis/redis-py#4287, #3546) instead of
                # ConnectionError. The outcome is unknown as for any lost connection, and
                # the scripts are idempotent: retry (the deadline bounds it), then give up.
                if attempt >= CLIENT_RETRIES:
                    raise RedisConnectionError(
                        f"connection closed under the call: {exc!r}"
                    ) from exc
        raise AssertionError("unreachable")

    async def _watch_master(self) -> None:
        """Follow Sentinel's view of the master; fence the calls while it fails over.

        Sentinel's failover is not coordinated with clients: after the replica is promoted
        the old master stays a master until Sentinel reconfigures it (seconds; never while
        it is cut off), and redis-py keeps using pooled connections to it: what is written
        there is lost when it resyncs from the new master. redis-py asks Sentinel only when
        it opens a connection, and asks whichever sentinel comes first, which may not know
        of the failover yet. So every ``master_check_s`` all sentinels are asked:

        * while any reports ``failover_in_progress`` (set before the replica is promoted),
          every connection is dropped and calls fail at once (``QuotaUnavailable``, as any
          unreachable Redis): a short 503 window instead of charges lost without a trace;
        * the master with the highest config epoch wins and its sentinel goes first (new
          connections ask it); when the master changes, every connection is dropped again.

        A call cut off by a drop fails with ConnectionError and is retried (idempotent).
        """
        assert self._master_check_s is not None
        pool: SentinelConnectionPool = self.client.connection_pool  # type: ignore[assignment]
        manager = pool.sentinel_manager
        known: tuple[str, int] | None = None

        async def state(sentinel: Any) -> tuple[int, tuple[str, int], bool, Any] | None:
            try:
                async with asyncio.timeout(self._master_check_s * 4):  # type: ignore[operator]
                    masters = await sentinel.sentinel_masters()
            except (RedisError, OSError, TimeoutError):
                return None
            found = masters.get(pool.service_name)
            if not found:
                return None
            failing_over = "failover_in_progress" in str(found.get("flags", ""))
            if not failing_over and not manager.check_master_state(found, pool.service_name):
                return None
            epoch = int(found.get("config-epoch", 0))
            return epoch, (found["ip"], int(found["port"])), failing_over, sentinel

        while True:
            await asyncio.sleep(self._master_check_s)
            answers = [a for a in await asyncio.gather(*map(state, manager.sentinels)) if a]
            if not answers:
                continue  # no sentinel answers now: keep what we have
            if any(a[2] for a in answers):
                if not self.fenced:
                    log.warning("sentinel_failover_fenced", master=known)
                    self.fenced = True
                    self.fences += 1
                    await pool.disconnect(inuse_connections=True)
                continue
            _, address, _, sentinel = max(answers, key=lambda a: a[0])
            manager.sentinels.remove(sentinel)
            manager.sentinels.insert(0, sentinel)
            if known is not None and address != known:
                log.warning("sentinel_master_changed", old=known, new=address)
                pool.master_address = address
                await pool.disconnect(inuse_connections=True)
            known = address
            self.fenced = False

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None


def _socket_timeout(socket_timeout_s: float | None, command_timeout_s: float | None) -> float:
    # Below the call's deadline, so redis-py sees a stuck node itself and re-reads the
    # topology (see the module docstring).
    candidates = [t for t in (socket_timeout_s, (command_timeout_s or 0) / 2) if t]
    return min(candidates) if candidates else 5.0


def _tls_options(topology: Topology, extra: dict[str, Any]) -> dict[str, Any]:
    if not topology.tls:
        return {}
    options: dict[str, Any] = {"ssl": True}
    for name in ("ssl_cert_reqs", "ssl_ca_certs"):
        if name in topology.options:
            options[name] = topology.options[name]
    options.update({k: v for k, v in extra.items() if k.startswith("ssl_")})
    if options.get("ssl_cert_reqs") in ("none", "optional"):
        options.setdefault("ssl_check_hostname", False)
    return options


def build_client(
    topology: Topology,
    *,
    password: str | None = None,
    username: str | None = None,
    max_connections: int = 64,
    socket_timeout_s: float | None = 5.0,
    connect_timeout_s: float = 2.0,
    command_timeout_s: float | None = None,
    **connection_options: Any,
) -> aioredis.Redis | RedisCluster:
    """redis-py's client for a cluster or a Sentinel-managed master (decoded replies)."""
    if topology.kind == "single":
        raise ValueError("a single server uses RedisQuotaBackend.from_url")
    unknown = sorted(k for k in connection_options if not k.startswith("ssl_"))
    if unknown:
        raise TypeError(f"unexpected options for a {topology.kind}: {', '.join(unknown)}")
    timeout = _socket_timeout(socket_timeout_s, command_timeout_s)
    connect = min(connect_timeout_s, timeout)
    common: dict[str, Any] = {
        "decode_responses": True,
        "username": username if username is not None else topology.username,
        "password": password if password is not None else topology.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": connect,
        "socket_keepalive": True,
        **_tls_options(topology, connection_options),
    }
    if topology.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
            # A slot whose master is down must not stop the others' tenants from starting.
            require_full_coverage=False,
            max_connections=max_connections,
            retry=Retry(_BACKOFF, CLIENT_RETRIES),
            **common,
        )
    ssl = common.pop("ssl", False)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect,
        "username": topology.options.get("sentinel_username"),
        "password": topology.options.get("sentinel_password"),
    }
    if ssl:
        sentinel_kwargs.update({k: v for k, v in common.items() if k.startswith("ssl")})
        sentinel_kwargs["ssl"] = True
    sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=sentinel_kwargs)
    assert topology.service is not None
    return sentinel.master_for(
        topology.service,
        redis_class=aioredis.Redis,
        db=topology.db,
        max_connections=max_connections,
        # A connection to a demoted master fails with ConnectionError (redis-py turns
        # READONLY into it) and is reconnected to the master Sentinel names now.
        retry=Retry(_BACKOFF, CLIENT_RETRIES, (RedisConnectionError, RedisTimeoutError)),
        ssl=ssl,
        **common,
    )


def backend_for(
    topology: Topology,
    *,
    command_timeout_s: float | None = None,
    owner_id: str | None = None,
    settled_ttl_s: int = SETTLED_TTL_S,
    ledger: LedgerSettings | None = None,
    pool_timeout_s: float | None = None,
    connection_retries: int | None = None,
    **client_options: Any,
) -> RedisQuotaBackend:
    """``RedisQuotaBackend`` on a cluster or Sentinel client (``from_url``'s options).

    ``pool_timeout_s`` and ``connection_retries`` belong to the single-server connection
    and are ignored here: redis-py's pools and ``CLIENT_RETRIES`` serve these topologies.
    """
    del pool_timeout_s, connection_retries
    client = build_client(topology, command_timeout_s=command_timeout_s, **client_options)
    return RedisQuotaBackend(
        client,  # type: ignore[arg-type]  # RedisCluster has the Redis commands it uses
        # the RespConnection interface
        ClientScripts(  # type: ignore[arg-type]
            client, SENTINEL_CHECK_S if topology.kind == "sentinel" else None
        ),
        command_timeout_s=command_timeout_s,
        owner_id=owner_id,
        settled_ttl_s=settled_ttl_s,
        ledger=ledger,
    )
