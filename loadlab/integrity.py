"""The integrity report of a chaos run: what Redis held over the run, and the invariants.

``Watcher`` reads Redis while the run goes on, because what the checks need does not all
last until the end: a counter window expires two seconds after it ends, a settled
reservation record after two minutes, and a Redis that restarts (persistence off) comes
back empty. It keeps

* every counter window's last value read, and whether a read came after the window ended
  (an ended window is frozen: admissions, leases and refunds only touch the current one),
  so that value is final;
* every reservation record seen (admitted or not, open or settled, owner, admission time);
* every usage-ledger entry seen, by entry id.

Each read is tagged with Redis's ``run_id`` (an "epoch"): a restart is seen as a new one.
``check`` then turns it and the client's records into one row per invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from extproc.quota.keys import DEFAULT_PREFIX, heartbeat_key, is_block_key, reservation_names

# Outcome classes a client can see; the last ones are never well-formed unless a fault
# on the timeline (or the simulator's own disconnects) explains them.
WELL_FORMED = ("complete", "cut_clean", "error_status", "client_disconnect")
EXCUSED = ("reset_by_fault", "reset_by_upstream", "malformed_upstream")
MALFORMED = "malformed"


@dataclass
class Window:
    tenant: str
    window_s: int
    start: int
    value: int = 0
    final: bool = False  # read at least once after the window ended
    epoch: str = ""
    seen_s: float = 0.0  # when a read last found its key


@dataclass
class RecordSeen:
    key: str
    tenant: str
    request_id: str
    admitted: bool
    settled: bool
    owner: str
    admitted_at_s: float
    client_request_id: str
    epoch: str
    fields: dict[str, str] = field(default_factory=dict)


def _no_retry() -> Retry:
    """The watcher reads again on its next tick: redis-py's default (10 retries with
    backoff) stalled every read for seconds on a dead master, and windows of the live
    masters expired meanwhile unread."""
    return Retry(NoBackoff(), 0)


def _tenant_of(key: str) -> str:
    return key[key.index("{") + 1 : key.index("}")]


class Watcher:
    """``cluster_ports``: the nodes of a Redis Cluster (none: the single Redis at
    ``redis_url``); ``cluster_shards``: each shard's nodes in the order to read them now,
    its master first (asked on every read: the chaos faults know who took over a killed
    master's slots, and a killed master started again, empty, is read only after its new
    master). On a cluster every read goes to each shard (a tenant's keys live in its hash
    tag's slot, on one of them) and there is one epoch: a failed-over master's replica
    holds what it held."""

    def __init__(
        self,
        redis_url: str,
        prefix: str = DEFAULT_PREFIX,
        interval_s: float = 0.25,
        cluster_ports: Sequence[int] = (),
        cluster_shards: Callable[[], Sequence[Sequence[int]]] | None = None,
    ):
        self.url = redis_url
        self.prefix = prefix
        self.interval_s = interval_s
        self.cluster_ports = list(cluster_ports)
        self._nodes: dict[int, aioredis.Redis] = {}
        self.windows: dict[tuple[str, int, int], Window] = {}
        self.records: dict[str, RecordSeen] = {}
        self.ledger: dict[tuple[str, str], dict[str, str]] = {}  # (stream, entry id) → fields
        self._ledger_last: dict[tuple[str, str], str] = {}  # (epoch, stream) → last id read
        self.epochs: list[tuple[str, float]] = []  # run_id, first seen (wall clock s)
        self.read_errors = 0
        self.replica_reads = 0  # shards read from a replica: their master was down
        self._shard_order = cluster_shards
        self._shards: list[list[int]] = []  # found by CLUSTER SLOTS (no ``cluster_shards``)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tick = 0
        self._full_started = self._full_done = 0  # full reads begun / last one complete
        self.final_read_s = float("inf")  # when the read after the drain began

    # --- reading -----------------------------------------------------------------------

    def _node(self, port: int, timeout_s: float = 1.0) -> aioredis.Redis:
        if port not in self._nodes:
            self._nodes[port] = aioredis.Redis(
                host="127.0.0.1",
                port=port,
                decode_responses=True,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=_no_retry(),
            )
        return self._nodes[port]

    def _replica(self, port: int) -> aioredis.Redis:
        """One connection to a node of a shard (READONLY is a connection's state: a
        replica then answers reads of its slots; a master ignores it)."""
        key = -port
        if key not in self._nodes:
            self._nodes[key] = aioredis.Redis(
                host="127.0.0.1",
                port=port,
                decode_responses=True,
                socket_timeout=1.0,
                socket_connect_timeout=1.0,
                single_connection_client=True,
                retry=_no_retry(),
            )
        return self._nodes[key]

    async def shards(self) -> list[list[int]]:
        """Each shard's nodes, master first: as ``cluster_shards`` says now, or as the first
        node that answers CLUSTER SLOTS saw them (replicas not yet in sync are left out of
        it). A shard is read from the first of its nodes that answers, so from its replica
        (``READONLY``) while its master is dead and not yet replaced: nodes list a failed
        master's slots under no one for a while, so asking them on every read would skip
        those slots meanwhile."""
        if self._shard_order is not None:
            return [list(nodes) for nodes in self._shard_order()]
        if self._shards:
            return self._shards
        for port in self.cluster_ports:
            try:
                slots = await self._node(port).execute_command("CLUSTER SLOTS")
            except (aioredis.RedisError, OSError):
                continue
            found: dict[int, list[int]] = {}
            for _, _, master, *replicas in slots:
                nodes = found.setdefault(int(master[1]), [])
                nodes += [int(r[1]) for r in replicas if int(r[1]) not in nodes]
            self._shards = [[m, *r] for m, r in sorted(found.items())]
            return self._shards
        raise aioredis.ConnectionError("no cluster node answers")

    async def masters(self) -> list[aioredis.Redis]:
        """Per shard, the first of its nodes that answers (its master, or once that died
        its promoted replica)."""
        out = []
        for nodes in await self.shards():
            for port in nodes:
                try:
                    await self._node(port).ping()
                except (aioredis.RedisError, OSError):
                    continue
                out.append(self._node(port))
                break
        return out

    async def _epoch(self, client: aioredis.Redis) -> str:
        if self.cluster_ports:
            run_id = "cluster"
        else:
            info = await client.info("server")
            run_id = str(info["run_id"])
        if not self.epochs or self.epochs[-1][0] != run_id:
            self.epochs.append((run_id, time.time()))
        return run_id

    def _pipeline(self, client: aioredis.Redis) -> Any:
        """A pipeline takes a connection of its own from the pool: on a cluster it starts
        with READONLY, or a replica answers its reads with MOVED."""
        pipe = client.pipeline(transaction=False)
        if self.cluster_ports:
            pipe.execute_command("READONLY")
        return pipe

    async def _execute(self, pipe: Any) -> list[Any]:
        replies = await pipe.execute()
        return list(replies[1:] if self.cluster_ports else replies)

    async def _counters(self, client: aioredis.Redis, epoch: str) -> None:
        # Before the read: a value is final only if read after its window ended, and on a
        # busy machine the reply can be handled long after Redis sent it.
        now = time.time()
        keys = [k async for k in client.scan_iter(match=f"{self.prefix}:{{*}}:c:tpm:*", count=500)]
        if not keys:
            return
        pipe = self._pipeline(client)
        for k in keys:
            pipe.get(k)  # one GET per key: an MGET must not span slots on a cluster
        values = await self._execute(pipe)
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            parts = key.split(":")
            window_s, start = int(parts[-2]), int(parts[-1])
            w = self.windows.setdefault(
                (key, window_s, start), Window(_tenant_of(key), window_s, start, epoch=epoch)
            )
            if w.epoch != epoch:  # the window's counter was lost with Redis; a new one
                w.epoch, w.final = epoch, False
            w.value = int(value)
            w.final = w.final or now >= start + window_s + 0.05
            w.seen_s = now

    async def _records(self, client: aioredis.Redis, epoch: str) -> None:
        keys = [k async for k in client.scan_iter(match=f"{self.prefix}:{{*}}:r:*", count=1000)]
        todo = [
            k
            for k in keys
            if not k.endswith(":absorb") and (k not in self.records or not self.records[k].settled)
        ]
        pipe = self._pipeline(client)
        for k in todo:
            pipe.hgetall(k)
        for key, fields in zip(todo, await self._execute(pipe), strict=True):
            if not fields:
                continue
            verdict = fields.get("v", "")
            self.records[key] = RecordSeen(
                key=key,
                tenant=_tenant_of(key),
                request_id=reservation_names(key)[1],  # as the ledger spells it
                admitted=verdict.startswith("1"),  # a cancel of one that ran settles it too
                settled="st" in fields,
                owner=fields.get("o", ""),
                admitted_at_s=int(fields.get("at", "0") or 0) / 1e6,
                client_request_id=fields.get("cr", ""),
                epoch=epoch,
                fields=fields,
            )

    async def _ledger(self, client: aioredis.Redis, epoch: str) -> None:
        streams = [k async for k in client.scan_iter(match=f"{self.prefix}:{{*}}:usage")]
        for stream in streams:
            last = self._ledger_last.get((epoch, stream), "-")
            start = "-" if last == "-" else f"({last}"
            while True:
                batch = await client.xrange(stream, start, "+", count=1000)
                if not batch:
                    break
                for entry_id, entry in batch:
                    self.ledger[(f"{epoch}/{stream}", entry_id)] = entry
                last = batch[-1][0]
                start = f"({last}"
            self._ledger_last[(epoch, stream)] = last

    async def _read_one(self, client: aioredis.Redis, epoch: str, everything: bool) -> None:
        await self._counters(client, epoch)
        if everything:
            await self._records(client, epoch)
            await self._ledger(client, epoch)

    async def read(self, client: aioredis.Redis, everything: bool = True) -> bool:
        """One pass over Redis (on a cluster: over every master; one that does not answer,
        failed and not yet replaced, is counted in ``read_errors`` and read next time).
        True: every master was read."""
        epoch = await self._epoch(client)
        if not self.cluster_ports:
            await self._read_one(client, epoch, everything)
            return True
        complete = True
        for nodes in await self.shards():
            for i, port in enumerate(nodes):
                # The master first; while it is down its replica holds what will survive
                # the failover (a window can end and expire meanwhile, never read final).
                node = self._replica(port)
                try:
                    await node.execute_command("READONLY")
                    await self._read_one(node, epoch, everything)
                except (aioredis.RedisError, OSError):
                    self.read_errors += 1
                    continue
                self.replica_reads += int(i > 0)
                break
            else:
                complete = False
        return complete

    async def next_full_read(self, deadline: float) -> bool:
        """Wait for a complete read of everything that began after this call (False: none
        by ``deadline``, monotonic)."""
        target = self._full_started + 1
        while self._full_done < target:
            if time.monotonic() >= deadline or (self._task is not None and self._task.done()):
                return False
            await asyncio.sleep(0.05)
        return True

    def _lose_one_admission(self) -> dict[str, Any]:
        """The ``lost_admission`` test hook: the watcher's copies only, Redis untouched."""
        entries = _ledger_by_request(self)
        for key, r in self.records.items():
            if r.admitted and r.settled and len(entries.get(r.request_id, [])) == 1:
                del self.records[key]
                for entry in self.ledger.values():
                    if entry.get("request_id") == r.request_id:
                        entry["reserved"] = "0"
                return {"tamper": "lost_admission", "request_id": r.request_id}
        return {}

    def _client(self, timeout_s: float) -> Any:
        """A client for single-key calls: the server, or the cluster (it follows MOVED)."""
        if self.cluster_ports:
            nodes = [ClusterNode("127.0.0.1", p) for p in self.cluster_ports]
            return aioredis.RedisCluster(
                startup_nodes=nodes, decode_responses=True, socket_timeout=timeout_s
            )
        return aioredis.from_url(
            self.url, decode_responses=True, socket_timeout=timeout_s, retry=_no_retry()
        )

    async def _scanned(self, client: aioredis.Redis) -> list[aioredis.Redis]:
        return await self.masters() if self.cluster_ports else [client]

    async def _loop(self) -> None:
        client = self._client(1.0)
        try:
            while not self._stop.is_set():
                self._tick += 1
                everything = self._tick % 4 == 0
                if everything:
                    self._full_started += 1
                seq = self._full_started
                try:
                    if await self.read(client, everything) and everything:
                        self._full_done = seq
                except (aioredis.RedisError, OSError):
                    self.read_errors += 1  # paused or down: read again next time
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
        finally:
            await client.aclose()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def close(self) -> None:
        for node in self._nodes.values():
            await node.aclose()
        self._nodes.clear()

    async def final_read(self, tamper: str | None = None) -> dict[str, Any]:
        """The last read, after the load and the drain; ``tamper`` (a test hook) breaks one
        invariant in Redis first: ``counter`` INCRBYs the newest counter window by a
        budget, ``ledger`` deletes a ledger entry (the watcher's copy of it too).
        ``lost_admission`` breaks nothing: it makes one settled request look, to the books,
        as one whose admission a failover lost and its settlement charged (its record never
        read, nothing reserved in its entry)."""
        client = self._client(5.0)
        tampered: dict[str, Any] = {}
        try:
            if tamper == "counter":
                # The newest window seen: live, or expired (then INCRBY writes it again and
                # the read below takes that value as its final one).
                key = max(self.windows, key=lambda k: k[2])[0]
                await client.incrby(key, 100_000)
                tampered = {"tamper": "counter", "key": key, "by": 100_000}
            elif tamper == "ledger":
                # An entry that moved exactly one counter window (not one that straddles a
                # window boundary, nor one that netted 0), a window read after it ended (one
                # never read then is not checked), so the breakage is one mismatch.
                from extproc.quota.keys import decode_name

                verified = {
                    (decode_name(w.tenant), w.window_s, w.start)
                    for w in self.windows.values()
                    if w.final
                }

                def breaks_one(e: dict[str, str]) -> bool:
                    moved = [(ws, st) for ws, st, net in _net(e) if net]
                    return len(moved) == 1 and (e.get("tenant", ""), *moved[0]) in verified

                streams = [
                    k
                    for node in await self._scanned(client)
                    async for k in node.scan_iter(match=f"{self.prefix}:{{*}}:usage")
                ]
                for stream in streams:
                    entry_id = next(
                        (i for i, e in await client.xrange(stream, "-", "+") if breaks_one(e)),
                        None,
                    )
                    if entry_id is not None:
                        await client.xdel(stream, entry_id)
                        self.ledger = {k: v for k, v in self.ledger.items() if k[1] != entry_id}
                        tampered = {"tamper": "ledger", "stream": stream, "id": entry_id}
                        break
            self.final_read_s = time.time()
            await self.read(client)
            if tamper == "lost_admission":
                tampered = self._lose_one_admission()
            live = {
                r.owner
                for r in self.records.values()
                if r.owner and await client.exists(heartbeat_key(r.owner, self.prefix))
            }
            # Records the last scan still holds open (a record can expire while open only
            # after its hour, far beyond a run).
            for r in self.records.values():
                if not r.settled and r.epoch == self.epochs[-1][0]:
                    r.settled = bool(await client.hexists(r.key, "st"))
            return {"live_owners": sorted(live), **tampered}
        finally:
            await client.aclose()
            await self.close()

    def open_records(self) -> list[RecordSeen]:
        epoch = self.epochs[-1][0] if self.epochs else ""
        return [
            r for r in self.records.values() if r.admitted and not r.settled and r.epoch == epoch
        ]


# --- checks ----------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool
    figures: dict[str, Any]
    summary: str

    def to_doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "summary": self.summary,
            "figures": self.figures,
        }


def _ledger_by_request(w: Watcher) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = defaultdict(list)
    for entry in w.ledger.values():
        out[entry.get("request_id", "")].append(entry)
    return out


def _restart_times(w: Watcher) -> list[float]:
    return [t for _, t in w.epochs[1:]]


def check_settled_once(w: Watcher, kills: Sequence[float]) -> tuple[Check, set[str]]:
    """Every admitted request has one ledger entry: none twice, none missing except the
    ones a fault explains (open at a processor's SIGKILL, lost with a Redis restart). An
    entry of a request never seen admitted is an admission a failover lost, charged at its
    settlement (nothing reserved: no record held a reservation), or one served from a
    fail-open allowance while Redis was away (absorbed)."""
    ledger = _ledger_by_request(w)
    admitted = {r.request_id: r for r in w.records.values() if r.admitted}
    lost_admissions = [
        rid
        for rid, es in ledger.items()
        if rid not in admitted and len(es) == 1 and es[0].get("reserved") == "0"
    ]
    duplicates = {rid: len(es) for rid, es in ledger.items() if len(es) > 1}
    last_epoch = w.epochs[-1][0] if w.epochs else ""
    missing, lost_with_redis, open_ids = [], [], []
    for rid, r in admitted.items():
        if rid in ledger:
            continue
        if r.epoch != last_epoch:
            lost_with_redis.append(rid)  # its record and entry went with an empty Redis
        elif not r.settled:
            open_ids.append(rid)  # counted by no_open_reservations
        else:
            missing.append(rid)  # settled, and no entry: a lost or deleted ledger entry
    settled = sum(len(es) for es in ledger.values())
    passed = not duplicates and not missing
    figures = {
        "admitted": len(admitted),
        "ledger_entries": settled,
        "settled_once": sum(1 for rid in admitted if len(ledger.get(rid, [])) == 1),
        "duplicates": len(duplicates),
        "settled_without_entry": len(missing),
        "open": len(open_ids),
        "lost_with_redis_restart": len(lost_with_redis),
        "lost_admissions_charged": len(lost_admissions),
        "examples": {"duplicates": list(duplicates)[:5], "settled_without_entry": missing[:5]},
    }
    summary = (
        f"admitted {len(admitted)}, settled {settled}, duplicates {len(duplicates)}, "
        f"settled without a ledger entry {len(missing)}, lost with Redis {len(lost_with_redis)}"
        + (f", lost admissions charged {len(lost_admissions)}" if lost_admissions else "")
    )
    return Check("settled_exactly_once", passed, figures, summary), set(lost_with_redis)


def block_figures(w: Watcher, live_owners: Sequence[str]) -> dict[str, Any]:
    """The admission blocks taken (``admission_leases``): how many, how many a processor
    that died held, and how each was settled (its ledger entry's reason)."""
    reasons = {e.get("request_id", ""): e.get("reason", "") for e in w.ledger.values()}
    # Admitted ones: a take undone before it ran leaves a tombstone, which held nothing.
    blocks = [r for r in w.records.values() if r.admitted and is_block_key(r.key)]
    dead = [r for r in blocks if r.owner not in live_owners]
    return {
        "seen": len(blocks),
        "of_dead_processors": len(dead),
        "settled_as": dict(sorted(Counter(reasons.get(r.request_id, "") for r in blocks).items())),
        "of_dead_processors_settled_as": dict(
            sorted(Counter(reasons.get(r.request_id, "") for r in dead).items())
        ),
    }


def check_open(w: Watcher, kills: Sequence[float], live_owners: Sequence[str]) -> Check:
    """No reservation left open after the drain, a SIGKILLed processor's included: the
    admission registers each record in its owner's open set in the same atomic step, so a
    live peer settles a dead one's records within the sweep bound (docs/operations.md).
    None is allowed."""
    left = w.open_records()
    dead = [r for r in left if r.owner not in live_owners]
    figures = {
        "open_left": len(left),
        "of_dead_processors": len(dead),
        "allowed": 0,
        "unexplained": [r.key for r in left][:5],
        "reserved_in_open": sum(int(r.fields.get("res", 0) or 0) for r in left),
    }
    return Check(
        "no_open_reservations",
        not left,
        figures,
        f"open left {len(left)} ({len(dead)} of dead processors), allowed 0",
    )


def _net(entry: dict[str, str]) -> list[tuple[int, int, int]]:
    out = []
    for part in (entry.get("windows") or "").split(";"):
        bits = part.split(":")
        # Fixed TPM windows only (a sliding counter's span is "sl<window_s>.<bucket_s>").
        if len(bits) == 4 and bits[0] == "tpm" and bits[1].isdigit():
            out.append((int(bits[1]), int(bits[2]), int(bits[3])))
    return out


def check_counters(
    w: Watcher, excused_ids: set[str], timeout_s: float, kills: Sequence[float]
) -> Check:
    """Per token counter window: its final value == the sum of the ledger's nets for it.
    Windows a fault explains are counted apart: one in which Redis restarted (its counter
    started again from 0), one of a tenant whose request stayed open (a SIGKILL) or was lost
    with Redis, from its admission to that fault."""
    sums: dict[tuple[str, int, int], int] = Counter()
    for entry in w.ledger.values():
        for window_s, start, net in _net(entry):
            sums[(entry.get("tenant", ""), window_s, start)] += net
    restarts = _restart_times(w)
    faults = sorted([*kills, *restarts])

    def until(t: float) -> float:
        return next((f + 0.5 for f in faults if f >= t - 0.5), t + timeout_s)

    excused_spans = [
        (r.tenant, r.admitted_at_s, until(r.admitted_at_s))
        for r in w.records.values()
        if r.request_id in excused_ids or (r.admitted and not r.settled)
    ]
    checked = mismatched = excused = unverified = 0
    last_epoch = w.epochs[-1][0] if w.epochs else ""
    examples = []
    from extproc.quota.keys import decode_name

    for w_ in w.windows.values():
        lo, hi = w_.start, w_.start + w_.window_s
        # The window Redis restarted in (seen up to a read interval late) started from 0.
        if any(lo - 0.5 <= t < hi + 0.5 for t in restarts) or any(
            tenant == w_.tenant and a < hi and b >= lo for tenant, a, b in excused_spans
        ):
            excused += 1
            continue
        if not w_.final and w_.epoch == last_epoch and w_.seen_s >= w.final_read_s:
            # Still live at the end: final too once the drain settled every request. (One
            # whose key expired before any read after its end is left unverified.)
            pass
        elif not w_.final:
            unverified += 1
            continue
        checked += 1
        expected = sums.get((decode_name(w_.tenant), w_.window_s, w_.start), 0)
        if expected != w_.value:
            mismatched += 1
            examples.append(
                {
                    "tenant": decode_name(w_.tenant),
                    "window_start": w_.start,
                    "counter": w_.value,
                    "ledger": expected,
                }
            )
    figures = {
        "windows_checked": checked,
        "mismatches": mismatched,
        "excused_by_faults": excused,
        "unverified": unverified,
        "examples": examples[:5],
    }
    return Check(
        "counters_equal_ledger",
        mismatched == 0 and checked > 0,
        figures,
        f"windows checked {checked}, mismatches {mismatched}, excused by faults {excused}, "
        f"not read final {unverified}",
    )


def _raised_by_upstream(
    w: Watcher, billed: Sequence[tuple[dict[str, str], int]]
) -> dict[tuple[str, int], int]:
    """Per (tenant, window start): tokens an upstream's usage report billed beyond what the
    processor let out (the reservation, or the admitted prompt + the output its client
    received, whichever is more), over ``billed``'s (ledger entry, output delivered) pairs.
    Settlement bills such a report by design (a ``meter`` model's upstream may raise the
    bill, docs/billing.md); tokens delivered beyond the leases are not in it."""
    prompts = {r.request_id: int(r.fields.get("pt", 0) or 0) for r in w.records.values()}
    raised: dict[tuple[str, int], int] = defaultdict(int)
    for entry, delivered in billed:
        let_out = max(
            int(entry.get("reserved", 0) or 0),
            prompts.get(entry.get("request_id", ""), 0) + delivered,
        )
        extra = int(entry.get("used", 0) or 0) - let_out
        if extra > 0:
            for _, start, _ in _net(entry):
                raised[(entry.get("tenant", ""), start)] += extra
    return raised


def _entries_in(w: Watcher, tenant: str, start: int) -> list[dict[str, Any]]:
    """The ledger entries with a net in one window: what a window over its budget is made
    of, kept in the report (Redis is gone after the run)."""
    fields = ("request_id", "reason", "prompt_tokens", "output_tokens", "reserved", "used")
    return [
        {**{k: entry.get(k, "") for k in fields}, "net_here": net}
        for entry in w.ledger.values()
        if entry.get("tenant", "") == tenant
        for _, window_start, net in _net(entry)
        if window_start == start
    ]


def check_budget(w: Watcher, tpm: int, records: Sequence[dict[str, Any]]) -> Check:
    """Tokens charged ≤ the budget in every window of every tenant (the counter is what the
    processor let out: prompt + every lease, plus what an upstream's usage report billed
    beyond that, counted apart), and no request was billed less than what reached its
    client (so delivered ≤ charged ≤ budget)."""
    ratios = [w_.value / tpm for w_ in w.windows.values()]
    by_client_id: dict[str, dict[str, str]] = {}
    for entry in w.ledger.values():
        if entry.get("client_request_id"):
            by_client_id[entry["client_request_id"]] = entry
    # Each answered request's ledger entry, with the output its client received.
    billed = [
        (entry, int(rec["output_tokens"]))
        for rec in records
        if rec["status"] == 200 and (entry := by_client_id.get(rec["request_id"])) is not None
    ]
    raised = _raised_by_upstream(w, billed)
    over = [
        {
            "tenant": w_.tenant,
            "window_start": w_.start,
            "charged": w_.value,
            "entries": _entries_in(w, w_.tenant, w_.start),
        }
        for w_ in w.windows.values()
        if w_.value > tpm + raised.get((w_.tenant, w_.start), 0)
    ]
    underbilled = [
        {
            "request_id": entry["client_request_id"],  # the client's, as the records name it
            "billed_output": int(entry["output_tokens"]),
            "delivered_output": delivered,
        }
        for entry, delivered in billed
        if int(entry.get("output_tokens", 0)) < delivered
    ]
    figures = {
        "budget_per_window": tpm,
        "windows": len(ratios),
        "max_charged_over_budget": round(max(ratios, default=0.0), 4),
        "windows_over_budget": len(over),
        "raised_by_upstream_usage": sum(raised.values()),
        "requests_billed_below_delivered": len(underbilled),
        "examples": (over + underbilled)[:5],
    }
    return Check(
        "tokens_within_budget",
        not over and not underbilled,
        figures,
        f"max charged/budget {figures['max_charged_over_budget']:.3f} over {len(ratios)} "
        f"windows, {len(over)} over; raised by upstream usage {sum(raised.values())}; "
        f"billed below delivered {len(underbilled)}",
    )


def check_outcomes(records: Sequence[dict[str, Any]]) -> Check:
    counts = Counter(r["outcome"] for r in records)
    malformed = counts.get(MALFORMED, 0)
    figures = {
        "requests": len(records),
        "by_class": {k: counts.get(k, 0) for k in (*WELL_FORMED, *EXCUSED, MALFORMED)},
        "examples": [r["request_id"] for r in records if r["outcome"] == MALFORMED][:5],
    }
    by = ", ".join(f"{k} {v}" for k, v in figures["by_class"].items())
    return Check("well_formed_outcomes", malformed == 0 and bool(records), figures, by)


def check_resources(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> Check:
    """Per processor alive at both ends: RSS and open fds. A leak sentinel, not a tight
    bound: fds may grow by a Redis pool's worth (32), RSS at most double."""
    rows = []
    passed = True
    for pid in sorted(set(before) & set(after)):
        b, a = before[pid], after[pid]
        ok = a["fds"] <= b["fds"] + 32 and a["rss_kib"] <= 2 * b["rss_kib"]
        passed = passed and ok
        rows.append({"pid": pid, "before": b, "after": a, "ok": ok})
    summary = "; ".join(
        f"pid {r['pid']}: RSS {r['before']['rss_kib'] // 1024}→{r['after']['rss_kib'] // 1024} "
        f"MiB, fds {r['before']['fds']}→{r['after']['fds']}"
        for r in rows
    )
    return Check(
        "processor_resources",
        passed,  # every processor restarted: nothing to compare, nothing leaked
        {"processors": rows},
        summary or "no processor alive at both ends",
    )
