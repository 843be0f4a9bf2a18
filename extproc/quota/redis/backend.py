"""Quota backend on Redis: one EVALSHA round trip per admit, reserve, settle and cancel.

Each operation is one Lua script (``lua/*.lua``) so that check-and-charge is atomic across
processors and replicas, and windows come from the Redis ``TIME`` of the server that holds
the counters, never from a processor's clock. The scripts run on pipelined connections
(``extproc.quota.redis.resp``: a tenth of redis-py's CPU per call): one to a single server, one
per master of a Cluster, one to a Sentinel-managed master (``extproc.quota.redis.topology``);
EVALSHA, and on NOSCRIPT (a restarted or failed-over server) EVAL, which loads the script
again. redis-py's client serves what is off the hot path (the orphan reconciler).

Shards. ``shard_of(key)`` names the server that serves a key now (a Cluster's master;
``""`` on one server or Sentinel) and ``probe(shard)`` says whether calls for it may be
sent again: the resilient wrapper keeps one circuit breaker per shard.

Failures. Every script call is bounded by ``command_timeout_s`` (pool wait, connect, the
retry and the reply together) and raises ``QuotaTimeout`` when it expires; any other failure
to get an answer raises ``QuotaUnavailable``. A lost connection is retried once, at once,
on a new connection: every script is idempotent on its record key (and ``seq``), and a
connection that sat through a Redis restart fails once when next used. A call cut off by
the deadline leaves no stale reply behind: its reply is read and dropped in turn.

Keys. Every key a script touches is in its KEYS, the concrete window keys included: the
backend estimates the server's clock (an offset learned from the TIME every reply carries,
0 at first), passes each counter's current window key and start, and the script checks the
starts against its own TIME. A mismatch (near a window boundary, or a wrong estimate)
charges nothing and replies the server's time: the offset is corrected and the call retried
(``WINDOW_RETRIES``). Windows still come from the server's clock.

Ownership. Each backend instance is one processor identity (``owner_id``): admit.lua stores
it in every admitted record and adds the record to the owner's open set in the tenant's
slot (``keys.open_set_key``), settle.lua takes it out: the same script calls, no extra
round trip. With ``registrations`` set (``extproc.quota.liveness.orphans`` sets it), an admission
first makes sure the processor's index in ``{~p}`` lists that open set: a set lookup, and
one round trip the first time a tenant is seen (and after a heartbeat lapse), so a peer
finds every open record of a dead processor. ``settle_orphan`` is the peer's side: it
settles a dead owner's record with ``used`` = what it had reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.quota import keys as keynames
from extproc.quota import windows
from extproc.quota.base import (
    RECORD_TTL_S,
    SETTLED_TTL_S,
    Absorption,
    AdmitRequest,
    Block,
    Counter,
    CounterState,
    Grant,
    LedgerSettings,
    QuotaMisconfigured,
    QuotaTimeout,
    QuotaUnavailable,
    Settlement,
    SettleReason,
    UsageTags,
    Verdict,
)
from extproc.quota.keys import (
    RESERVATION_KEY_PATTERN,
    WINDOW_KEY_PATTERN,
    open_count_key,
    usage_stream_key,
    window_key,
)
from extproc.quota.liveness.orphans import Registrations
from extproc.quota.redis.resp import RespConnection, Script, ScriptRunner

if TYPE_CHECKING:
    from extproc.quota.liveness.orphans import RedisClient

T = TypeVar("T")

# A settlement is remembered this long, and at most this many (newest kept), to be sent
# again if a failover loses it: the processor's next sweeps find it open (``orphans``).
REPAIRABLE_S = 120.0
REPAIRABLE_MAX = 20_000

# What ``settle_orphan`` found: settled now, settled before (by its owner or a peer), no
# admitted record (expired or never admitted), or a record another processor admitted.
OrphanStatus = Literal["settled", "already_settled", "no_record", "not_owned"]
_ORPHAN_STATUS: dict[int, OrphanStatus] = {
    0: "settled",
    1: "already_settled",
    2: "no_record",
    3: "not_owned",
}
_MODE_SETTLE, _MODE_CANCEL, _MODE_ORPHAN, _MODE_RETURN, _MODE_SETTLE_SEEN = 0, 1, 2, 3, 4
_LOST_RECORD = 5  # settle.lua: settled in seen mode without a record (charged in full)
# A script finding a passed window start that is not its server's current one charges
# nothing and says so; the call is retried with the server's clock at most this often.
WINDOW_RETRIES = 2
_NO_TAGS = UsageTags()


# What Redis 7 answers when a script's own call is refused by the ACL (an ERR, not NOPERM).
_SCRIPT_ACL_REFUSAL = "The user executing the script can't"


def misconfiguration(operation: str, exc: BaseException) -> QuotaMisconfigured | None:
    """The configuration error ``exc`` is, if it is one: credentials refused (WRONGPASS,
    NOAUTH) or a command or key outside the user's ACL (NOPERM, or in a script its ERR)."""
    if isinstance(exc, AuthenticationError):
        return QuotaMisconfigured(
            f"Redis refused the processor's credentials (the redis_url user and password, "
            f"redis_username, redis_password_file/_env): {exc}",
            "auth",
        )
    if isinstance(exc, NoPermissionError) or (
        isinstance(exc, ResponseError)
        and (str(exc).startswith("NOPERM") or _SCRIPT_ACL_REFUSAL in str(exc))
    ):
        return QuotaMisconfigured(
            f"Redis's ACL refused quota {operation}: the processor's user needs the commands "
            f"and keys of deploy/redis/users.acl under its key_prefix ({exc})",
            "permission",
        )
    return None


class WrongWindow(QuotaUnavailable):
    """The server's clock kept disagreeing with the window keys passed (clock jumps)."""


def new_owner_id() -> str:
    """A processor id unique across hosts and restarts: host, pid and 32 random bits."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


# Tests only: the scripts add the integer in this Redis key to TIME (a Redis-side clock a
# test can move, e.g. to a month's end). Single node only: the key is not in KEYS.
TEST_CLOCK_ENV = "EXTPROC_TEST_CLOCK_KEY"
_SAFE_KEY = re.compile(r"^[A-Za-z0-9:._-]*$")


def _read_lua(name: str) -> str:
    return resources.files("extproc.quota.redis").joinpath("lua", name).read_text(encoding="utf-8")


# Scripts that write usage ledger entries: lua/ledger.lua goes before them too.
_LEDGER_SCRIPTS = frozenset({"settle.lua", "absorb.lua"})


def _lua_string(text: str) -> str:
    if any(c in text for c in "'\\\n"):
        raise ValueError(f"not a plain Lua string: {text!r}")
    return f"'{text}'"


def ledger_constants() -> str:
    """lua/ledger.lua's constants, rendered from their Python definitions (the memory
    backend uses the same ones)."""
    rank = ", ".join(
        f"[{_lua_string(kind)}] = {r}" for kind, r in windows.LEDGER_WINDOW_RANK.items()
    )
    return (
        f"local LEDGER_RANK, LEDGER_UNRANKED = {{{rank}}}, {windows.LEDGER_UNRANKED}\n"
        f"local WINDOW_KEY = {_lua_string(WINDOW_KEY_PATTERN)}\n"
        f"local RESERVATION_KEY = {_lua_string(RESERVATION_KEY_PATTERN)}\n"
    )


def load_lua(name: str) -> str:
    """A script with the shared counter functions (``lua/counters.lua``) before it, and
    the ledger's (``lua/ledger.lua``) before those that write ledger entries."""
    clock_key = os.environ.get(TEST_CLOCK_ENV, "")
    if not _SAFE_KEY.match(clock_key):
        raise ValueError(f"{TEST_CLOCK_ENV} must be a plain key name, got {clock_key!r}")
    shared = _read_lua("counters.lua")
    if name in _LEDGER_SCRIPTS:
        shared += ledger_constants() + _read_lua("ledger.lua")
    return f"local CLOCK_KEY = '{clock_key}'\n" + shared + _read_lua(name)


def _parse_verdict(verdict: str, now: float, replayed: bool, cancelled: bool) -> Verdict:
    parts = verdict.split(",") if verdict else ["0", "", ""]
    states: list[CounterState] = []
    for i in range(3, len(parts), 5):
        kind, limit, value, reset_at, retry_at = parts[i : i + 5]
        states.append(
            windows.counter_state(
                kind, int(limit), int(value), int(reset_at), now, int(retry_at) or None
            )
        )
    if cancelled:
        return Verdict(admitted=False, states=tuple(states), replayed=replayed, cancelled=True)
    admitted = parts[0] == "1"
    return Verdict(
        admitted=admitted,
        refused_by=None if admitted else parts[1],
        states=tuple(states),
        replayed=replayed,
        shadow_refused_by=tuple(parts[2].split(";")) if parts[2] else (),
    )


def _settlement(status: Any, summary: str) -> Settlement:
    reserved, used_recorded, *refunds = (int(x) for x in summary.split(","))
    return Settlement(
        reserved=reserved,
        used=used_recorded,
        refunded=refunds[0] if refunds else 0,
        already_settled=status == 1,
        refunded_per_counter=tuple(refunds),
        record_lost=status == _LOST_RECORD,
    )


class RedisQuotaBackend:
    """The shared backend for several processor replicas.

    On one Redis server (``from_url``), a Cluster or a Sentinel-managed master
    (``topology.backend_for``). Every key of a tenant shares one hash tag, so each script
    touches one slot.
    """

    def __init__(
        self,
        client: RedisClient,
        scripts: ScriptRunner,
        command_timeout_s: float | None = None,
        *,
        owner_id: str | None = None,
        settled_ttl_s: int = SETTLED_TTL_S,
        ledger: LedgerSettings | None = None,
    ) -> None:
        # The client must decode responses: the scripts reply with text verdicts.
        if command_timeout_s is not None and command_timeout_s <= 0:
            raise ValueError(f"command_timeout_s must be > 0, got {command_timeout_s}")
        if settled_ttl_s <= 0:
            raise ValueError(f"settled_ttl_s must be > 0, got {settled_ttl_s}")
        if owner_id == "":
            raise ValueError("owner_id must be non-empty")
        self._client = client
        self._scripts = scripts
        self._command_timeout_s = command_timeout_s
        self.owner_id = owner_id or new_owner_id()
        self.settled_ttl_s = settled_ttl_s
        # Set by ``extproc.quota.liveness.orphans.Liveness``; None: no index is kept (no cost).
        self.registrations: Registrations | None = None
        self._owner_part = keynames.encode_name(self.owner_id)
        # keys.open_set_key of this processor, its tenant part left out (encoded once).
        self._owned_suffix = ":own:" + self._owner_part
        self._admit = Script(self.script_source("admit.lua"))
        self._reserve = Script(self.script_source("reserve.lua"))
        self._absorb = Script(load_lua("absorb.lua"))
        self.ledger = ledger if ledger is not None else LedgerSettings()  # builds _settle
        # Server clock minus ours, learned from the TIME in every reply.
        self.clock_offset_s = 0.0
        # Calls sent again because the window keys passed were not the server's current.
        self.window_retries = 0
        # Settlements, cancels and block returns made lately, by record key: each one's
        # settle.lua request (its head), so that one a failover lost (``repair_settlement``)
        # can be sent again as it was.
        self._settled: OrderedDict[str, tuple[tuple[Counter, ...], list[Any], float]] = (
            OrderedDict()
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        password: str | None = None,
        username: str | None = None,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
        socket_timeout_s: float | None = 5.0,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float | None = None,
        connection_retries: int = 1,
        owner_id: str | None = None,
        settled_ttl_s: int = SETTLED_TTL_S,
        ledger: LedgerSettings | None = None,
        **connection_options: Any,
    ) -> RedisQuotaBackend:
        """Connect lazily to ``redis://`` or ``rediss://`` (TLS) ``[user:password@]host:port/db``.

        ``password``/``username`` override the URL's credentials (keeps secrets out of URLs
        in config files). The pool blocks when all ``max_connections`` are busy instead of
        opening unbounded connections under a burst; hiredis parses replies when installed.
        ``command_timeout_s`` bounds each admit/reserve/settle/cancel call as a whole
        (``QuotaTimeout``); ``None`` leaves only the socket and pool timeouts. A lost
        connection is retried ``connection_retries`` times. Extra options (``ssl_ca_certs``,
        ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``) go to
        both clients; ``max_connections`` bounds redis-py's pool (off the hot path).
        """
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"not a Redis URL (redis://, rediss://, unix://): {url!r}")
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "socket_keepalive": True,
            # One immediate retry on a connection error (not on a timeout: the outcome is
            # then unknown to the caller, who cancels): a stale pooled connection, e.g. one
            # that sat through a server restart, fails once and is reconnected.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            **connection_options,
        }
        if password is not None:
            options["password"] = password
        if username is not None:
            options["username"] = username
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **options
        )
        scripts = RespConnection.from_url(
            url,
            username=username,
            password=password,
            connect_timeout_s=connect_timeout_s,
            socket_timeout_s=socket_timeout_s,
            retries=connection_retries,
            **{k: v for k, v in connection_options.items() if k.startswith("ssl_")},
        )
        return cls(
            aioredis.Redis.from_pool(pool),
            scripts,
            command_timeout_s=command_timeout_s,
            owner_id=owner_id,
            settled_ttl_s=settled_ttl_s,
            ledger=ledger,
        )

    @property
    def ledger(self) -> LedgerSettings:
        return self._ledger

    @ledger.setter
    def ledger(self, settings: LedgerSettings) -> None:
        if settings.max_len < 0 or settings.retention_s < 0:
            raise ValueError("usage ledger max_len and retention_s must be >= 0")
        self._ledger = settings
        self._settle = Script(self.script_source("settle.lua"))

    def script_source(self, name: str) -> str:
        """A script's text with this backend's constants prepended: what every call would
        otherwise pack as arguments (a server-side constant costs nothing per call)."""
        constants: dict[str, int | str] = {"MARGIN": windows.EXPIRY_MARGIN_S}
        if name == "settle.lua":
            constants |= {
                "SETTLED_TTL": self.settled_ttl_s,
                "LEDGER": "true" if self._ledger.enabled else "false",
                "MAX_LEN": self._ledger.max_len,
                "RETENTION_MS": self._ledger.retention_s * 1000,
            }
        names, values = ", ".join(constants), ", ".join(map(str, constants.values()))
        return f"local {names} = {values}\n" + load_lua(name)

    @property
    def command_timeout_s(self) -> float | None:
        """The bound of each script call (None: only the socket and pool timeouts)."""
        return self._command_timeout_s

    @property
    def client(self) -> RedisClient:
        """The client the scripts run on (the orphan reconciler's own calls share it)."""
        return self._client

    def shard_of(self, key: str) -> str:
        """The server that serves ``key`` now (``""``: the only one)."""
        return self._scripts.shard_of(key)

    async def probe(self, shard: str) -> bool:
        """May calls for ``shard`` be sent again (it answers, or serves no key any more)?"""
        try:
            async with asyncio.timeout(self._command_timeout_s):
                return await self._scripts.probe(shard)
        except (RedisError, OSError):  # TimeoutError included
            return False

    async def _call(self, operation: str, call: Awaitable[T]) -> T:
        """Run one script call under the deadline, mapping failures to the quota errors."""
        try:
            async with asyncio.timeout(self._command_timeout_s):
                return await call
        except TimeoutError as exc:  # the deadline (builtin TimeoutError, an OSError)
            within = f" within {self._command_timeout_s}s" if self._command_timeout_s else ""
            raise QuotaTimeout(f"quota {operation} got no answer{within}") from exc
        except RedisTimeoutError as exc:  # socket_timeout / connect timeout
            raise QuotaTimeout(f"quota {operation} timed out: {exc}") from exc
        except (RedisError, OSError) as exc:
            refused = misconfiguration(operation, exc)
            if refused is not None:
                raise refused from exc
            raise QuotaUnavailable(f"quota {operation} failed: {exc}") from exc

    def server_now_s(self) -> int:
        """This process's estimate of the server's clock, in whole seconds."""
        return math.floor(time.time() + self.clock_offset_s)

    def learn_clock(self, now_s: Any, now_us: Any) -> float:
        """Take the server's TIME from a reply; returns it as a float."""
        now = int(now_s) + int(now_us) / 1_000_000
        self.clock_offset_s = now - time.time()
        return now

    async def admit(self, request: AdmitRequest) -> Verdict:
        windows.check_admit(request)
        counters = request.request_counters + request.token_counters
        tags = request.usage or _NO_TAGS
        key = request.reservation_key
        tenant = keynames.tenant_part(key)
        open_key = tenant + ":open"
        owned_key = tenant + self._owned_suffix
        registrations = self.registrations
        if registrations is not None and not registrations.fresh(owned_key):
            await registrations.ensure(owned_key)  # before the charge a peer must find
        now_s = math.floor(time.time() + self.clock_offset_s)
        for attempt in range(WINDOW_RETRIES + 1):
            keys = [key]
            args: list[Any] = [
                len(request.request_counters),
                len(request.token_counters),
                request.tokens,
                1 if request.count_refused_attempts else 0,
                request.record_ttl_s,
                self.owner_id,
                1 if request.soft_refusal else 0,
                tags.plan,
                tags.model,
                tags.client_request_id,
                tags.prompt_tokens,
            ]
            for c in counters:
                counter_key, shape, a, b = windows.script_window(c, now_s)
                keys.append(counter_key)
                args += (c.kind, c.limit, shape, a, b, c.weights[0], c.weights[1])
                args.append(1 if c.shadow else 0)
            keys += (open_key, owned_key)
            reply = await self._call("admit", self._scripts.run_script(self._admit, keys, args))
            replayed, verdict, reply_s, reply_us, cancelled, retry_soon, wrong = reply
            now = self.learn_clock(reply_s, reply_us)
            if not wrong:
                break
            self.window_retries += 1
            now_s = int(reply_s)
            if attempt == WINDOW_RETRIES:
                raise WrongWindow(f"quota admit: window keys kept missing the server's {now}")
        if retry_soon:
            return Verdict(admitted=False, retry_soon=True)
        return _parse_verdict(verdict, now, replayed=bool(replayed), cancelled=bool(cancelled))

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant:
        windows.check_reserve(seq, amount, minimum, token_counters)
        listings = (
            open_count_key(reservation_key),
            keynames.tenant_part(reservation_key) + self._owned_suffix,
        )
        now_s = math.floor(time.time() + self.clock_offset_s)
        for attempt in range(WINDOW_RETRIES + 1):
            keys = [reservation_key]
            args: list[Any] = [seq, amount, minimum]
            for c in token_counters:
                counter_key, shape, a, b = windows.script_window(c, now_s)
                keys.append(counter_key)
                args += (c.limit, shape, a, b, c.weights[1], 1 if c.shadow else 0)
            keys += listings
            reply = await self._call("reserve", self._scripts.run_script(self._reserve, keys, args))
            status, granted, reply_s, reply_us = reply[:4]
            now = self.learn_clock(reply_s, reply_us)
            if status != "wrong_window":
                break
            self.window_retries += 1
            now_s = int(reply_s)
            if attempt == WINDOW_RETRIES:
                raise WrongWindow(f"quota reserve: window keys kept missing the server's {now}")
        if status in ("not_admitted", "settled"):
            return Grant(granted=0)
        states = tuple(
            windows.counter_state(
                c.kind, c.limit, int(reply[4 + 2 * i]), int(reply[5 + 2 * i]), now
            )
            for i, c in enumerate(token_counters)
        )
        shadow = reply[-1]
        return Grant(
            granted=int(granted),
            states=states,
            replayed=status == "replayed",
            others_open=int(reply[-2]),
            shadow_cut_by=tuple(token_counters[int(i) - 1].kind for i in shadow.split(";"))
            if shadow
            else (),
        )

    async def settle(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        used: int,
        *,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
        cached_tokens: int = 0,
        seen_admitted: bool = False,
        usage: UsageTags | None = None,
    ) -> Settlement:
        windows.check_settle(used, token_counters)
        windows.check_reason(reason, output_tokens, used)
        mode = _MODE_SETTLE_SEEN if seen_admitted else _MODE_SETTLE
        # _send_settle inlined: the hot path's one round trip without another coroutine.
        head = [used, mode, RECORD_TTL_S, self.owner_id, reason,
                -1 if output_tokens is None else output_tokens, cached_tokens]  # fmt: skip
        if seen_admitted and usage is not None:  # no request counters, then the lost tags
            head += (0, usage.plan, usage.model, usage.client_request_id, usage.prompt_tokens)
        now_s = math.floor(time.time() + self.clock_offset_s)
        keys, args = self._settle_request(reservation_key, token_counters, head, now_s)
        reply = await self._call("settle", self._scripts.run_script(self._settle, keys, args))
        if reply[0] == 4:
            reply = await self._settle_retry("settle", reservation_key, token_counters, head, reply)
        self._remember(reservation_key, token_counters, head)
        return _settlement(reply[0], reply[1])

    def _remember(self, key: str, token_counters: tuple[Counter, ...], head: list[Any]) -> None:
        settled, now = self._settled, time.monotonic()
        settled.pop(key, None)  # the newest last: the oldest go first
        settled[key] = (token_counters, head, now)
        while settled:
            first = next(iter(settled.values()))
            if len(settled) <= REPAIRABLE_MAX and now - first[2] <= REPAIRABLE_S:
                break
            settled.popitem(last=False)

    def settled_lately(self, key: str) -> bool:
        """Did this processor settle, cancel or return the record ``key`` in the last
        ``REPAIRABLE_S``?"""
        return key in self._settled

    async def repair_settlement(self, key: str) -> bool:
        """Send again the settlement of ``key`` this processor made lately, exactly as made
        (it found the record open again: a Redis failover lost the settlement its master had
        acknowledged). True when it settled the record now; False when it was settled
        already, or was not settled here lately. Idempotent like every settlement."""
        made = self._settled.get(key)
        if made is None:
            return False
        token_counters, head, _ = made
        reply = await self._send_settle("settle", key, token_counters, head)
        return bool(reply[0] in (0, _LOST_RECORD))

    def _settle_request(
        self, reservation_key: str, token_counters: tuple[Counter, ...], head: list[Any], now_s: int
    ) -> tuple[list[str], list[Any]]:
        """settle.lua's KEYS and ARGV for the windows current at ``now_s``; the open set is
        that of the owner in ``head`` (this processor's, or a dead one's for an orphan)."""
        tenant = keynames.tenant_part(reservation_key)
        keys = [reservation_key]
        args = head[:7]
        for c in token_counters:
            counter_key, shape, a, b = windows.script_window(c, now_s)
            keys.append(counter_key)
            args += (shape, a, b, *c.weights)
        args += head[7:]  # return mode: the request counters among them
        owner = self._owner_part if head[3] == self.owner_id else keynames.encode_name(head[3])
        keys += (tenant + ":open", tenant + ":usage", tenant + ":own:" + owner)
        return keys, args

    async def _settle_retry(
        self,
        operation: str,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        head: list[Any],
        reply: Any,
    ) -> Any:
        """Send settle.lua again after a "wrong window" reply, with the server's time."""
        for _ in range(WINDOW_RETRIES):
            self.window_retries += 1
            self.learn_clock(reply[2], reply[3])
            keys, args = self._settle_request(reservation_key, token_counters, head, int(reply[2]))
            reply = await self._call(operation, self._scripts.run_script(self._settle, keys, args))
            if reply[0] != 4:
                return reply
        now = self.learn_clock(reply[2], reply[3])
        raise WrongWindow(f"quota {operation}: window keys kept missing the server's {now}")

    async def _send_settle(
        self,
        operation: str,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        head: list[Any],
    ) -> Any:
        """settle.lua with ``head``, for the windows current now (again with the server's
        time after a "wrong window" reply)."""
        now_s = math.floor(time.time() + self.clock_offset_s)
        keys, args = self._settle_request(reservation_key, token_counters, head, now_s)
        reply = await self._call(operation, self._scripts.run_script(self._settle, keys, args))
        if reply[0] == 4:
            reply = await self._settle_retry(
                operation, reservation_key, token_counters, head, reply
            )
        return reply

    async def cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        windows.check_cancel(tombstone_ttl_s, token_counters)
        head = [0, _MODE_CANCEL, tombstone_ttl_s, self.owner_id, "cancelled", -1, 0]
        reply = await self._send_settle("cancel", reservation_key, token_counters, head)
        self._remember(reservation_key, token_counters, head)  # a failover may lose it too
        return _settlement(reply[0], reply[1])

    async def settle_orphan(
        self, reservation_key: str, owner_id: str
    ) -> tuple[OrphanStatus, Settlement | None]:
        """Settle a dead processor's open record with ``used`` = its reservation so far.

        Nothing is refunded and nothing more charged: the owner may have delivered up to all
        it had leased, so less would under-charge. Idempotent: a record already settled (by
        its owner before it died, or by another peer) is left alone. Only ``owner_id``'s
        admitted record is touched; one script on the tenant's slot, no counter keys. Its
        ledger entry says ``orphaned``. Whatever the status, the key leaves ``owner_id``'s
        open set.
        """
        if not owner_id:
            raise ValueError("owner_id must be non-empty")
        head = [0, _MODE_ORPHAN, RECORD_TTL_S, owner_id, "orphaned", -1, 0]
        code, summary = (await self._send_settle("settle_orphan", reservation_key, (), head))[:2]
        status = _ORPHAN_STATUS[int(code)]
        if status in ("settled", "already_settled"):
            return status, _settlement(int(code), summary)
        return status, None

    # -- admission blocks (base.py): admit.lua's take and from modes, settle.lua's return --

    async def _admit_mode(
        self, operation: str, request: AdmitRequest, tail: list[Any], block_key: str | None
    ) -> tuple[Any, float]:
        """admit.lua in mode ``tail[0]`` (``admit`` itself stays inlined, its hot path)."""
        counters = request.request_counters + request.token_counters
        tags = request.usage or _NO_TAGS
        key = request.reservation_key
        tenant = keynames.tenant_part(key)
        if block_key is not None and keynames.tenant_part(block_key) != tenant:
            raise ValueError(f"block {block_key!r} is not in the tenant of {key!r}")
        owned_key = tenant + self._owned_suffix
        registrations = self.registrations
        if registrations is not None and not registrations.fresh(owned_key):
            await registrations.ensure(owned_key)  # before the charge a peer must find
        take = tail[0] == "take"
        now_s = self.server_now_s()
        for attempt in range(WINDOW_RETRIES + 1):
            keys = [key]
            args: list[Any] = [
                len(request.request_counters),
                len(request.token_counters),
                request.tokens,
                0 if take or not request.count_refused_attempts else 1,
                request.record_ttl_s,
                self.owner_id,
                0 if take or not request.soft_refusal else 1,
                tags.plan,
                tags.model,
                tags.client_request_id,
                tags.prompt_tokens,
            ]
            for c in counters:
                counter_key, shape, a, b = windows.script_window(c, now_s)
                keys.append(counter_key)
                args += (c.kind, c.limit, shape, a, b, c.weights[0], c.weights[1])
                # A take refuses on a shadow counter too: never a block past a shadow limit.
                args.append(1 if c.shadow and not take else 0)
            keys += (tenant + ":open", owned_key)
            if block_key is not None:
                keys.append(block_key)
            args += tail
            call = self._scripts.run_script(self._admit, keys, args)
            reply = await self._call(operation, call)
            now = self.learn_clock(reply[2], reply[3])
            if not reply[6]:
                return reply, now
            self.window_retries += 1
            now_s = int(reply[2])
            if attempt == WINDOW_RETRIES:
                break
        raise WrongWindow(f"quota {operation}: window keys kept missing the server's clock")

    async def take_block(self, request: AdmitRequest, requests: int) -> Block:
        """Charge an admission block (base.py) on ``request.reservation_key``."""
        windows.check_block(request, requests)
        reply, now = await self._admit_mode("take_block", request, ["take", requests], None)
        replayed, verdict, reply_s, reply_us, cancelled = reply[:5]
        parsed = _parse_verdict(verdict, now, replayed=bool(replayed), cancelled=bool(cancelled))
        return windows.block_of(request, requests, parsed, int(reply_s), int(reply_us))

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict:
        """Move ``request``'s share out of the block into its own record, or admit it."""
        windows.check_admit(request)
        reply, now = await self._admit_mode("admit_from_block", request, ["from"], block_key)
        replayed, verdict, _, _, cancelled, retry_soon = reply[:6]
        if retry_soon:
            return Verdict(admitted=False, retry_soon=True)
        parsed = _parse_verdict(verdict, now, replayed=bool(replayed), cancelled=bool(cancelled))
        if len(reply) > 7 and int(reply[7]):
            return dataclasses.replace(parsed, from_block=True)
        return parsed

    async def return_block(
        self,
        block_key: str,
        request_counters: tuple[Counter, ...],
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement:
        """Settle the block with used = 0, its unused request slots given back too."""
        windows.check_cancel(tombstone_ttl_s, request_counters)
        windows.check_counters(token_counters)
        counters = token_counters + request_counters
        head = [0, _MODE_RETURN, tombstone_ttl_s, self.owner_id, "returned", -1, 0,
                len(request_counters)]  # fmt: skip
        keys, args = self._settle_request(block_key, counters, head, self.server_now_s())
        reply = await self._call("return_block", self._scripts.run_script(self._settle, keys, args))
        if reply[0] == 4:
            reply = await self._settle_retry("return_block", block_key, counters, head, reply)
        self._remember(block_key, counters, head)  # a failover may lose it too
        return _settlement(reply[0], reply[1])

    async def absorb(self, absorption: Absorption) -> bool:
        """absorb.lua: every entry is charged to its counter's current window on the server
        (the only live one), whose key is passed; a wrong guess of the server's clock is
        retried. Its ledger entry names those windows."""
        now_s = self.server_now_s()
        usage, ledger = absorption.usage, self.ledger
        on = usage is not None and ledger.enabled
        fields = ("", "", "", "completed", 0, 0, "") if usage is None else (
            usage.plan, usage.model, usage.client_request_id, usage.reason,
            usage.prompt_tokens, usage.output_tokens, usage.admitted_at_us,
        )  # fmt: skip
        for _ in range(WINDOW_RETRIES + 1):
            keys = [absorption.key]
            args: list[Any] = [RECORD_TTL_S, windows.EXPIRY_MARGIN_S, 1 if on else 0,
                               ledger.max_len, ledger.retention_s * 1000, *fields]  # fmt: skip
            for prefix, window_s, start, amount in absorption.entries:
                current = windows.window_start(now_s, window_s)
                keys.append(window_key(prefix, current))
                args += (window_s, current, start, amount)
            keys.append(usage_stream_key(absorption.key))
            call = self._scripts.run_script(self._absorb, keys, args)
            reply = await self._call("absorb", call)
            if int(reply[0]) != 2:
                return int(reply[0]) == 0
            self.window_retries += 1
            now_s = int(self.learn_clock(reply[2], reply[3]))
        raise WrongWindow("quota absorb: window keys kept missing the server's clock")

    async def flush(self, timeout_s: float) -> bool:
        """Nothing is held back here (the resilient wrapper queues what Redis can't take)."""
        return True

    async def check(self) -> None:
        """PING, raising why it failed: ``QuotaMisconfigured`` when Redis refuses the
        credentials or the command (the processor's start says so), else ``QuotaUnavailable``."""
        if await self._call("ping", self._scripts.execute("PING")) != "PONG":
            raise QuotaUnavailable("quota ping: Redis did not answer PONG")

    async def ping(self) -> bool:
        try:
            await self.check()
        except QuotaUnavailable:
            return False
        return True

    async def close(self) -> None:
        await self._scripts.close()
        await self._client.aclose()
