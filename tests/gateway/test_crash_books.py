"""The books balance after a worker is SIGKILLed under load: counters == ledger, one ledger
entry per admitted request, no record left open.

Real parts: ``serve --workers 2`` behind Envoy (one endpoint, a processor connection per
stream so both workers take streams), redis-server, the simulator at 20 ms per token. 30
streams of ~1.5 s start 40 ms apart; once 12 of them have delivered tokens, worker 0 is
SIGKILLed. Every admitted record is registered in its tenant's slot by the admission itself,
so the live worker's sweep finds and settles the dead one's records (used = reserved) within
the bound ``heartbeat_ttl_s`` + ``orphan_sweep_s`` (+ jitter): the test waits for "0 open
records" with a deadline derived from those settings, then checks the books. The figures
(open records, counter − ledger gap) are printed with ``-s``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
import redis

from extproc.quota import keys
from loadlab.gateway import Envoy, Processor, wait_until
from loadlab.redis_cluster import RedisClusterSet
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, tenant_key, write_processor_config
from tests.gateway.test_cluster_gateway import master_client, one_tenant_per_master
from tests.gateway.test_workers import start_envoy_one_endpoint, start_workers
from tests.support.quota_views import Window, live_books
from tests.support.quota_views import ledger as ledger_of
from tests.support.raw_upstream import RawUpstream
from tests.support.scripted_upstream import chat_stream

pytestmark = pytest.mark.slow

TENANT = "books"
PREFIX = "tq-books"
MODEL = "gpt-4.1"
MODELS = {MODEL: {"tokenizer": "o200k_base", "max_tokens": 4096}}
HEARTBEAT_TTL_S = 2.0
SWEEP_S = 0.5
STREAMS = 30
KILL_AFTER = 12  # streams that have delivered tokens when worker 0 is killed
REQUEST = {
    "model": MODEL,
    "stream": True,
    "max_tokens": 75,  # 1.5 s at 20 ms per token
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "count slowly"}],
}


def settle_deadline_s() -> float:
    """Generous: the bound (TTL + a sweep with its 20 % jitter) many times over, for a
    loaded 2-core machine, plus the time the sweeper needs to trust its own beats."""
    bound = HEARTBEAT_TTL_S + SWEEP_S * 1.2
    return 10 * bound + 30


class Books:
    """What Redis holds for a tenant, accumulated over reads (settled records expire)."""

    def __init__(self, client: redis.Redis, tenant: str = TENANT, prefix: str = PREFIX) -> None:
        self.client = client
        self.tenant, self.prefix = tenant, prefix
        self.admitted: dict[str, dict[str, str]] = {}  # record key -> last fields read

    def read(self) -> None:
        pattern = f"{self.prefix}:{{{self.tenant}}}:r:*"
        for key in self.client.scan_iter(match=pattern, count=1000):
            if key.endswith(":absorb"):
                continue
            fields = self.client.hgetall(key)
            if fields.get("v", "").startswith("1"):
                self.admitted[key] = fields

    def open_records(self) -> list[str]:
        self.read()
        return [k for k, f in self.admitted.items() if "st" not in f]

    def ledger(self) -> list[dict[str, str]]:
        return ledger_of(self.client, self.tenant, self.prefix)

    def windows(self) -> tuple[dict[Window, int], dict[Window, int]]:
        """(counters, ledger) by tpm window, the windows that live through the read."""
        return live_books(self.client, self.tenant, "tpm", self.prefix)

    def balance(self) -> None:
        """counters == ledger, one ledger entry per admitted request, none open."""
        assert self.open_records() == []
        counters, ledger_windows = self.windows()
        assert counters == ledger_windows and counters
        per_request: dict[str, int] = defaultdict(int)
        for entry in self.ledger():
            per_request[entry["request_id"]] += 1
        admitted = {keys.decode_name(k.rpartition(":r:")[2]) for k in self.admitted}
        assert set(per_request) == admitted
        assert all(n == 1 for n in per_request.values()), per_request


def owner_pid(owner: str) -> int:
    found = re.search(r"-(\d+)-[0-9a-f]+$", owner)
    assert found is not None, owner
    return int(found.group(1))


def test_a_sigkilled_workers_records_are_all_settled_and_the_books_balance(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "20ms", log_dir=tmp_path)
    plan = {"window_s": WINDOW_S, "batch_tokens": 16, "limits": {"*": {"tpm": 10_000_000}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", {TENANT: plan}, redis_url=redis_server.url, models=MODELS,
        key_prefix=PREFIX, heartbeat_ttl_s=HEARTBEAT_TTL_S, orphan_sweep_s=SWEEP_S,
    )  # fmt: skip
    workers = start_workers(config, tmp_path)
    envoy = None
    try:
        envoy = start_envoy_one_endpoint(tmp_path, workers.port, [sim.port])
        victim = workers.pids()[0]
        books = Books(redis_client)
        url = envoy.base_url + "/v1/chat/completions"
        state: dict[str, object] = {}

        async def run() -> list[StreamResult]:
            delivered = [asyncio.Event() for _ in range(STREAMS)]
            tasks = []
            for i in range(STREAMS):
                headers = {"x-request-id": f"books-{i}"}
                tasks.append(
                    asyncio.create_task(
                        stream_http1(
                            url, tenant_key(TENANT), REQUEST, headers, first_event=delivered[i]
                        )
                    )
                )
                await asyncio.sleep(0.04)  # spread the admissions, not a synchronisation

            async def kill_after(n: int) -> None:
                while sum(e.is_set() for e in delivered) < n:
                    await asyncio.sleep(0.01)
                os.kill(victim, signal.SIGKILL)
                state["killed_at"] = time.monotonic()
                # What the dead worker left open at once (its peer needs a TTL to notice).
                state["open_at_kill"] = [
                    k
                    for k in await asyncio.to_thread(books.open_records)
                    if owner_pid(books.admitted[k].get("o", "x-0-0")) == victim
                ]

            killer = asyncio.create_task(kill_after(KILL_AFTER))
            results = await asyncio.gather(*tasks)
            await killer
            return results

        results = asyncio.run(run())
        dead_open = list(state["open_at_kill"])  # type: ignore[call-overload]
        assert dead_open, "the killed worker held no open stream: the test proved nothing"
        cut = [r for r in results if not r.done]
        assert cut, "no client stream was cut by the kill"

        deadline = time.monotonic() + settle_deadline_s()
        while time.monotonic() < deadline and books.open_records():
            time.sleep(0.1)
        settled_after = time.monotonic() - float(state["killed_at"])  # type: ignore[arg-type]
        left = books.open_records()
        counters, ledger_windows = books.windows()
        gap = sum(counters.values()) - sum(ledger_windows.values())
        ledger = books.ledger()
        per_request: dict[str, int] = defaultdict(int)
        for entry in ledger:
            per_request[entry["request_id"]] += 1
        admitted_ids = {keys.decode_name(k.rpartition(":r:")[2]) for k in books.admitted}
        print(
            f"\nworker kill: {len(dead_open)} records of the dead worker open at the kill; "
            f"{len(left)} left open {settled_after:.1f}s after it "
            f"(heartbeat_ttl_s={HEARTBEAT_TTL_S}, orphan_sweep_s={SWEEP_S}); "
            f"counter - ledger = {gap} tokens; {len(admitted_ids)} admitted, "
            f"{len(ledger)} ledger entries; {len(cut)} client streams cut"
        )
        assert left == []
        assert counters == ledger_windows and counters
        assert set(per_request) == admitted_ids
        assert all(n == 1 for n in per_request.values()), per_request
        orphaned = [e for e in ledger if e["reason"] == "orphaned"]
        # Only the dead worker's records (a call of its still on the wire at the kill may
        # have run after it: an admission, or a settlement that closed its record itself).
        dead_ids = {
            keys.decode_name(k.rpartition(":r:")[2])
            for k, f in books.admitted.items()
            if owner_pid(f.get("o", "x-0-0")) == victim
        }
        assert orphaned and {e["request_id"] for e in orphaned} <= dead_ids
        # Billed as charged: nothing refunded, used = reserved.
        assert all(e["used"] == e["reserved"] and e["refunded"] == "0" for e in orphaned)
        # Every stream the client saw admitted has its entry (by its x-request-id).
        clients = {e["client_request_id"] for e in ledger}
        assert {f"books-{i}" for i, r in enumerate(results) if r.status == 200} <= clients
    finally:
        if envoy is not None:
            envoy.stop()
        workers.stop()
        sim.stop()


def test_a_settlement_queued_while_redis_was_away_is_settled_by_a_peer_after_a_kill(
    tmp_path: Path,
) -> None:
    """Redis stops mid-stream: the lease fails, the breaker opens (one failure), the meter
    cuts the stream and its settlement waits in the processor's local queue, never sent.
    The processor is SIGKILLed with it, and Redis comes back: the record is still open in
    Redis, in its owner's open set, so the peer settles it, billed as charged."""
    server = RedisServer.start(tmp_path / "redis")
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "20ms", log_dir=tmp_path)
    plan = {"window_s": WINDOW_S, "batch_tokens": 16, "limits": {"*": {"tpm": 10_000_000}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", {TENANT: plan}, redis_url=server.url, models=MODELS,
        key_prefix=PREFIX, heartbeat_ttl_s=HEARTBEAT_TTL_S, orphan_sweep_s=SWEEP_S,
        quota_timeout_ms=300, circuit_breaker={"failures": 1, "probe_interval_ms": 100},
    )  # fmt: skip
    client = redis.Redis(port=server.port, decode_responses=True)
    books = Books(client)
    started: list[Processor | Envoy | Simulator] = [sim]
    try:
        doomed = Processor.start(config, tmp_path)
        started.append(doomed)
        peer = Processor.start(config, tmp_path)
        started.append(peer)
        envoy = Envoy.start(tmp_path, [doomed.port], [sim.port])
        started.append(envoy)
        request = {**REQUEST, "max_tokens": 400}  # 8 s: Redis stops mid-stream

        async def run() -> StreamResult:
            first = asyncio.Event()
            url = envoy.base_url + "/v1/chat/completions"
            task = asyncio.create_task(
                stream_http1(url, tenant_key(TENANT), request, first_event=first)
            )
            await first.wait()  # admitted: at once, before any background beat could run
            os.kill(server.pid, signal.SIGSTOP)
            return await task

        try:
            result = asyncio.run(run())
            # Cut cleanly by the meter (its lease got no answer), settlement queued.
            assert result.error is not None and result.error["code"] == "quota_unavailable"
            assert wait_until(lambda: doomed.metrics()["extproc_quota_queue_depth"] >= 1, 30)
            doomed.process.signal(signal.SIGKILL)
            doomed.process.proc.wait(30)
        finally:
            os.kill(server.pid, signal.SIGCONT)

        # The peer trusts its own beats again after a TTL, then sweeps: the bound from then.
        assert wait_until(lambda: not books.open_records(), timeout_s=settle_deadline_s())
        [entry] = books.ledger()
        [fields] = books.admitted.values()
        assert entry["reason"] == "orphaned"
        assert entry["used"] == entry["reserved"] == fields["res"] and entry["refunded"] == "0"
        counters, ledger_windows = books.windows()
        assert counters == ledger_windows and counters
        assert peer.metrics()["extproc_orphan_settlements_total"] == 1
    finally:
        for part in reversed(started):
            part.stop()
        client.close()
        server.stop()


def test_a_request_whose_processor_dies_before_its_answer_gets_503_and_a_peer_bills_it(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The processor is SIGKILLed while the model server holds its admitted request: the
    client has no response headers yet, so Envoy answers itself (its ext_proc stream broke
    after the processor had answered: ``ext_proc_error_gRPC_error_13{upstream_reset_after_
    response_started…}``, which Envoy cannot retry). It says 503, retry, not 500; the
    admission is billed as charged by the peer."""
    prefix = PREFIX + "-503"
    plan = {"window_s": WINDOW_S, "limits": {"*": {"tpm": 10_000_000}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", {TENANT: plan}, redis_url=redis_server.url, models=MODELS,
        key_prefix=prefix, heartbeat_ttl_s=HEARTBEAT_TTL_S, orphan_sweep_s=SWEEP_S,
    )  # fmt: skip
    started: list[Processor | Envoy] = []
    try:
        doomed = Processor.start(config, tmp_path)
        started.append(doomed)
        peer = Processor.start(config, tmp_path)
        started.append(peer)

        def kill_processor() -> None:
            doomed.process.signal(signal.SIGKILL)
            doomed.process.proc.wait(10)

        async def run() -> StreamResult:
            chunks = chat_stream([" hello"] * 4, None)
            async with RawUpstream(lambda _: chunks, on_request=kill_processor) as upstream:
                envoy = Envoy.start(tmp_path, [doomed.port], [upstream.port])
                started.append(envoy)
                url = envoy.base_url + "/v1/chat/completions"
                headers = {"x-request-id": "held"}
                return await stream_http1(url, tenant_key(TENANT), REQUEST, headers)

        result = asyncio.run(run())
        assert result.status == 503, result.body
        assert result.headers.get("retry-after") == "1"
        assert orjson.loads(result.body)["error"]["code"] == "processor_failed"

        stream = keys.usage_stream_key(keys.reservation_key(TENANT, "x", prefix))
        assert wait_until(lambda: redis_client.xlen(stream) == 1, timeout_s=settle_deadline_s())
        [(_, entry)] = redis_client.xrange(stream)
        assert (entry["client_request_id"], entry["reason"]) == ("held", "orphaned")
        assert entry["used"] == entry["reserved"]  # billed as charged: it cannot know less
    finally:
        for part in reversed(started):
            part.stop()


def test_on_a_redis_cluster_a_killed_processors_records_on_every_master_are_settled(
    tmp_path: Path,
) -> None:
    """Three tenants, one per master of a real 3-master cluster (with replicas): a processor
    SIGKILLed mid-stream leaves records on every master, each in its tenant's open set; the
    peer finds them through the dead processor's index and settles them all."""
    cluster = RedisClusterSet.start(tmp_path / "cluster")
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "20ms", log_dir=tmp_path)
    started: list[Processor | Envoy | Simulator] = [sim]
    try:
        tenants = list(one_tenant_per_master(cluster).values())
        plan = {"window_s": WINDOW_S, "batch_tokens": 16, "limits": {"*": {"tpm": 10_000_000}}}
        config = write_processor_config(
            tmp_path / "quota.yaml", {t: plan for t in tenants}, redis_url=cluster.url,
            models=MODELS, key_prefix=PREFIX, heartbeat_ttl_s=HEARTBEAT_TTL_S,
            orphan_sweep_s=SWEEP_S,
        )  # fmt: skip
        doomed = Processor.start(config, tmp_path)
        started.append(doomed)
        peer = Processor.start(config, tmp_path)
        started.append(peer)
        envoy = Envoy.start(tmp_path, [doomed.port], [sim.port])
        started.append(envoy)
        books = {t: Books(master_client(cluster, t), t, PREFIX) for t in tenants}
        url = envoy.base_url + "/v1/chat/completions"

        async def run() -> list[StreamResult]:
            delivered = [asyncio.Event() for _ in range(3 * len(tenants))]
            tasks = [
                asyncio.create_task(
                    stream_http1(url, tenant_key(tenants[i % 3]), REQUEST, first_event=e)
                )
                for i, e in enumerate(delivered)
            ]
            while not all(e.is_set() for e in delivered):
                await asyncio.sleep(0.01)
            doomed.process.signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert all(not r.done for r in results)  # every stream was cut by the kill
        assert wait_until(
            lambda: not any(b.open_records() for b in books.values()),
            timeout_s=settle_deadline_s(),
        )
        for tenant, book in books.items():
            book.balance()
            assert [e["reason"] for e in book.ledger()] == ["orphaned"] * 3, tenant
        assert peer.metrics()["extproc_orphan_settlements_total"] == 9
    finally:
        for part in reversed(started):
            part.stop()
        cluster.stop()
