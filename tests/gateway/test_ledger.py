"""The usage ledger through the real gateway, under chaos: counters == ledger.

Envoy + processor + simulator with failure injection (disconnects, stalls past the idle
timeout, malformed events, split writes), clients that hang up mid-stream, and a tenant
whose budget cuts streams off. Afterwards, for every token counter window in Redis, its
value is the sum of the net tokens the ledger entries name for that window, and there is
exactly one ledger entry per admitted request, carrying the client's x-request-id.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis

from extproc.quota import keys
from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, tenant_key, write_processor_config

MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
CHAOS_TENANTS = [f"ledger-chaos-{i}" for i in range(4)]
TIGHT = "ledger-tight"
HANGUP = "ledger-hangup"
REQUEST: dict[str, Any] = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 80,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "a ledger entry, please"}],
}
TOKEN_KINDS = {"tpm", "tenant_tpm", "daily"}


@pytest.fixture(scope="module")
def chaos_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    sim = Simulator(
        FAST_PROFILE,
        "--inter-token-latency", "2ms",
        "--ext-disconnect-rate", "25",
        "--ext-stall-rate", "25",
        "--ext-stall-duration", "2s",
        "--ext-malformed-event-rate", "30",
        "--ext-split-writes-rate", "50",
        "--seed", "11",
        log_dir=tmp_path_factory.mktemp("ledger-sim"),
    )  # fmt: skip
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, chaos_simulator: Simulator
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("ledger")
    roomy = {
        "window_s": WINDOW_S,
        "limits": {"*": {"tpm": 1_000_000}},
        "tenant_tpm": 2_000_000,
        "daily_tokens": 5_000_000,
        "batch_tokens": 32,
    }
    # Room for a few answers: the rest are refused or cut off by their next lease.
    tight = {**roomy, "limits": {"*": {"tpm": 260}}, "tenant_tpm": None}
    plans = {name: roomy for name in [*CHAOS_TENANTS, HANGUP]}
    plans[TIGHT] = {k: v for k, v in tight.items() if v is not None}
    config = write_processor_config(
        workdir / "quota.yaml",
        plans,
        redis_url=redis_server.url,
        models=MODELS,
        stream_idle_timeout_s=1,
        refund_wait_ms=0,
    )
    gw = start_gateway(config, workdir, [chaos_simulator.port])
    yield gw
    gw.stop()


async def hang_up_after_first_event(gateway: Gateway, tenant: str, request_id: str) -> None:
    """A client that goes away mid-stream, right after its first event (or at the end of an
    answer without one: an upstream that dies before its headers gets Envoy's own 502, and
    ``Connection: close`` makes Envoy end the connection after it instead of keeping it)."""
    body = orjson.dumps(REQUEST)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.envoy.ports.listen)
    writer.write(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Bearer {tenant_key(tenant)}\r\nx-request-id: {request_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    seen = bytearray()
    try:
        while b"data:" not in seen:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=30)
            if not chunk:
                break
            seen += chunk
    finally:
        writer.close()


def ledger_entries(client: redis.Redis) -> list[dict[str, str]]:
    found = []
    for stream in client.scan_iter(match="tq:{ledger-*}:usage", _type="stream"):
        found.extend(fields for _, fields in client.xrange(stream))
    return found


def token_windows(client: redis.Redis) -> dict[str, int]:
    """Every token counter window of the test's tenants: key -> value."""
    out = {}
    for key in client.scan_iter(match="tq:{ledger-*}:c:*"):
        kind = key.split(":c:", 1)[1].split(":", 1)[0]
        if kind in TOKEN_KINDS:
            out[key] = int(client.get(key) or 0)
    return out


def ledger_windows(entries: list[dict[str, str]]) -> dict[str, int]:
    """Window key -> sum of the net tokens the ledger entries name for it."""
    total: dict[str, int] = defaultdict(int)
    for fields in entries:
        for part in filter(None, fields["windows"].split(";")):
            kind, window_s, start, net = part.split(":")
            model = fields["model"] if kind.removeprefix("shadow_") == "tpm" else None
            prefix = keys.counter_key(fields["tenant"], kind, model, int(window_s))  # type: ignore[arg-type]
            total[keys.window_key(prefix, int(start))] += int(net)
    return dict(total)


def set_chaos(sim: Simulator, rate: float) -> None:
    update = {
        "ext-disconnect-rate": rate,
        "ext-stall-rate": rate,
        "ext-malformed-event-rate": rate,
    }
    request = urllib.request.Request(
        sim.url("/admin/config"),
        data=orjson.dumps(update),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def test_after_chaos_every_counter_window_equals_the_ledger_and_each_admission_has_one_entry(
    gateway: Gateway, redis_client: redis.Redis, chaos_simulator: Simulator
) -> None:
    url = gateway.base_url + "/v1/chat/completions"
    gate = asyncio.Semaphore(6)

    async def one(tenant: str, i: int) -> StreamResult:
        async with gate:
            return await stream_http1(
                url, tenant_key(tenant), REQUEST, headers={"x-request-id": f"{tenant}/{i}"}
            )

    async def hang_up(i: int) -> None:
        async with gate:
            await hang_up_after_first_event(gateway, HANGUP, f"{HANGUP}/{i}")

    async def run_chaos() -> None:
        chaos = [one(t, i) for t in CHAOS_TENANTS for i in range(8)]
        await asyncio.gather(*chaos, *(hang_up(i) for i in range(6)))

    async def run_tight() -> list[StreamResult]:
        # All at once: admission holds prompt + 32 each, 5 fit; their answers (~93 tokens
        # each) cannot all fit in 260, so some streams are cut off and 3 are refused.
        return list(
            await asyncio.gather(
                *(
                    stream_http1(url, tenant_key(TIGHT), REQUEST, {"x-request-id": f"{TIGHT}/{i}"})
                    for i in range(8)
                )
            )
        )

    asyncio.run(run_chaos())
    # The budget cut-offs without injected faults, so they cannot be masked by one.
    set_chaos(chaos_simulator, 0)
    results = asyncio.run(run_tight())
    processor = gateway.processors[0]

    def settled() -> float:
        return processor.metrics().get("extproc_settlements_total", 0)

    admitted = processor.metrics()["extproc_requests_admitted_total"]
    assert wait_until(lambda: settled() >= admitted, timeout_s=30)
    # Every settlement's script has run: the ledger is complete once it has one per admission.
    assert wait_until(lambda: len(ledger_entries(redis_client)) >= admitted, timeout_s=30)

    entries = ledger_entries(redis_client)
    assert len(entries) == admitted
    assert len({(e["tenant"], e["request_id"]) for e in entries}) == len(entries)
    assert ledger_windows(entries) == {k: v for k, v in token_windows(redis_client).items()}

    # The chaos happened and the ledger names it.
    reasons = Tally(e["reason"] for e in entries)
    assert reasons["completed"] > 0, reasons
    assert reasons["cutoff"] > 0, reasons
    assert reasons["timeout"] > 0, reasons
    assert reasons["disconnect"] + reasons["upstream_error"] > 0, reasons
    assert sum(r.status == 429 for r in results) == 3  # refused: no entry
    assert sum(e["tenant"] == TIGHT for e in entries) == 5
    for e in entries:
        assert e["client_request_id"].startswith(e["tenant"] + "/"), e
        assert (e["plan"], e["model"]) == (e["tenant"], "gpt-4.1")
        assert int(e["prompt_tokens"]) + int(e["output_tokens"]) == int(e["used"])
        assert int(e["admitted_at_us"]) <= int(e["settled_at_us"])
