"""Admission leases through the real gateway: a busy tenant is admitted from a block of its
budget without a round trip, and the books stay exact.

Real parts: Envoy, the processor with ``admission_leases`` on, redis-server, the simulator.
Each test checks the invariants, not timings: every token counter window equals the sum of
the ledger's net for it, one ledger entry per admitted request (plus one per block
returned or orphaned), no record left open, and the blocks all returned.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.quota import keys
from loadlab.gateway import Envoy, Gateway, Processor, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.gateway.test_ledger import ledger_windows
from tests.support.quota_views import counter_total, ledger_net

MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
PREFIX = "tq"
BUSY = "blocks-busy"
CROWD = "blocks-crowd"
TIGHT = "blocks-tight"
KILLED = "blocks-killed"
ROLLOUT = "blocks-rollout"
SLIDING = "blocks-sliding"
KILLED_SLIDING = "blocks-killed-sliding"
TENANTS = (BUSY, CROWD, TIGHT, KILLED, ROLLOUT, SLIDING, KILLED_SLIDING)
REQUEST: dict[str, Any] = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 20,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "admitted from a block"}],
}
TOKEN_KINDS = {"tpm", "tenant_tpm", "daily", "shadow_tpm"}
IDLE_MS = 300


def plans() -> dict[str, dict[str, Any]]:
    roomy = {
        "window_s": WINDOW_S,
        "limits": {"*": {"tpm": 200_000, "rpm": 2_000}},
        "tenant_tpm": 400_000,
        "daily_tokens": 5_000_000,
        "batch_tokens": 32,
    }
    # Room for a handful of answers: a quarter of it is less than two requests, so no
    # block is ever taken and every admission is exact.
    tight = {"window_s": WINDOW_S, "limits": {"*": {"tpm": 400}}, "batch_tokens": 32}
    # A limit being rolled out in shadow beside the enforced one (docs/limits.md).
    rollout = {
        "window_s": WINDOW_S,
        "limits": {
            "*": {"tpm": 200_000, "rules": [{"metric": "tokens", "limit": 8_000, "shadow": True}]}
        },
        "batch_tokens": 32,
    }
    # An hour's sliding window, in buckets of a minute (the default, window_s / 60).
    sliding = {
        "window": "sliding",
        "window_s": 3600,
        "limits": {"*": {"tpm": 200_000, "rpm": 2_000}},
        "batch_tokens": 32,
    }
    return {
        BUSY: roomy, CROWD: roomy, KILLED: roomy, TIGHT: tight, ROLLOUT: rollout,
        SLIDING: sliding, KILLED_SLIDING: sliding,
    }  # fmt: skip


def config(path: Path, redis_url: str, **top: Any) -> Path:
    return write_processor_config(
        path,
        plans(),
        redis_url=redis_url,
        models=MODELS,
        refund_wait_ms=0,
        admission_leases={"enabled": True, "fraction": 0.05, "idle_ms": IDLE_MS},
        **top,
    )


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, simulators: list[Simulator]
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("admission-leases")
    gw = start_gateway(
        config(workdir / "quota.yaml", redis_server.url), workdir, [simulators[0].port]
    )
    yield gw
    gw.stop()


def metric(processor: Processor, name: str) -> float:
    return processor.metrics().get(name, 0.0)


def blocks(processor: Processor, result: str) -> float:
    return metric(processor, f'extproc_admission_blocks_total{{result="{result}"}}')


def ledger(client: redis.Redis, tenant: str) -> list[dict[str, str]]:
    stream = keys.usage_stream_key(keys.reservation_key(tenant, "x", PREFIX))
    return [fields for _, fields in client.xrange(stream)]


def token_windows(client: redis.Redis, tenant: str) -> dict[str, int]:
    out = {}
    for key in client.scan_iter(match=f"{keys.tenant_tag(tenant, PREFIX)}:c:*"):
        kind = key.split(":c:", 1)[1].split(":", 1)[0]
        if kind in TOKEN_KINDS:
            out[key] = int(client.get(key) or 0)
    return out


def token_total(client: redis.Redis, tenant: str) -> int:
    """What the tenant's token counters hold in all, fixed windows and sliding hashes."""
    return sum(counter_total(client, tenant, kind) for kind in TOKEN_KINDS)


def bucket_ahead(need_s: float = 20, bucket_s: int = 60) -> None:
    """Wait, if need be, until ``need_s`` of the current sliding bucket lie ahead: a block is
    used until its bucket ends, and none is taken in a bucket's last seconds. (The test's
    redis-server runs on this host: its ``TIME`` is this clock.)"""
    left = bucket_s - time.time() % bucket_s
    if left < need_s:
        time.sleep(left + 0.05)


def open_count(client: redis.Redis, tenant: str) -> int:
    return int(client.get(keys.open_count_key(keys.reservation_key(tenant, "x", PREFIX))) or 0)


def assert_books(client: redis.Redis, tenant: str, requests: set[str]) -> list[dict[str, str]]:
    """Counters == ledger, one entry per admitted request, nothing open; the block entries."""
    entries = ledger(client, tenant)
    by_request = [e for e in entries if not e["request_id"].startswith("~block.")]
    assert sorted(e["client_request_id"] for e in by_request) == sorted(requests)
    windows = token_windows(client, tenant)
    assert windows, "no counter was charged"
    assert windows == {k: v for k, v in ledger_windows(entries).items() if k in windows or v}
    assert open_count(client, tenant) == 0
    return [e for e in entries if e["request_id"].startswith("~block.")]


def assert_sliding_books(
    client: redis.Redis, tenant: str, requests: set[str]
) -> list[dict[str, str]]:
    """``assert_books`` for a tenant on sliding windows: each counter is one hash of buckets,
    and its live buckets' sum is what the ledger's entries net."""
    entries = ledger(client, tenant)
    by_request = [e for e in entries if not e["request_id"].startswith("~block.")]
    assert sorted(e["client_request_id"] for e in by_request) == sorted(requests)
    assert counter_total(client, tenant, "tpm") == ledger_net(entries, "tpm") > 0
    assert open_count(client, tenant) == 0
    return [e for e in entries if e["request_id"].startswith("~block.")]


async def sequential(gateway: Gateway, tenant: str, n: int) -> list[StreamResult]:
    url = gateway.base_url + "/v1/chat/completions"
    return [
        await stream_http1(url, tenant_key(tenant), REQUEST, {"x-request-id": f"{tenant}/{i}"})
        for i in range(n)
    ]


def served_from_blocks(
    gateway: Gateway, client: redis.Redis, tenant: str, n: int = 20
) -> list[dict[str, str]]:
    """``n`` answers one after another, nearly all admitted from blocks, and the books
    balanced once the blocks are back; the blocks' ledger entries."""
    serve_from_blocks(gateway, tenant, n)
    return assert_books(client, tenant, {f"{tenant}/{i}" for i in range(n)})


def serve_from_blocks(gateway: Gateway, tenant: str, n: int) -> None:
    """``n`` answers one after another, nearly all admitted from blocks; then every block
    is back."""
    processor = gateway.processors[0]
    local_before = metric(processor, "extproc_local_admissions_total")
    results = asyncio.run(sequential(gateway, tenant, n))
    assert [r.status for r in results] == [200] * n
    assert all(r.clean_end and r.content for r in results)
    local = metric(processor, "extproc_local_admissions_total") - local_before
    # The first admission goes to Redis and takes the block; the rest come from blocks
    # (a few more may miss while a spent block is being replaced).
    assert local >= n - 5, local
    assert wait_until(lambda: blocks(processor, "returned") == blocks(processor, "taken"), 30)


def test_a_busy_tenant_is_admitted_from_its_block_and_the_books_balance(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    block_entries = served_from_blocks(gateway, redis_client, BUSY)
    assert block_entries and {e["reason"] for e in block_entries} == {"returned"}
    processor = gateway.processors[0]
    assert metric(processor, 'extproc_admission_blocks_total{result="overdrawn"}') == 0


def test_a_tenant_with_a_shadow_rule_is_admitted_from_blocks_and_counted_on_both(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    served_from_blocks(gateway, redis_client, ROLLOUT)
    windows = token_windows(redis_client, ROLLOUT)
    by_kind = {k: sum(v for key, v in windows.items() if f":c:{k}:" in key) for k in TOKEN_KINDS}
    # Both limits count every token; far from its limit, the shadow one reported nothing.
    assert by_kind["shadow_tpm"] == by_kind["tpm"] > 0
    metrics = gateway.processors[0].metrics()
    assert any(f'plan="{ROLLOUT}"' in n for n in metrics)  # its series are labelled so
    reports = [n for n, v in metrics.items() if "shadow_violations" in n and v]
    assert not [n for n in reports if f'plan="{ROLLOUT}"' in n], reports


def test_a_tenant_on_a_sliding_hour_is_admitted_from_blocks_and_the_books_balance(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    # The answers below in one bucket (a bucket's end only sends a few of them to Redis).
    bucket_ahead()
    n = 20
    serve_from_blocks(gateway, SLIDING, n)
    block_entries = assert_sliding_books(
        redis_client, SLIDING, {f"{SLIDING}/{i}" for i in range(n)}
    )
    assert block_entries and {e["reason"] for e in block_entries} == {"returned"}


def test_concurrent_streams_share_a_block_exactly(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    processor = gateway.processors[0]
    url = gateway.base_url + "/v1/chat/completions"

    async def burst(round_: int) -> list[StreamResult]:
        return list(
            await asyncio.gather(
                *(
                    stream_http1(
                        url, tenant_key(CROWD), REQUEST, {"x-request-id": f"{CROWD}/{round_}.{i}"}
                    )
                    for i in range(10)
                )
            )
        )

    async def rounds() -> list[StreamResult]:
        out = []
        for round_ in range(4):
            out += await burst(round_)
        return out

    results = asyncio.run(rounds())
    assert [r.status for r in results] == [200] * 40
    assert wait_until(lambda: blocks(processor, "returned") == blocks(processor, "taken"), 30)
    assert_books(redis_client, CROWD, {f"{CROWD}/{r}.{i}" for r in range(4) for i in range(10)})


def test_near_its_limit_a_tenant_takes_no_block_and_is_refused_exactly(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    processor = gateway.processors[0]
    local_before = metric(processor, "extproc_local_admissions_total")
    taken_before = blocks(processor, "taken")
    results = asyncio.run(sequential(gateway, TIGHT, 24))
    statuses = [r.status for r in results]
    assert 200 in statuses and 429 in statuses, statuses
    assert metric(processor, "extproc_local_admissions_total") == local_before
    assert blocks(processor, "taken") == taken_before
    admitted = {f"{TIGHT}/{i}" for i, r in enumerate(results) if r.status == 200}
    assert assert_books(redis_client, TIGHT, admitted) == []
    assert sum(token_windows(redis_client, TIGHT).values()) <= 400


@pytest.mark.parametrize("tenant", [KILLED, KILLED_SLIDING], ids=["fixed", "sliding"])
def test_a_killed_processor_s_block_is_charged_by_a_peer_never_free(
    tenant: str,
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    simulators: list[Simulator],
) -> None:
    """SIGKILL the processor while it holds a block (idle return far off): a peer's sweep
    settles the block as used, so what the dead processor held stays charged."""
    path = config(tmp_path / "quota.yaml", redis_server.url, heartbeat_ttl_s=2, orphan_sweep_s=0.5)
    doc = path.read_text().replace(f"idle_ms: {IDLE_MS}", "idle_ms: 600000")
    path.write_text(doc)
    assert "idle_ms: 600000" in path.read_text()
    if tenant == KILLED_SLIDING:
        bucket_ahead()  # the block lives on until the kill
    victim = Processor.start(path, tmp_path, redis_server.url)
    envoy = Envoy.start(tmp_path, [victim.port], [simulators[0].port])
    peer: Processor | None = None
    books = assert_sliding_books if tenant == KILLED_SLIDING else assert_books
    try:
        gw = Gateway(envoy, [victim])
        results = asyncio.run(sequential(gw, tenant, 6))
        assert [r.status for r in results] == [200] * 6
        assert metric(victim, "extproc_local_admissions_total") >= 3
        assert blocks(victim, "taken") >= 1 and blocks(victim, "returned") == 0
        # The answers are settled; only the block is open.
        assert wait_until(lambda: open_count(redis_client, tenant) == blocks(victim, "taken"), 10)
        held = token_total(redis_client, tenant)
        victim.process.signal(signal.SIGKILL)
        victim.process.proc.wait(10)
        peer = Processor.start(path, tmp_path, redis_server.url)
        assert wait_until(lambda: open_count(redis_client, tenant) == 0, 30)
        block_entries = books(redis_client, tenant, {f"{tenant}/{i}" for i in range(6)})
        assert block_entries and {e["reason"] for e in block_entries} == {"orphaned"}
        # Nothing of the block came back: the counters hold what they held at the kill.
        assert token_total(redis_client, tenant) == held
    finally:
        envoy.stop()
        victim.stop()
        if peer is not None:
            peer.stop()
