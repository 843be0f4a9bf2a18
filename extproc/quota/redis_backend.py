"""Quota backend on Redis: one EVALSHA round trip per admit, reserve and settle.

Each operation is one Lua script (``lua/*.lua``) so that check-and-charge is atomic across
processors and replicas, and windows come from the Redis ``TIME`` of the server that holds
the counters, never from a processor's clock. redis-py's ``Script`` sends EVALSHA and, on
NOSCRIPT (a restarted or failed-over server), loads the script and retries once.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from extproc.quota import windows
from extproc.quota.base import (
    AdmitRequest,
    Counter,
    CounterKind,
    CounterState,
    Grant,
    Settlement,
    Verdict,
)


def _load_lua(name: str) -> str:
    return resources.files("extproc.quota").joinpath("lua", name).read_text(encoding="utf-8")


def _now(now_s: Any, now_us: Any) -> float:
    return int(now_s) + int(now_us) / 1_000_000


def _parse_verdict(verdict: str, now: float, replayed: bool) -> Verdict:
    parts = verdict.split(",")
    states: list[CounterState] = []
    for i in range(2, len(parts), 5):
        kind, limit, window_s, value, start = parts[i : i + 5]
        states.append(
            windows.counter_state(
                kind,  # type: ignore[arg-type]  # written by the script from a CounterKind
                int(limit),
                int(window_s),
                int(value),
                int(start),
                now,
            )
        )
    admitted = parts[0] == "1"
    refused_by: CounterKind | None = None if admitted else parts[1]  # type: ignore[assignment]
    return Verdict(
        admitted=admitted, refused_by=refused_by, states=tuple(states), replayed=replayed
    )


class RedisQuotaBackend:
    """The shared backend for several processor replicas.

    Connects to one Redis server (or a proxy in front of a cluster). Keys are already
    Cluster-ready: every key of a tenant shares one hash tag, so each script touches one slot.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        # The client must decode responses: the scripts reply with text verdicts.
        self._client = client
        self._admit = client.register_script(_load_lua("admit.lua"))
        self._reserve = client.register_script(_load_lua("reserve.lua"))
        self._settle = client.register_script(_load_lua("settle.lua"))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        password: str | None = None,
        username: str | None = None,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        **connection_options: Any,
    ) -> RedisQuotaBackend:
        """Connect lazily to ``redis://`` or ``rediss://`` (TLS) ``[user:password@]host:port/db``.

        ``password``/``username`` override the URL's credentials (keeps secrets out of URLs
        in config files). The pool blocks when all ``max_connections`` are busy instead of
        opening unbounded connections under a burst; hiredis parses replies when installed.
        Extra options (``ssl_ca_certs``, ``ssl_cert_reqs``, ...) go to each connection.
        """
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"not a Redis URL (redis://, rediss://, unix://): {url!r}")
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "socket_keepalive": True,
            **connection_options,
        }
        if password is not None:
            options["password"] = password
        if username is not None:
            options["username"] = username
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **options
        )
        return cls(aioredis.Redis.from_pool(pool))

    async def admit(self, request: AdmitRequest) -> Verdict:
        windows.check_admit(request)
        counters = request.request_counters + request.token_counters
        args: list[Any] = [
            len(request.request_counters),
            len(request.token_counters),
            request.tokens,
            1 if request.count_refused_attempts else 0,
            request.record_ttl_s,
            windows.EXPIRY_MARGIN_S,
        ]
        for counter in counters:
            args += (counter.kind, counter.limit, counter.window_s)
        replayed, verdict, now_s, now_us = await self._admit(
            keys=[request.reservation_key, *(c.key for c in counters)], args=args
        )
        return _parse_verdict(verdict, _now(now_s, now_us), replayed=bool(replayed))

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant:
        windows.check_reserve(seq, amount, minimum, token_counters)
        args: list[Any] = [seq, amount, minimum, windows.EXPIRY_MARGIN_S]
        for counter in token_counters:
            args += (counter.limit, counter.window_s)
        reply = await self._reserve(
            keys=[reservation_key, *(c.key for c in token_counters)], args=args
        )
        status, granted, now_s, now_us = reply[:4]
        if status in ("not_admitted", "settled"):
            return Grant(granted=0)
        now = _now(now_s, now_us)
        states = tuple(
            windows.counter_state(
                c.kind, c.limit, c.window_s, int(reply[4 + 2 * i]), int(reply[5 + 2 * i]), now
            )
            for i, c in enumerate(token_counters)
        )
        return Grant(granted=int(granted), states=states, replayed=status == "replayed")

    async def settle(
        self, reservation_key: str, token_counters: tuple[Counter, ...], used: int
    ) -> Settlement:
        windows.check_settle(used, token_counters)
        args: list[Any] = [used, windows.EXPIRY_MARGIN_S, *(c.window_s for c in token_counters)]
        already, summary = await self._settle(
            keys=[reservation_key, *(c.key for c in token_counters)], args=args
        )
        reserved, used_recorded, *refunds = (int(x) for x in summary.split(","))
        return Settlement(
            reserved=reserved,
            used=used_recorded,
            refunded=refunds[0] if refunds else 0,
            already_settled=bool(already),
            refunded_per_counter=tuple(refunds),
        )

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._client.aclose()
