"""Redis topologies: one server, a Redis Cluster, or a Sentinel-managed master.

URL forms (``redis_url``)::

    redis://[user:pass@]host:port[/db]                 one server (RespConnection fast path)
    redis+cluster://[user:pass@]host:port[,host:port...][?options]      (rediss+cluster: TLS)
    redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/db][?options]
                                                                         (rediss+sentinel)

``user:pass`` are the data nodes' credentials. Options: ``sentinel_username`` and
``sentinel_password`` (the sentinels' own AUTH, Sentinel only), ``ssl_cert_reqs``
(``none``/``optional``/``required``) and ``ssl_ca_certs`` (TLS forms only).

The quota scripts run on the same pipelined connection as on one server
(``extproc.quota.redis.resp``): one per master on a Cluster (``extproc.quota.redis.cluster``:
slot map, MOVED/ASK, re-read on failover), one to the master the sentinels name
(``extproc.quota.redis.sentinel``: fenced while a failover is in progress). redis-py's clients
(``build_client``: ``RedisCluster``, ``Sentinel.master_for``) remain the backend's
``client`` for the calls off the hot path (the orphan reconciler's pipelines).

Deadlines. Each quota call is bounded by the backend's ``command_timeout_s`` (an outer
``asyncio.timeout``); redirections and the one retry on a new master happen inside it. The
connections' socket timeout is set below the deadline (half of it), so that a stopped
(SIGSTOP) master's calls fail as timeouts, which make it suspect and the topology be read
again. A retry after an outcome-unknown error is safe: every script is idempotent on its
record key (and ``seq``), and the record is written by the same script, replicated with
it, as the charge.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast
from urllib.parse import parse_qsl, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.quota.base import SETTLED_TTL_S, LedgerSettings
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.redis.cluster import ClusterConnection
from extproc.quota.redis.resp import RespConnection
from extproc.quota.redis.sentinel import CHECK_S as SENTINEL_CHECK_S
from extproc.quota.redis.sentinel import SentinelConnection
from extproc.quota.redis.slots import Address

TopologyKind = Literal["single", "cluster", "sentinel"]

_SINGLE_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_TLS_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs"})
_SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
_CERT_REQS = ("none", "optional", "required")
# redis-py's own retries inside one call of its client (the reconciler's): a few quick
# ones, so a call that lands in the seconds of a failover gets the new master when ready.
CLIENT_RETRIES = 3
_BACKOFF = ExponentialWithJitterBackoff(base=0.02, cap=0.2)


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


def _socket_timeout(socket_timeout_s: float | None, command_timeout_s: float | None) -> float:
    # Below the call's deadline: a stuck (SIGSTOPped) master's calls fail as timeouts, which
    # make it suspect and the slot map / the sentinels be read again (see the docstring).
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


def _check_options(topology: Topology, connection_options: dict[str, Any]) -> None:
    if topology.kind == "single":
        raise ValueError("a single server uses RedisQuotaBackend.from_url")
    unknown = sorted(k for k in connection_options if not k.startswith("ssl_"))
    if unknown:
        raise TypeError(f"unexpected options for a {topology.kind}: {', '.join(unknown)}")


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
    """redis-py's client for a cluster or a Sentinel-managed master (decoded replies): what
    the backend's ``client`` is, for the calls off the hot path (the orphan reconciler)."""
    _check_options(topology, connection_options)
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
    master: aioredis.Redis = sentinel.master_for(
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
    return master


def _url(topology: Topology, host: str, port: int, db: int = 0) -> str:
    scheme = "rediss" if topology.tls else "redis"
    where = f"[{host}]" if ":" in host else host
    return f"{scheme}://{where}:{port}/{db}"


def build_scripts(
    topology: Topology,
    *,
    password: str | None = None,
    username: str | None = None,
    socket_timeout_s: float | None = 5.0,
    connect_timeout_s: float = 2.0,
    command_timeout_s: float | None = None,
    connection_retries: int | None = None,
    on_master_change: Callable[[Address | None], Awaitable[None]] | None = None,
    **connection_options: Any,
) -> ClusterConnection | SentinelConnection:
    """The quota scripts' pipelined connection(s) to a cluster or a Sentinel-managed master."""
    _check_options(topology, connection_options)
    timeout = _socket_timeout(socket_timeout_s, command_timeout_s)
    tls = {k: v for k, v in _tls_options(topology, connection_options).items() if k != "ssl"}
    settings: dict[str, Any] = {
        "connect_timeout_s": min(connect_timeout_s, timeout),
        "socket_timeout_s": timeout,
        "retries": 1 if connection_retries is None else connection_retries,
        **tls,
    }
    host, port = topology.nodes[0]
    template = RespConnection.from_url(
        _url(topology, host, port, topology.db),
        username=username if username is not None else topology.username,
        password=password if password is not None else topology.password,
        **settings,
    )
    if topology.kind == "cluster":
        return ClusterConnection(topology.nodes, template, refresh_timeout_s=timeout)
    sentinels = [
        RespConnection.from_url(
            _url(topology, h, p),
            username=topology.options.get("sentinel_username"),
            password=topology.options.get("sentinel_password"),
            **settings,
        )
        for h, p in topology.nodes
    ]
    assert topology.service is not None
    return SentinelConnection(
        sentinels, topology.service, template, check_s=SENTINEL_CHECK_S, on_change=on_master_change
    )


def _follow_master(client: aioredis.Redis) -> Callable[[Address | None], Awaitable[None]]:
    """redis-py's Sentinel pool drops its connections when the master changes or a failover
    is fenced (the reconciler's calls then ask the sentinels again, as redis-py does)."""
    # ``master_for`` gives its client a Sentinel pool; redis-py types it as the base pool.
    pool = cast(SentinelConnectionPool, client.connection_pool)

    async def changed(address: Address | None) -> None:
        await pool.disconnect(inuse_connections=True)

    return changed


class _Credentials(TypedDict):
    password: str | None
    username: str | None


class _Timeouts(TypedDict):
    socket_timeout_s: float | None
    connect_timeout_s: float
    command_timeout_s: float | None


def backend_for(
    topology: Topology,
    *,
    command_timeout_s: float | None = None,
    owner_id: str | None = None,
    settled_ttl_s: int = SETTLED_TTL_S,
    ledger: LedgerSettings | None = None,
    pool_timeout_s: float | None = None,
    connection_retries: int | None = None,
    password: str | None = None,
    username: str | None = None,
    max_connections: int = 64,
    socket_timeout_s: float | None = 5.0,
    connect_timeout_s: float = 2.0,
    **connection_options: Any,
) -> RedisQuotaBackend:
    """``RedisQuotaBackend`` on a cluster or a Sentinel-managed master (``from_url``'s
    options). The scripts run on pipelined connections (``build_scripts``); redis-py's
    client (``build_client``; ``max_connections`` bounds its pools, ``pool_timeout_s`` is
    unused) serves the calls off the hot path."""
    del pool_timeout_s
    credentials = _Credentials(password=password, username=username)
    timeouts = _Timeouts(
        socket_timeout_s=socket_timeout_s,
        connect_timeout_s=connect_timeout_s,
        command_timeout_s=command_timeout_s,
    )
    client = build_client(
        topology, max_connections=max_connections, **credentials, **timeouts,
        **connection_options,
    )  # fmt: skip
    follow = None
    if topology.kind == "sentinel":
        assert isinstance(client, aioredis.Redis)
        follow = _follow_master(client)
    scripts = build_scripts(
        topology,
        connection_retries=connection_retries,
        on_master_change=follow,
        **credentials,
        **timeouts,
        **connection_options,
    )
    return RedisQuotaBackend(
        client,
        scripts,
        command_timeout_s=command_timeout_s,
        owner_id=owner_id,
        settled_ttl_s=settled_ttl_s,
        ledger=ledger,
    )
