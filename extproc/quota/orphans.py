"""Processor crashes: the open reservations of a dead processor, reconciled by its peers.

What a crash costs. A processor that is SIGKILLed (or loses its host) mid-stream takes the
streams it was metering with it: Envoy closes each client's connection mid-body. Every
reservation it held open keeps its whole charge, prompt + the output reserved so far,
because nobody knows any more how much of it was delivered:

* a leased stream had forwarded tokens plus the lease in hand, which the lease-ahead rule
  (``extproc.billing.lease``) keeps within one batch of the one being delivered: at most
  ``1.5 × batch_tokens`` not yet forwarded (48 tokens at the default batch of 32);
* a request reserved whole (not streamed, ``reserve_max``) had prompt + ``max_tokens × n``.

Records admitted without token counters (RPM only) hold nothing and are not tracked.

So a crash over-charges each open request by at most what it had reserved and not yet
delivered, and never under-charges it (the client got no token that was not leased). That
over-charge stays in the windows it was charged to, as any charge does: until the minute
(``window_s``) window ends for TPM, until UTC midnight for a daily budget. RPM keeps the
attempt, as for every request.

How long the records last. An open record lives ``RECORD_TTL_S`` (an hour). Each processor
registers the keys it holds open, so that when its heartbeat expires a live peer settles
them with ``used`` = what was reserved (nothing refunded, nothing more charged; the record
is finalised, lives ``SETTLED_TTL_S`` more, and counts in ``extproc_orphan_settlements_total``
of the peer that settled it). That happens within ``heartbeat_ttl_s`` (30 s) + one
``orphan_sweep_s`` (10 s, ±20 %) of the crash: about 40 s by default (3 s with a 3 s TTL
and a 0.5 s sweep in tests/gateway/test_processor_crash.py). Reservations admitted within
the last registration interval (``REGISTER_INTERVAL_S``, 2 s) before the crash, or whose
admission reply was still in flight, are not registered yet: they cost the same budget
(the settlement above refunds nothing either) but their records stay until their hour is
up: ~1 KB each, at most 2 s of that processor's admissions.

A processor that is alive but cannot reach Redis for longer than ``heartbeat_ttl_s`` (or
whose event loop stalls that long) looks dead too: peers settle its open records, its
streams end at their next lease (it grants 0 on a settled record), and its own settlements
find them settled (never less than reserved is charged). It counts
``extproc_heartbeat_lapses_total`` when its next beat finds its heartbeat gone. Its streams
would have failed on their leases anyway while Redis was out of reach.

Design: nothing on the hot path. ``admit.lua`` stores the owner id in the record (one more
ARGV of the same call); the backend notes admitted and settled keys in an in-process set
(``OpenReservations``, a dict operation). In the background, per processor:

* every ``REGISTER_INTERVAL_S`` one pipelined call refreshes the heartbeat
  (``{~p}:hb:<id>``, TTL ``heartbeat_ttl_s``), lists the processor in ``{~p}:procs`` and
  adds the newly opened keys to / removes the settled ones from its owner set
  (``{~p}:own:<id>``); a request admitted and settled between two beats costs nothing;
* every ``orphan_sweep_s`` (±20 % jitter), once its own beats have gone through for a whole
  heartbeat TTL (after a Redis outage every heartbeat may have expired at once: live peers
  get that long to beat again), a sweep reads ``{~p}:procs``, checks the other
  processors' heartbeats in one pipeline and, for each dead one, settles its owner set's
  keys (``settle_orphan``: one script on the tenant's slot, idempotent, owner checked)
  in batches, at most ``SWEEP_MAX_PER_PASS`` records per pass, then drops them from the set
  and, once the set is empty, the processor from ``{~p}:procs``.

Every processor-level key shares the hash tag ``{~p}`` (one slot, so each pipeline goes to
one Redis Cluster node); each quota script still touches only its tenant's slot. On a
graceful stop the processor registers its last settlements and deletes its heartbeat (and,
when nothing is left open, its owner set and its entry in ``{~p}:procs``), so peers settle
at once whatever a timed-out drain left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from extproc.quota import keys
from extproc.quota.base import RECORD_TTL_S, Settlement

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.orphans")

HEARTBEAT_TTL_S = 30.0  # a processor silent this long is taken for dead
SWEEP_INTERVAL_S = 10.0  # how often each processor looks for dead peers
REGISTER_INTERVAL_S = 2.0  # heartbeat + owner-set registration, one pipelined call
SWEEP_BATCH = 200  # owner-set members taken per round of a sweep
SWEEP_MAX_PER_PASS = 2000  # records one sweep pass settles at most (a bounded rate)
SWEEP_CONCURRENCY = 16  # orphan settlements in flight at once
_ARGS_PER_COMMAND = 1000  # keys per SADD/SREM in a registration pipeline
# Attributes a wrapping backend may hold the Redis backend under (see find_orphan_backend).
_WRAPPED = ("inner", "_inner", "backend", "_backend", "primary", "_primary")


def register_interval(heartbeat_ttl_s: float) -> float:
    """Beats come at least four times per heartbeat TTL: one late beat never looks dead."""
    return min(REGISTER_INTERVAL_S, heartbeat_ttl_s / 4)


class OpenReservations:
    """Reservation keys this processor holds open, and what its owner set still lacks.

    ``opened`` and ``closed`` run on the hot path (admit, settle): dict and set operations
    only. ``changes`` / ``applied`` / ``failed`` are the registration task's side.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_age_s: float = RECORD_TTL_S
    ) -> None:
        self._clock = clock
        self._max_age_s = max_age_s
        self._open: dict[str, float] = {}  # key -> when it was opened
        self._registered: set[str] = set()  # open keys the owner set holds
        self._stale: set[str] = set()  # keys the owner set (may) hold that are settled

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, key: object) -> bool:
        return key in self._open

    def opened(self, key: str) -> None:
        self._open.setdefault(key, self._clock())

    def closed(self, key: str) -> None:
        if self._open.pop(key, None) is not None and key in self._registered:
            self._registered.discard(key)
            self._stale.add(key)

    def changes(self) -> tuple[list[str], list[str]]:
        """(keys to add to the owner set, keys to remove from it) as of now.

        A key open longer than a record lives is dropped: its record has expired (its
        settlement kept failing), so there is nothing left to reconcile.
        """
        horizon = self._clock() - self._max_age_s
        for key in [k for k, opened in self._open.items() if opened < horizon]:
            self.closed(key)
        adds = [k for k in self._open if k not in self._registered]
        return adds, list(self._stale)

    def applied(self, adds: Iterable[str], removes: Iterable[str]) -> None:
        """The registration pipeline ran: what it added is registered, what it removed gone."""
        self._stale.difference_update(removes)
        for key in adds:
            if key in self._open:
                self._registered.add(key)
            else:  # settled while its registration was on the wire
                self._stale.add(key)

    def failed(self, adds: Iterable[str]) -> None:
        """The registration pipeline may or may not have run: all is sent again next time,
        and a key settled meanwhile is removed to be safe (SREM of a non-member is a no-op)."""
        for key in adds:
            if key not in self._open:
                self._stale.add(key)


class OrphanBackend(Protocol):
    """What the reconciler needs of a backend (``RedisQuotaBackend`` provides it)."""

    owner_id: str

    @property
    def client(self) -> aioredis.Redis: ...

    def track_open_reservations(self) -> OpenReservations: ...

    async def settle_orphan(
        self, reservation_key: str, owner_id: str
    ) -> tuple[str, Settlement | None]: ...


def find_orphan_backend(backend: Any) -> OrphanBackend | None:
    """The Redis backend itself, or the one a wrapper (``inner``, ``backend``, …) holds.

    None for the in-memory backend: it dies with its processor, so nothing is orphaned.
    """
    seen: set[int] = set()
    while backend is not None and id(backend) not in seen:
        if hasattr(backend, "settle_orphan") and hasattr(backend, "track_open_reservations"):
            return backend  # type: ignore[no-any-return]
        seen.add(id(backend))
        backend = next(
            (getattr(backend, a) for a in _WRAPPED if getattr(backend, a, None) is not None),
            None,
        )
    return None


class Liveness:
    """This processor's heartbeat and registration, and its sweep for dead peers."""

    def __init__(
        self,
        backend: OrphanBackend,
        metrics: Metrics,
        prefix: str = keys.DEFAULT_PREFIX,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
        call_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_ttl_s <= 0 or sweep_interval_s <= 0 or call_timeout_s <= 0:
            raise ValueError("heartbeat_ttl_s, sweep_interval_s and call_timeout_s must be > 0")
        self.backend = backend
        self.metrics = metrics
        self.processor_id = backend.owner_id
        self.prefix = prefix
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.sweep_interval_s = sweep_interval_s
        self.register_interval_s = register_interval(heartbeat_ttl_s)
        self.call_timeout_s = call_timeout_s
        self.open = backend.track_open_reservations()
        self._client = backend.client
        self._index = keys.processor_index_key(prefix)
        self._heartbeat = keys.heartbeat_key(self.processor_id, prefix)
        self._owned = keys.owned_key(self.processor_id, prefix)
        self._clock = clock
        self._beats = 0
        # Start of the current run of successful beats (None: the last one failed).
        self._healthy_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def start(self) -> None:
        """Start the registration and sweep tasks on the running loop (idempotent)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.register_interval_s, self.beat, jitter=False)),
            loop.create_task(self._every(self.sweep_interval_s, self.sweep, jitter=True)),
        ]

    async def _every(self, interval_s: float, step: Callable[[], Any], jitter: bool) -> None:
        # Stopped by ``_stopping``, not only by cancel: on Python 3.11 a cancel that lands in
        # redis-py's ``asyncio.wait_for`` can be swallowed, and the loop would go on forever
        # (the task still counts the request: ``cancelling()``).
        task = asyncio.current_task()
        while not self._stopping.is_set() and not (task is not None and task.cancelling()):
            try:
                async with asyncio.timeout(max(self.call_timeout_s, interval_s) * 4):
                    await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis unreachable: try again next time
                self.metrics.liveness_errors_total += 1
                log.warning("liveness_step_failed", step=step.__name__, error=repr(exc))
            pause = interval_s * (random.uniform(0.8, 1.2) if jitter else 1.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._stopping.wait()

    async def beat(self) -> None:
        """Refresh the heartbeat and register opened / unregister settled keys: one call."""
        adds, removes = self.open.changes()
        pipe = self._client.pipeline(transaction=False)
        pipe.exists(self._heartbeat)
        pipe.set(self._heartbeat, "1", px=max(1, round(self.heartbeat_ttl_s * 1000)))
        pipe.sadd(self._index, self.processor_id)
        for i in range(0, len(adds), _ARGS_PER_COMMAND):
            pipe.sadd(self._owned, *adds[i : i + _ARGS_PER_COMMAND])
        for i in range(0, len(removes), _ARGS_PER_COMMAND):
            pipe.srem(self._owned, *removes[i : i + _ARGS_PER_COMMAND])
        # The set outlives the records it lists (and only those) if nobody sweeps it.
        pipe.expire(self._owned, RECORD_TTL_S + max(1, round(self.heartbeat_ttl_s)))
        try:
            async with asyncio.timeout(self.call_timeout_s):
                replies = await pipe.execute()
        except BaseException:
            self.open.failed(adds)
            self._healthy_since = None
            raise
        self.open.applied(adds, removes)
        if self._beats and not replies[0]:
            # Peers may have taken this processor for dead and settled its open records.
            self.metrics.heartbeat_lapses_total += 1
            log.warning("heartbeat_lapsed", processor=self.processor_id)
            self._healthy_since = None
        if self._healthy_since is None:
            self._healthy_since = self._clock()
        self._beats += 1

    @property
    def may_sweep(self) -> bool:
        """This processor's own beats have gone through for a whole heartbeat TTL.

        After Redis was out of reach (or this processor stalled), every heartbeat may have
        expired at once: a peer is taken for dead only once it has had a full TTL of working
        Redis to beat again, so an outage never makes live processors' streams look orphaned.
        """
        since = self._healthy_since
        return since is not None and self._clock() - since >= self.heartbeat_ttl_s

    async def sweep(self) -> int:
        """One pass: settle the registered records of processors whose heartbeat is gone.

        Returns how many records this pass settled (``already settled`` ones not counted).
        Does nothing until ``may_sweep``.
        """
        if not self.may_sweep:
            return 0
        ids = sorted(set(await self._client.smembers(self._index)) - {self.processor_id})
        if not ids:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for pid in ids:
            pipe.exists(keys.heartbeat_key(pid, self.prefix))
        alive = await pipe.execute()
        settled = 0
        budget = SWEEP_MAX_PER_PASS
        for pid, live in zip(ids, alive, strict=True):
            if live or budget <= 0:
                continue
            count, taken = await self._reconcile(pid, budget)
            settled += count
            budget -= taken
        return settled

    async def _reconcile(self, pid: str, budget: int) -> tuple[int, int]:
        """Settle a dead processor's owner set, batch by batch: (records settled, keys taken)."""
        owned = keys.owned_key(pid, self.prefix)
        heartbeat = keys.heartbeat_key(pid, self.prefix)
        settled = taken = 0
        gate = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def settle(key: str) -> str:
            async with gate:
                status, _ = await self.backend.settle_orphan(key, pid)
                return status

        while taken < budget:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(heartbeat)  # it may have been only slow: never settle a live one
            pipe.srandmember(owned, min(SWEEP_BATCH, budget - taken))
            live, members = await pipe.execute()
            if live:
                break
            if not members:
                # Nothing left: drop it from the index (a live one re-adds itself each beat).
                await self._client.srem(self._index, pid)
                break
            statuses = await asyncio.gather(*(settle(k) for k in members))
            now_settled = statuses.count("settled")
            settled += now_settled
            self.metrics.orphan_settlements_total += now_settled
            await self._client.srem(owned, *members)
            taken += len(members)
        if settled:
            log.warning("orphans_settled", processor=pid, records=settled)
        return settled, taken

    async def stop(self) -> None:
        """Stop the tasks; register the last settlements; hand what is left to peers."""
        self._stopping.set()
        if self._tasks:
            # A step in flight finishes (each call is bounded); one that does not is cancelled.
            _, late = await asyncio.wait(self._tasks, timeout=self.call_timeout_s * 2)
            for task in late:
                task.cancel()
        self._tasks = []
        try:
            await self.beat()
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self._heartbeat)  # peers settle whatever is still open, at once
            if not len(self.open):
                pipe.delete(self._owned)
                pipe.srem(self._index, self.processor_id)
            async with asyncio.timeout(self.call_timeout_s):
                await pipe.execute()
        except Exception as exc:
            log.warning("liveness_stop_failed", error=repr(exc))


def start_liveness(
    backend: Any,
    metrics: Metrics,
    prefix: str = keys.DEFAULT_PREFIX,
    heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
    sweep_interval_s: float = SWEEP_INTERVAL_S,
) -> Liveness | None:
    """Start heartbeat, registration and sweep for a Redis backend; None for memory://."""
    target = find_orphan_backend(backend)
    if target is None:
        return None
    liveness = Liveness(
        target,
        metrics,
        prefix=prefix,
        heartbeat_ttl_s=heartbeat_ttl_s,
        sweep_interval_s=sweep_interval_s,
    )
    liveness.start()
    return liveness
