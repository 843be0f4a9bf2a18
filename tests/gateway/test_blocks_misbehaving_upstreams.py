"""Admission blocks against upstreams that misbehave: a request admitted from a block, with
no round trip, is billed as one admitted the exact way, and the books balance.

Real Envoy, a processor with ``admission_leases`` on and redis-server; the upstream is the
scripted one of ``test_upstream_integrity`` (its answers are reused). Each test first makes
the tenant take a block (an honest request admitted the exact way), then sends the
misbehaving answer, checks that this request was admitted from the block, and, once the
block went back: billed >= what the client received, and every token counter window ==
the ledger's net for it, block entries included.
"""

from __future__ import annotations

import asyncio
import gzip
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from loadlab.gateway import Gateway, Processor, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.gateway.test_admission_leases import blocks, bucket_ahead, metric
from tests.gateway.test_upstream_integrity import (
    MESSAGES,
    MODELS,
    PROMPT,
    SSE,
    WORDS,
    content_stream,
    field_stream,
    honest_usage_stream,
    read_until,
)
from tests.support.client_view import delivered
from tests.support.quota_views import counter_total, ledger, ledger_net, live_books
from tests.support.scripted_upstream import Reply, ScriptedUpstream, usage

LIMITS = {"tpm": 1_000_000, "rpm": 10_000}
ROOMY = {"window_s": WINDOW_S, "limits": {"*": LIMITS}}
# A limit being rolled out in shadow beside the enforced one: its blocks are charged on
# both counters, and both must balance with the ledger.
SHADOW_RULE = {"metric": "tokens", "limit": 900_000, "shadow": True}
ROLLOUT = {"window_s": WINDOW_S, "limits": {"*": {**LIMITS, "rules": [SHADOW_RULE]}}}
SHADOWED = {"b-lying-low", "b-above-reservation", "b-error-status", "b-hang-up"}
# An hour's sliding window in minute buckets: its blocks live until their bucket ends.
SLIDING_HOUR = {"window": "sliding", "window_s": 3600, "limits": {"*": LIMITS}}
SLIDING = {"b-gzip", "b-prompt-free", "b-function-call"}
TENANTS = {
    name: ROLLOUT if name in SHADOWED else SLIDING_HOUR if name in SLIDING else ROOMY
    for name in (
        "b-gzip",
        "b-lying-low",
        "b-prompt-free",
        "b-above-reservation",
        "b-function-call",
        "b-error-status",
        "b-hang-up",
    )
}
pytestmark = pytest.mark.slow
ATTEMPTS = 5  # a block returned (idle) before the request came is taken again


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("blocks-upstreams")
    config = write_processor_config(
        workdir / "quota.yaml",
        TENANTS,
        models=MODELS,
        default_model="gpt-4.1",
        redis_url=redis_server.url,
        admission_leases={"enabled": True, "fraction": 0.05, "idle_ms": 1000},
    )
    gw = start_gateway(config, workdir, [upstream.port])
    yield gw
    gw.stop()


def honest(_: Any) -> Reply:
    return Reply(headers=SSE, chunks=content_stream(5, usage(PROMPT, 5)))


def from_a_block(
    gateway: Gateway,
    upstream: ScriptedUpstream,
    tenant: str,
    answer: Callable[[Any], Reply],
    send: Callable[[], bytes],
    model: str = "gpt-4.1",
) -> bytes:
    """What the client received of ``send()``'s request, admitted from a block of the
    tenant's (taken by an honest request for the same model, so on the same counters,
    before it) while the upstream answers ``answer``."""
    processor = gateway.processors[0]
    payload = {"model": model, "messages": MESSAGES, "stream": True}
    url = gateway.base_url + "/v1/chat/completions"
    for _ in range(ATTEMPTS):
        # No block held: the next admission is exact and takes one.
        assert wait_until(lambda: blocks(processor, "returned") == blocks(processor, "taken"), 30)
        if tenant in SLIDING:
            bucket_ahead()  # none is taken in a bucket's last seconds
        taken = blocks(processor, "taken")
        upstream.reply = honest
        warm = asyncio.run(stream_http1(url, tenant_key(tenant), payload, {"x-request-id": "warm"}))
        assert warm.status == 200
        assert wait_until(lambda taken=taken: blocks(processor, "taken") > taken, 30)
        local = metric(processor, "extproc_local_admissions_total")
        upstream.reply = answer
        body = send()
        if metric(processor, "extproc_local_admissions_total") > local:
            return body
    raise AssertionError(f"{tenant}: no request admitted from a block in {ATTEMPTS} tries")


def settled(client: redis.Redis, processor: Processor, tenant: str) -> list[dict[str, str]]:
    """The tenant's request entries not made to take a block, once every block went back
    and the books balance (counters == ledger, block entries included)."""
    assert wait_until(lambda: blocks(processor, "returned") == blocks(processor, "taken"), 30)
    entries = ledger(client, tenant)
    if tenant in SLIDING:  # one hash of buckets: its live buckets' sum is the ledger's net
        assert counter_total(client, tenant, "tpm") == ledger_net(entries, "tpm") > 0
    else:
        for kind in ("tpm", "shadow_tpm") if tenant in SHADOWED else ("tpm",):
            counters, listed = live_books(client, tenant, kind)
            assert counters == listed and counters, kind
    returned = [e for e in entries if e["request_id"].startswith("~block.")]
    assert returned and {e["reason"] for e in returned} == {"returned"}
    assert metric(processor, 'extproc_admission_blocks_total{result="overdrawn"}') == 0
    return [
        e
        for e in entries
        if not e["request_id"].startswith("~block.") and e["client_request_id"] != "warm"
    ]


def post(gateway: Gateway, tenant: str, **payload: Any) -> Callable[[], bytes]:
    body = {"model": "gpt-4.1", "messages": MESSAGES, **payload}

    def send() -> bytes:
        result: StreamResult = asyncio.run(
            stream_http1(gateway.base_url + "/v1/chat/completions", tenant_key(tenant), body)
        )
        return result.body

    return send


def one_bill(entries: list[dict[str, str]], body: bytes) -> tuple[int, int, int, str]:
    """(delivered, billed prompt, billed output, reason) of the one request that came
    from a block (the tries before it, admitted the exact way, are billed too)."""
    entry = entries[-1]
    return (
        delivered(body),
        int(entry["prompt_tokens"]),
        int(entry["output_tokens"]),
        entry["reason"],
    )


def test_undeclared_gzip_from_a_block_is_decoded_and_billed(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    raw = gzip.compress(b"".join(content_stream(180)))
    answer = lambda _: Reply(headers=SSE, chunks=[raw[:7], raw[7:]])  # noqa: E731
    body = from_a_block(gateway, upstream, "b-gzip", answer, post(gateway, "b-gzip", stream=True))
    entries = settled(redis_client, gateway.processors[0], "b-gzip")
    got, prompt, output, _ = one_bill(entries, body)
    assert got == 180 == output and prompt == PROMPT


def test_a_lying_low_usage_from_a_block_is_billed_the_verified_floor(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = lambda _: Reply(headers=SSE, chunks=honest_usage_stream(WORDS, 0.0))  # noqa: E731
    send = post(gateway, "b-lying-low", model="approx", stream=True)
    body = from_a_block(gateway, upstream, "b-lying-low", answer, send, model="approx")
    entries = settled(redis_client, gateway.processors[0], "b-lying-low")
    got, prompt, output, _ = one_bill(entries, body)
    assert output == math.ceil(got * 0.85) and prompt == PROMPT


def test_a_usage_with_a_free_prompt_from_a_block_bills_the_counted_prompt(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = lambda _: Reply(headers=SSE, chunks=content_stream(20, usage(0, 20)))  # noqa: E731
    send = post(gateway, "b-prompt-free", stream=True)
    body = from_a_block(gateway, upstream, "b-prompt-free", answer, send)
    entries = settled(redis_client, gateway.processors[0], "b-prompt-free")
    got, prompt, output, _ = one_bill(entries, body)
    assert prompt == PROMPT and output >= got == 20


def test_a_usage_above_what_a_block_reserved_is_charged_in_full(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # Hidden tokens (a chat template, reasoning): more than the request reserved from the
    # block, prompt and output both. The bill is raised to it and the counters follow.
    report = usage(PROMPT + 700, 900)
    answer = lambda _: Reply(headers=SSE, chunks=content_stream(20, report))  # noqa: E731
    send = post(gateway, "b-above-reservation", stream=True, max_tokens=40)
    body = from_a_block(gateway, upstream, "b-above-reservation", answer, send)
    entries = settled(redis_client, gateway.processors[0], "b-above-reservation")
    got, prompt, output, _ = one_bill(entries, body)
    assert got == 20 and (prompt, output) == (PROMPT + 700, 900)


def test_output_in_a_function_call_from_a_block_is_billed_as_it_streams(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = lambda _: Reply(headers=SSE, chunks=field_stream("function_call", 180))  # noqa: E731
    send = post(gateway, "b-function-call", stream=True)
    body = from_a_block(gateway, upstream, "b-function-call", answer, send)
    entries = settled(redis_client, gateway.processors[0], "b-function-call")
    got, _, output, _ = one_bill(entries, body)
    assert got >= 180 and output == got


def test_an_error_status_stream_from_a_block_is_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = lambda _: Reply(status=500, headers=SSE, chunks=content_stream(180))  # noqa: E731
    send = post(gateway, "b-error-status", stream=True)
    body = from_a_block(gateway, upstream, "b-error-status", answer, send)
    entries = settled(redis_client, gateway.processors[0], "b-error-status")
    got, _, output, reason = one_bill(entries, body)
    assert got == 180 == output and reason == "upstream_error"


def test_a_client_hanging_up_on_a_request_from_a_block_pays_for_what_it_got(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    release = threading.Event()
    answer = lambda _: Reply(  # noqa: E731
        headers=SSE, chunks=content_stream(180), hold_at=61, release=release
    )
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "stream": True}

    def send() -> bytes:
        # The role event and 60 pieces go out; the rest waits until the client has gone.
        return asyncio.run(read_until(gateway, "b-hang-up", payload, lambda b: delivered(b) >= 60))

    try:
        body = from_a_block(gateway, upstream, "b-hang-up", answer, send)
    finally:
        release.set()
    entries = settled(redis_client, gateway.processors[0], "b-hang-up")
    got, _, output, reason = one_bill(entries, body)
    assert output >= got >= 60 and reason == "disconnect"
