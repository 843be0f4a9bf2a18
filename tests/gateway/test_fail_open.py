"""Redis outages end to end (issue 9, items 4 and 8): client → Envoy → processor → Redis.

* A fail-open plan keeps serving from its processor's local allowance while Redis is dead;
  a closed plan gets 503 ``quota_unavailable``; the breaker keeps all but its probes off
  the dead Redis; when Redis returns, what was served shows up in its counters, once.
* Streams in flight when Redis stops: a fail-open plan's leases come from the allowance, a
  closed plan's stream is cut with ``quota_unavailable``.
* Streams that end during an outage longer than any retry are settled once Redis returns.

Each test has its own redis-server (killed or paused); every pause is undone by SIGCONT in
a ``finally``, every process stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import orjson
import redis

from loadlab.gateway import Envoy, Processor, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.gateway.test_stream_end_races import MESSAGES, PIECE, PROMPT
from tests.quota.test_resilient import TcpProxy
from tests.support.quota_views import ledger, live_books
from tests.support.raw_upstream import RawUpstream
from tests.support.scripted_upstream import chat_stream

LIMITS = {"*": {"rpm": 100, "tpm": 100_000}}
OPEN = {"window_s": WINDOW_S, "limits": LIMITS, "on_backend_failure": "open"}
CLOSED = {"window_s": WINDOW_S, "limits": LIMITS}
BREAKER = {"failures": 3, "probe_interval_ms": 100}
# Long streams: a model whose limit does not clamp what the scripted upstream sends.
BIG_MODEL = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}


def lost_entries(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    """Entries of settlements whose admission Redis lost: used, with nothing reserved (no
    record held a reservation; absorbed entries reserve what they used)."""
    return [e for e in ledger(client, tenant) if e["reserved"] == "0" and e["used"] != "0"]


def lost_used(client: redis.Redis, tenant: str) -> int:
    """Tokens charged by settlements of admissions Redis lost."""
    return sum(int(e["used"]) for e in lost_entries(client, tenant))


def records(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    return [client.hgetall(k) for k in client.scan_iter(match=f"tq:{{{tenant}}}:r:*")]


def error_code(result: StreamResult) -> str | None:
    """The error code of a JSON error answer or of a closing SSE error event."""
    if result.error is not None:
        return result.error.get("code")
    with contextlib.suppress(orjson.JSONDecodeError):
        return orjson.loads(result.body)["error"]["code"]
    return None


def served(result: StreamResult) -> int:
    usage = result.usage
    assert usage is not None, result.body
    return usage["prompt_tokens"] + usage["completion_tokens"]


def kill(server: RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    server.process.proc.wait(10)


def test_redis_killed_under_load_leaves_fail_open_plans_serving_and_reconciled(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    server = RedisServer.start(tmp_path / "redis")
    port = server.port
    revived: RedisServer | None = None
    proxy = TcpProxy(port).__enter__()  # counts the connections that reach Redis
    tenants = {"open": OPEN, "closed": CLOSED}  # open: 10 RPM, 10 000 TPM locally
    config = write_processor_config(
        tmp_path / "quota.yaml",
        tenants,
        redis_url=f"redis://127.0.0.1:{proxy.port}/0",
        quota_timeout_ms=200,
        circuit_breaker=BREAKER,
    )
    gateway = start_gateway(config, tmp_path, [s.port for s in simulators])
    processor = gateway.processors[0]
    url = gateway.base_url + "/v1/chat/completions"
    payload = {
        "model": "gpt-4.1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 8,  # within what admission reserves: no lease, no cut
        "messages": [{"role": "user", "content": "Say hello"}],
    }
    results: dict[str, list[StreamResult]] = {"open": [], "closed": []}

    async def metrics() -> dict[str, float]:
        return await asyncio.to_thread(processor.metrics)

    async def wait_for(predicate: Any, timeout_s: float = 30) -> None:
        async with asyncio.timeout(timeout_s):
            while not await predicate():
                await asyncio.sleep(0.02)

    async def under_load() -> tuple[dict[str, float], dict[str, float], int]:
        """Three clients per tenant send back to back; Redis is killed among them."""
        stop = asyncio.Event()

        async def client(tenant: str) -> None:
            while not stop.is_set():
                results[tenant].append(await stream_http1(url, tenant_key(tenant), payload))

        load = asyncio.gather(*(client(t) for t in tenants for _ in range(3)))
        try:

            async def served_some() -> bool:
                return min(len(r) for r in results.values()) >= 10

            await wait_for(served_some)
            kill(server)

            async def breaker_open() -> bool:
                return (await metrics())["extproc_quota_breaker_open"] == 1

            await wait_for(breaker_open)
            before, attempts_before = await metrics(), proxy.accepted
            closed_before = len(results["closed"])

            async def outage_served() -> bool:  # the allowance is used up, closed refused
                m = await metrics()
                return (
                    m["extproc_fail_open_refusals_total"] >= 10
                    and len(results["closed"]) - closed_before >= 30
                )

            await wait_for(outage_served)
            after, attempts = await metrics(), proxy.accepted - attempts_before
        finally:
            stop.set()
            await load
        return before, after, attempts

    try:
        before, after, attempts = asyncio.run(under_load())

        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        def by_redis(r: StreamResult) -> bool:  # admitted by Redis: carries its counters
            return "x-ratelimit-limit-requests" in r.headers

        # Closed plan: what Redis admitted before it died, then only 503 quota_unavailable.
        closed_ok = [r for r in results["closed"] if r.status == 200]
        closed_refused = [r for r in results["closed"] if r.status != 200]
        assert all(by_redis(r) and r.done and r.error is None for r in closed_ok)
        assert {(r.status, error_code(r)) for r in closed_refused} == {(503, "quota_unavailable")}
        # Fail-open plan: what Redis admitted, then exactly its local allowance (10 % of
        # 100 RPM), then 503 quota_unavailable.
        local = [r for r in results["open"] if r.status == 200 and not by_redis(r)]
        open_refused = [r for r in results["open"] if r.status != 200]
        assert len(local) == 10
        assert all(r.done and r.error is None for r in results["open"] if r.status == 200)
        assert {(r.status, error_code(r)) for r in open_refused} == {(503, "quota_unavailable")}
        assert after["extproc_fail_open_admissions_total"] == 10
        # While the breaker was open no quota call was sent to Redis, only its probes (one
        # PING each, one reconnection at most). Connections also come from calls that were
        # in flight when it opened (each fails, once), and from the heartbeat at its own
        # fixed rate (each of its calls fails while Redis is dead); one probe and one beat
        # may straddle the snapshots.
        probes = delta("extproc_quota_breaker_probes_total")
        short_circuited = delta("extproc_quota_short_circuited_total")
        assert delta("extproc_quota_backend_calls_total") == 0
        assert short_circuited >= 30
        in_flight = delta("extproc_quota_backend_failures_total")
        beats = delta("extproc_liveness_errors_total")
        assert attempts <= 2 * (probes + in_flight + beats + 2)
        served_open = sum(served(r) for r in local)

        revived = RedisServer.start(tmp_path / "revived", port=port)
        client = redis.Redis(port=port, decode_responses=True)
        try:

            def reconciled() -> bool:
                m = processor.metrics()
                return (
                    m["extproc_quota_breaker_open"] == 0
                    and m["extproc_quota_queue_depth"] == 0
                    and m["extproc_reconciled_reservations_total"] == 10
                )

            assert wait_until(reconciled, timeout_s=30)
            final = processor.metrics()
            assert final["extproc_quota_queue_dropped_total"] == 0  # no queued charge given up
            open_redis = len(results["open"]) - len(local) - len(open_refused)
            print(
                f"outage under load: closed {len(closed_ok)}x200 (Redis) "
                f"{len(closed_refused)}x503; open {open_redis}x200 (Redis) "
                f"{len(local)}x200 (local) {len(open_refused)}x503; while open "
                f"{short_circuited:.0f} calls short-circuited, {probes:.0f} probes, {attempts} "
                f"connections to Redis; reconciled {final['extproc_reconciled_tokens_total']:.0f}"
                f" tokens (clients were served {served_open})"
            )
            # Redis came back empty: its counters hold exactly what was served meanwhile,
            # and what requests Redis had admitted before it died used (their settlements,
            # queued, found no record: each charged in full, its ledger entry with nothing
            # reserved and the plan the settlement sent again). Counters == ledger for both.
            lost = {t: lost_used(client, t) for t in ("open", "closed")}
            assert counter_value(client, "open", "tpm", "gpt-4.1") == served_open + lost["open"]
            assert final["extproc_reconciled_tokens_total"] == served_open
            assert counter_value(client, "closed", "tpm", "gpt-4.1") == lost["closed"]
            for tenant in ("open", "closed"):
                counters, listed = live_books(client, tenant, "tpm")
                assert counters == listed
            lost_ones = [e for t in ("open", "closed") for e in lost_entries(client, t)]
            assert final["extproc_lost_admissions_charged_total"] == len(lost_ones)
            assert all(e["plan"] in ("open", "closed") and e["model"] for e in lost_ones)
            # RPM is absorbed for local admissions Redis never saw (those whose Redis call
            # failed before the breaker opened were cancelled there instead).
            assert 1 <= counter_value(client, "open", "rpm", "gpt-4.1") <= 10
            assert counter_value(client, "closed", "rpm", "gpt-4.1") == 0

            # Service is back on Redis, and the reconciled charges are not counted twice.
            rpm = counter_value(client, "open", "rpm", "gpt-4.1")
            again = asyncio.run(stream_http1(url, tenant_key("open"), payload))
            assert again.status == 200 and by_redis(again)
            expected = served_open + lost["open"] + served(again)
            assert wait_until(
                lambda: counter_value(client, "open", "tpm", "gpt-4.1") == expected, 10
            )
            assert counter_value(client, "open", "rpm", "gpt-4.1") == rpm + 1
            assert processor.metrics()["extproc_reconciled_reservations_total"] == 10
        finally:
            client.close()
    finally:
        gateway.stop()
        proxy.__exit__()
        server.stop()
        if revived is not None:
            revived.stop()


def run_gated(
    tmp_path: Path,
    processor: Processor,
    server: RedisServer,
    streams: list[tuple[str, int]],
) -> list[StreamResult]:
    """Start ``(tenant, pieces)`` streams, pause Redis once each has its first event
    (every admission is done), then let the upstream send the rest. Redis stays paused."""

    async def run() -> list[StreamResult]:
        answer = lambda body: chat_stream([PIECE] * body["max_tokens"], None)  # noqa: E731
        async with RawUpstream(answer, head=5) as upstream:  # role + 4 tokens at once
            envoy = Envoy.start(tmp_path, [processor.port], [upstream.port])
            try:
                url = envoy.base_url + "/v1/chat/completions"
                firsts = [asyncio.Event() for _ in streams]
                tasks = [
                    asyncio.create_task(
                        stream_http1(
                            url,
                            tenant_key(tenant),
                            {"model": "gpt-4.1", "stream": True, "max_tokens": n,
                             "messages": MESSAGES},
                            first_event=first,
                        )
                    )
                    for (tenant, n), first in zip(streams, firsts, strict=True)
                ]  # fmt: skip
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
                os.kill(server.pid, signal.SIGSTOP)
                upstream.gate.set()
                return list(await asyncio.gather(*tasks))
            finally:
                envoy.stop()

    return asyncio.run(run())


def start_processor(tmp_path: Path, server: RedisServer, tenants: dict[str, Any]) -> Processor:
    config = write_processor_config(
        tmp_path / "quota.yaml",
        tenants,
        redis_url=server.url,
        models=BIG_MODEL,
        quota_timeout_ms=500,
        circuit_breaker=BREAKER,
    )
    return Processor.start(config, tmp_path)


def test_streams_in_flight_when_redis_stops_follow_their_plans_policy(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "redis")
    processor = start_processor(tmp_path, server, {"open": OPEN, "closed": CLOSED})
    client = redis.Redis(port=server.port, decode_responses=True)
    try:
        try:
            kept, cut = run_gated(tmp_path, processor, server, [("open", 80), ("closed", 80)])
            # Both streams have ended: their settlements (the closed one's, the open one's
            # Redis part and its absorb) wait in the processor's queue.
            assert wait_until(
                lambda: processor.metrics()["extproc_quota_queued_total"] >= 3, timeout_s=10
            )
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert kept.status == 200 and kept.done and kept.error is None
        assert kept.content.count(PIECE) == 80  # leased from the local allowance
        assert cut.status == 200 and cut.done and error_code(cut) == "quota_unavailable"
        delivered = cut.content.count(PIECE)
        assert 0 < delivered <= 32  # what admission reserved; no lease since

        def settled() -> bool:
            found = records(client, "open") + records(client, "closed")
            metrics = processor.metrics()
            return (
                len(found) == 3  # two reservations and the open one's absorb record
                and all("st" in r for r in found)
                and metrics["extproc_quota_queue_depth"] == 0
            )

        assert wait_until(settled, timeout_s=30)
        metrics = processor.metrics()
        batches = metrics["extproc_fail_open_lease_batches_total"]
        print(
            f"in flight: fail-open stream 80/80 tokens, {batches:.0f} local batches, "
            f"{metrics['extproc_reconciled_tokens_total']:.0f} tokens reconciled; "
            f"closed stream cut after {delivered}"
        )
        assert metrics["extproc_fail_open_lease_batches_total"] >= 1
        assert metrics["extproc_reconciled_reservations_total"] == 1
        assert counter_value(client, "open", "tpm", "gpt-4.1") == PROMPT + 80
        assert counter_value(client, "closed", "tpm", "gpt-4.1") == PROMPT + delivered
        assert counter_value(client, "open", "rpm", "gpt-4.1") == 1
        assert metrics["extproc_settle_errors_total"] == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        processor.stop()
        client.close()
        server.stop()


def test_streams_that_end_during_a_long_outage_are_settled_when_redis_returns(
    tmp_path: Path,
) -> None:
    server = RedisServer.start(tmp_path / "redis")
    processor = start_processor(tmp_path, server, {"late": CLOSED})
    client = redis.Redis(port=server.port, decode_responses=True)
    # Two streams fit in what admission reserved and complete; two need leases and are cut.
    streams = [("late", 20), ("late", 20), ("late", 80), ("late", 80)]
    try:
        try:
            results = run_gated(tmp_path, processor, server, streams)
            # Every settlement failed and waits in the queue: the outage outlasts any retry.
            assert wait_until(
                lambda: processor.metrics()["extproc_quota_queued_total"] >= 4, timeout_s=10
            )
        finally:
            os.kill(server.pid, signal.SIGCONT)
        delivered = [r.content.count(PIECE) for r in results]
        assert delivered[:2] == [20, 20]
        assert all(r.done and r.error is None for r in results[:2])
        assert all(error_code(r) == "quota_unavailable" for r in results[2:])

        def settled() -> bool:
            found = records(client, "late")
            return len(found) == 4 and all("st" in r for r in found)

        assert wait_until(settled, timeout_s=30)
        metrics = processor.metrics()
        print(
            f"long outage: {len(results)} streams ended while Redis was paused, delivered "
            f"{delivered}; queued {metrics['extproc_quota_queued_total']:.0f}, applied "
            f"{metrics['extproc_quota_queue_applied_total']:.0f}"
        )
        assert counter_value(client, "late", "tpm", "gpt-4.1") == 4 * PROMPT + sum(delivered)
        assert metrics["extproc_quota_queue_dropped_total"] == 0
        assert metrics["extproc_settle_errors_total"] == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        processor.stop()
        client.close()
        server.stop()
