"""Processor crashes: the open reservations of a dead processor, settled by its peers.

What a crash costs. A processor that is SIGKILLed (or loses its host) mid-stream takes the
streams it was metering with it: Envoy closes each client's connection mid-body. Every
reservation it held open keeps its whole charge, prompt + the output reserved so far,
because nobody knows any more how much of it was delivered:

* a leased stream had forwarded tokens plus the lease in hand, which the lease-ahead rule
  (``extproc.admission.lease``) keeps within one batch of the one being delivered: at most
  ``1.5 × batch_tokens`` not yet forwarded (48 tokens at the default batch of 32);
* a request reserved whole (not streamed, ``reserve_max``) had prompt + ``max_tokens × n``.

So a crash over-charges each open request by at most what it had reserved and not yet
delivered, and never under-charges it (the client got no token that was not leased). That
over-charge stays in the windows it was charged to, as any charge does. RPM keeps the
attempt, as for every request.

Every open record is found. The admission script that charges a request also adds its
record to the owner's open set in the tenant's own slot (``<prefix>:{<t>}:own:<p>``,
``admit.lua``), and settling takes it out (``settle.lua``): there is no moment at which a
charge exists that a peer could not find, and it works on a Redis Cluster (one slot per
script). A peer finds the open sets of a dead processor through the processor's index
(``<prefix>:{~p}:regs:<p>``, the open sets it has written to), which the processor fills
*before* its first admission in each tenant (``Registrations.ensure``: one round trip per
new tenant, then a set lookup per admission) — no scan of the keyspace, on any topology.

The bound. Once its heartbeat (``heartbeat_ttl_s``, 30 s) has expired, a live peer's next
sweep (every ``orphan_sweep_s``, 10 s, ±20 %) settles every open record of the dead
processor with ``used`` = what was reserved (nothing refunded, nothing more charged; the
record is finalised, lives ``SETTLED_TTL_S`` more, gets a ledger entry ``orphaned`` and
counts in ``extproc_orphan_settlements_total`` of the peer that settled it). So within
``heartbeat_ttl_s + 1.2 × orphan_sweep_s`` of the kill (42 s by default; 2.6 s with the
2 s TTL and 0.5 s sweep of tests/gateway/test_crash_books.py), plus one more sweep per
``SWEEP_MAX_PER_PASS`` records. A sweeper sweeps only once its own beats have gone through
for a whole TTL (a peer started with the dead one waits that long once).

A dead processor's records are billed as charged. Its peer knows only the record: what was
reserved. That is also what a settlement still waiting in the dead processor's local queue
(Redis was away, ``extproc.quota.resilience``) leaves behind: the record stays open in Redis,
so a peer settles it at what it reserved, never at nothing — including an admission whose
reply was lost and whose queued cancel died with the processor. What the processor served
from its fail-open allowance and had not yet absorbed into Redis is lost with it (at most
its allowance: those tokens were never in Redis).

A processor that is alive but cannot reach Redis for longer than ``heartbeat_ttl_s`` (or
whose event loop stalls that long) looks dead too: peers settle its open records, its
streams end at their next lease (it grants 0 on a settled record), and its own settlements
find them settled (never less than reserved is charged). It counts
``extproc_heartbeat_lapses_total`` when its next beat finds its heartbeat gone, and lists
all its open sets again.

Background, per processor:

* every ``beat_interval`` (≤ TTL/4, at most 2 s) ``beat.lua`` refreshes the heartbeat
  (``{~p}:hb:<p>``), lists the processor in ``{~p}:procs`` and adds the open sets not yet
  in its index; every open set again once per TTL, or after a lapse (a failover that lost a
  write, or a peer that took it for dead, is repaired within a TTL);
* every ``orphan_sweep_s`` (±20 %) a sweep reads ``{~p}:procs``, checks the other
  processors' heartbeats in one pipeline and, for each dead one, walks its index: reads a
  batch of each open set, checks the heartbeat again (after the read: every record listed
  was admitted while that heartbeat lived), settles the batch (``settle_orphan``: one
  script on the tenant's slot, idempotent, owner checked; it takes the key out of the set),
  at most ``SWEEP_MAX_PER_PASS`` records per pass; then ``forget.lua`` drops the open sets
  found empty from the index and, once it is empty, the processor from ``{~p}:procs`` —
  only while the heartbeat is missing, so a processor that comes back keeps its index.

A settlement a failover lost. A master that acknowledged a settlement can die before its
replica has it (replication is asynchronous): the replica takes over with the record open.
The Redis backend remembers its settlements of the last ``REPAIRABLE_S``, and each sweep
looks in this processor's own open sets for one of them and sends it again as it was
(``repair_own``): one ledger entry, the request's own bill.

Exactly once. Settling checks the record's settled flag in the script: the owner and a
peer (or two peers) settling the same record concurrently make one settlement and one
ledger entry; the later one is answered "already settled".

On a graceful stop the processor deletes its heartbeat, so peers settle at once whatever a
timed-out drain left open, and drops from its index the open sets it left empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol, cast

import structlog
from redis.exceptions import NoScriptError, RedisError

from extproc.quota import keys
from extproc.quota.base import RECORD_TTL_S, QuotaUnavailable, Settlement

if TYPE_CHECKING:
    from typing import TypeAlias

    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    from extproc.metrics import Metrics

    # The Redis backend's redis-py client: a (Sentinel-managed) master, or a cluster.
    RedisClient: TypeAlias = aioredis.Redis | RedisCluster

log = structlog.get_logger("extproc.orphans")

HEARTBEAT_TTL_S = 30.0  # a processor silent this long is taken for dead
SWEEP_INTERVAL_S = 10.0  # how often each processor looks for dead peers
BEAT_INTERVAL_S = 2.0  # heartbeat + index, one script
SWEEP_JITTER = 0.2  # each pause between sweeps is the interval ± this share
SWEEP_BATCH = 200  # open-set members taken per round of a sweep
SWEEP_MAX_PER_PASS = 2000  # records one sweep pass settles at most (a bounded rate)
SWEEP_CONCURRENCY = 16  # orphan settlements in flight at once
# Attributes a wrapping backend may hold the Redis backend under (see find_orphan_backend).
_WRAPPED = ("inner", "_inner", "backend", "_backend", "primary", "_primary")


def beat_interval(heartbeat_ttl_s: float) -> float:
    """Beats come at least four times per heartbeat TTL: one late beat never looks dead."""
    return min(BEAT_INTERVAL_S, heartbeat_ttl_s / 4)


def settle_bound_s(heartbeat_ttl_s: float, sweep_interval_s: float) -> float:
    """How long after a processor dies a live peer has settled its open records (up to
    ``SWEEP_MAX_PER_PASS`` of them; one more sweep per as many more)."""
    return heartbeat_ttl_s + sweep_interval_s * (1 + SWEEP_JITTER)


def _lua(name: str) -> str:
    return (
        resources.files("extproc.quota.liveness").joinpath("lua", name).read_text(encoding="utf-8")
    )


class LuaScript:
    """EVALSHA, and EVAL on NOSCRIPT (which caches it on that node), on the node of the keys.

    Not redis-py's ``register_script``: on a cluster its NOSCRIPT path loads the script on
    every master, so one master down would stop the heartbeat of the others' slot too.
    """

    def __init__(self, client: RedisClient, script: str) -> None:
        self.client = client
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(self.script, len(keys), *keys, *args)


class Registrations:
    """The tenants' open sets this processor's index lists, and until when that is sure.

    ``fresh`` runs on every admission: a set lookup and a clock read. An open set not
    known yet, or known while the heartbeat may have lapsed (peers may have dropped it from
    the index), goes through ``ensure`` first: one beat that lists it. Should that beat fail
    (the ``{~p}`` slot is unreachable), the admission goes ahead: the next beat lists it,
    and admissions stop waiting for a while (``quiet_s``) rather than each timing out.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        quiet_s: float = 2.0,
        wait_s: float | None = None,
    ) -> None:
        self._clock = clock
        self.quiet_s = quiet_s
        self.wait_s = wait_s  # an admission waits at most this long for its beat
        self.known: set[str] = set()  # listed by a beat that went through
        self.pending: set[str] = set()  # used, and not (surely) listed yet
        # The index holds ``known`` until then: the heartbeat of the last beat lives.
        self.valid_until = -math.inf
        self.full_at = -math.inf  # when every known open set was last sent
        self.send: Callable[[], Awaitable[Any]] | None = None  # the beat (Liveness)
        self._inflight: dict[str, asyncio.Future[Any]] = {}
        self._quiet_until = -math.inf

    def fresh(self, open_set: str) -> bool:
        return open_set in self.known and self._clock() < self.valid_until

    async def ensure(self, open_set: str) -> None:
        """List ``open_set`` in the index before an admission charges into it."""
        self.pending.add(open_set)
        if self.send is None or self._clock() < self._quiet_until:
            return
        beat = self._inflight.get(open_set)
        if beat is None:  # concurrent admissions of one tenant share one beat
            beat = asyncio.ensure_future(self.send())
            self._inflight[open_set] = beat
            beat.add_done_callback(functools.partial(self._done, open_set))
        try:
            async with asyncio.timeout(self.wait_s):
                await asyncio.shield(beat)
        except TimeoutError:  # it goes on; admissions stop waiting for a while
            self._quiet_until = self._clock() + self.quiet_s
        except Exception:
            pass  # logged by _done

    def _done(self, open_set: str, beat: asyncio.Future[Any]) -> None:
        self._inflight.pop(open_set, None)
        if not beat.cancelled() and beat.exception() is not None:
            self._quiet_until = self._clock() + self.quiet_s
            log.warning("registration_failed", open_set=open_set, error=repr(beat.exception()))

    def to_send(self, now: float, ttl_s: float, margin_s: float) -> tuple[list[str], bool]:
        """(open sets the next beat lists, whether that is every one known). All of them when
        the heartbeat may have lapsed by the time the beat lands, and once per TTL."""
        full = now + margin_s >= self.valid_until or now - self.full_at >= ttl_s
        return sorted((self.pending | self.known) if full else self.pending), full

    def sent(self, listed: Iterable[str], full: bool, sent_at: float, ttl_s: float) -> None:
        """A beat sent at ``sent_at`` went through: its heartbeat lives ``ttl_s`` from then."""
        listed = set(listed)
        self.known |= listed
        self.pending -= listed
        self.valid_until = max(self.valid_until, sent_at + ttl_s)
        if full:
            self.full_at = max(self.full_at, sent_at)


class OrphanBackend(Protocol):
    """What the reconciler needs of a backend (``RedisQuotaBackend`` provides it)."""

    owner_id: str
    registrations: Registrations | None

    @property
    def client(self) -> RedisClient: ...

    @property
    def command_timeout_s(self) -> float | None: ...

    async def settle_orphan(
        self, reservation_key: str, owner_id: str
    ) -> tuple[str, Settlement | None]: ...

    def settled_lately(self, key: str) -> bool: ...

    async def repair_settlement(self, key: str) -> bool: ...


def find_orphan_backend(backend: Any) -> OrphanBackend | None:
    """The Redis backend itself, or the one a wrapper (``inner``, ``backend``, …) holds.

    None for the in-memory backend: it dies with its processor, so nothing is orphaned.
    """
    seen: set[int] = set()
    while backend is not None and id(backend) not in seen:
        if hasattr(backend, "settle_orphan") and hasattr(backend, "registrations"):
            found: OrphanBackend = backend  # duck-typed: the two members that tell it apart
            return found
        seen.add(id(backend))
        backend = next(
            (getattr(backend, a) for a in _WRAPPED if getattr(backend, a, None) is not None),
            None,
        )
    return None


class Liveness:
    """This processor's heartbeat and index, and its sweep for dead peers."""

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
        self.beat_interval_s = beat_interval(heartbeat_ttl_s)
        # A beat that lands later than this after it was sent has failed (its timeout).
        self.call_timeout_s = min(call_timeout_s, heartbeat_ttl_s / 2)
        self._client = backend.client
        self._procs = keys.processor_index_key(prefix)
        self._heartbeat = keys.heartbeat_key(self.processor_id, prefix)
        self._registries = keys.registries_key(self.processor_id, prefix)
        self._beat = LuaScript(self._client, _lua("beat.lua"))
        self._forget = LuaScript(self._client, _lua("forget.lua"))
        self._clock = clock
        # An admission waits for its beat no longer than for its own quota call.
        wait_s = min(self.call_timeout_s, backend.command_timeout_s or self.call_timeout_s)
        self.registrations = Registrations(clock, quiet_s=self.beat_interval_s, wait_s=wait_s)
        self.registrations.send = self.beat
        backend.registrations = self.registrations
        self._beats = 0
        # Start of the current run of successful beats (None: the last one failed).
        self._healthy_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def start(self) -> None:
        """Start the beat and sweep tasks on the running loop (idempotent)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.beat_interval_s, self.beat, jitter=False)),
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
            spread = random.uniform(1 - SWEEP_JITTER, 1 + SWEEP_JITTER) if jitter else 1.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s * spread):
                    await self._stopping.wait()

    async def beat(self) -> None:
        """Refresh the heartbeat and list the open sets the index lacks: one script."""
        sent_at = self._clock()
        regs = self.registrations
        listed, full = regs.to_send(sent_at, self.heartbeat_ttl_s, self.call_timeout_s)
        args: list[Any] = [
            self.processor_id,
            max(1, round(self.heartbeat_ttl_s * 1000)),
            # The index outlives the records it lists if nobody sweeps it.
            RECORD_TTL_S + max(1, round(self.heartbeat_ttl_s)),
            *listed,
        ]
        try:
            async with asyncio.timeout(self.call_timeout_s):
                existed = await self._beat(
                    keys=[self._heartbeat, self._procs, self._registries], args=args
                )
        except BaseException:
            self._healthy_since = None
            raise
        regs.sent(listed, full, sent_at, self.heartbeat_ttl_s)
        if self._beats and not existed:
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
        """One pass: settle again this processor's own settlements a failover lost, then
        the open records of processors whose heartbeat is gone.

        Returns how many records of dead processors this pass settled (``already settled``
        ones not counted). Dead processors' records wait until ``may_sweep``.
        """
        await self.repair_own()
        if not self.may_sweep:
            return 0
        # The backend's client decodes replies (``decode_responses``): members are str.
        procs = cast("set[str]", await self._client.smembers(self._procs))
        ids = sorted(procs - {self.processor_id})
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

    async def repair_own(self) -> int:
        """Records in this processor's own open sets that it settled, cancelled or returned
        (a block) lately: a master that acknowledged it died before its replica had it
        (replication is asynchronous), and the replica took over with the record open. Each
        is sent again as it was (``repair_settlement``). Returns how many were settled now."""
        repaired = 0
        for open_set in sorted(self.registrations.known):
            try:
                members = cast("set[str]", await self._client.smembers(open_set))
                for key in sorted(k for k in members if self.backend.settled_lately(k)):
                    if await self.backend.repair_settlement(key):
                        repaired += 1
                        self.metrics.settlements_repaired_total += 1
                        log.warning("settlement_repaired", request_id=key)
            except (QuotaUnavailable, RedisError, OSError) as exc:
                self._skipped(self.processor_id, open_set, exc)
        return repaired

    async def _reconcile(self, pid: str, budget: int) -> tuple[int, int]:
        """Settle a dead processor's open sets, batch by batch: (records settled, keys taken)."""
        heartbeat = keys.heartbeat_key(pid, self.prefix)
        index = keys.registries_key(pid, self.prefix)
        settled = taken = 0
        emptied: list[str] = []
        gate = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def settle(key: str) -> str:
            async with gate:
                status, _ = await self.backend.settle_orphan(key, pid)
                return status

        for open_set in sorted(cast("set[str]", await self._client.smembers(index))):
            try:
                while taken < budget:
                    members = cast(
                        "list[str]",
                        await self._client.srandmember(open_set, min(SWEEP_BATCH, budget - taken)),
                    )
                    if not members:
                        emptied.append(open_set)  # dropped by forget.lua, if still dead
                        break
                    # Checked after the read: every record read was admitted while that
                    # heartbeat lived, so if it is gone now, its owner is gone.
                    if await self._client.exists(heartbeat):
                        return settled, taken
                    statuses = await asyncio.gather(*(settle(k) for k in members))
                    now_settled = statuses.count("settled")
                    settled += now_settled
                    self.metrics.orphan_settlements_total += now_settled
                    taken += len(members)
            except (QuotaUnavailable, RedisError, OSError) as exc:
                # That tenant's master is away: the others' records are settled all the same.
                self._skipped(pid, open_set, exc)
        await self._forget(keys=[heartbeat, self._procs, index], args=[pid, *emptied])
        if settled:
            log.warning("orphans_settled", processor=pid, records=settled)
        return settled, taken

    def _skipped(self, pid: str, open_set: str, exc: BaseException) -> None:
        self.metrics.liveness_errors_total += 1
        log.warning("orphan_set_skipped", processor=pid, open_set=open_set, error=repr(exc))

    async def stop(self) -> None:
        """Stop the tasks; hand what is left open to peers, at once."""
        self._stopping.set()
        self.registrations.send = None
        if self._tasks:
            # A step in flight finishes (each call is bounded); one that does not is cancelled.
            _, late = await asyncio.wait(self._tasks, timeout=self.call_timeout_s * 2)
            for task in late:
                task.cancel()
        self._tasks = []
        try:
            async with asyncio.timeout(self.call_timeout_s * 2):
                await self._client.delete(self._heartbeat)  # peers settle what is still open
                known = sorted(self.registrations.known | self.registrations.pending)
                pipe = self._client.pipeline(transaction=False)
                for open_set in known:
                    pipe.exists(open_set)
                left = await pipe.execute() if known else []
                empty = [s for s, n in zip(known, left, strict=True) if not n]
                await self._forget(
                    keys=[self._heartbeat, self._procs, self._registries],
                    args=[self.processor_id, *empty],
                )
        except Exception as exc:
            log.warning("liveness_stop_failed", error=repr(exc))


def start_liveness(
    backend: Any,
    metrics: Metrics,
    prefix: str = keys.DEFAULT_PREFIX,
    heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
    sweep_interval_s: float = SWEEP_INTERVAL_S,
) -> Liveness | None:
    """Start heartbeat, index and sweep for a Redis backend; None for memory://."""
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
