"""Chaos from the simulated backend: every stream settles once and counters equal delivery.

The simulator disconnects mid-stream, stalls past the processor's idle timeout, injects a
malformed event and splits events across TCP writes. Whatever happens, each admitted
request is settled exactly once, no reservation stays open, and the tokens charged equal
what each client received (or the upstream's usage when the stream completed).

An upstream that dies while Envoy waits for the processor's answer to the response
headers has sent nothing the client could use: Envoy answers 502 itself. That is a
well-formed outcome, settled like any other (the prompt is charged, no output).

One bound is inherent: when the upstream resets mid-stream, Envoy resets the client at once
and drops the processor's answers to body messages still in flight. Those tokens were
released to Envoy (and are charged) but never reached the client. How many there are
depends on how far the processor lags, so no fixed slack bounds them: the charge of a reset
stream lies between what the client received and what its lease covered, and all the output
charged is output the model generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, http_get, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import (
    FAST_PROFILE,
    WINDOW_S,
    counter_value,
    tenant_key,
    write_processor_config,
)

STREAMS = 30
MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
REQUEST: dict[str, Any] = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 80,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "chaos, please"}],
}


@pytest.fixture(scope="module")
def chaos_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    sim = Simulator(
        FAST_PROFILE,
        "--inter-token-latency", "1ms",
        "--ext-disconnect-rate", "25",
        "--ext-stall-rate", "35",
        "--ext-stall-duration", "2s",
        "--ext-malformed-event-rate", "40",
        "--ext-split-writes-rate", "50",
        "--seed", "7",
        log_dir=tmp_path_factory.mktemp("chaos-sim"),
    )  # fmt: skip
    yield sim
    sim.stop()


def tenant(i: int) -> str:
    """One tenant per stream: its counter and its reservation record are that stream's."""
    return f"chaos-{i}"


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, chaos_simulator: Simulator
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("chaos")
    plan = {
        "window_s": WINDOW_S,
        "limits": {"*": {"tpm": 1_000_000}},
        "charge_mode": "incremental",
        "batch_tokens": 32,
    }
    config = write_processor_config(
        workdir / "quota.yaml",
        {tenant(i): plan for i in range(STREAMS)},
        redis_url=redis_server.url,
        models=MODELS,
        stream_idle_timeout_s=1,
    )
    gw = start_gateway(config, workdir, [chaos_simulator.port])
    yield gw
    gw.stop()


def upstream_reset(result: StreamResult) -> bool:
    """The upstream went away: mid-stream (the client is reset) or before Envoy's headers."""
    return not result.clean_end or result.status == 502


def expected_charge(result: StreamResult, prompt: int) -> tuple[int, int]:
    """(prompt, output) charged: upstream usage for a stream that completed, else our
    prompt count and the output the client received."""
    if result.clean_end and result.done and result.error is None and result.usage:
        return result.usage["prompt_tokens"], result.usage["completion_tokens"]
    return prompt, result.output_tokens()


def settlement(client: redis.Redis, name: str) -> tuple[int, int]:
    """(reserved, committed) of the tenant's one request, from its settled reservation."""
    records = list(client.scan_iter(match=f"tq:{{{name}}}:r:*"))
    assert len(records) == 1, f"{name}: {records}"
    summary = client.hget(records[0], "st")
    assert summary, f"{name}: reservation not settled"
    reserved, used, refunded = (int(x) for x in summary.split(",")[:3])
    assert reserved == used + refunded
    return reserved, used


def generated_tokens(sim: Simulator) -> int:
    _, text = http_get(sim.url("/metrics"))
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total{")
    )


def test_every_chaotic_stream_settles_once_and_counters_equal_delivered_tokens(
    gateway: Gateway, redis_client: redis.Redis, chaos_simulator: Simulator
) -> None:
    url = gateway.base_url + "/v1/chat/completions"
    generated_before = generated_tokens(chaos_simulator)

    # A few streams at a time: a client that lags behind loses received bytes to the RST
    # that follows an upstream reset, and then cannot say what it was sent.
    gate = asyncio.Semaphore(4)

    async def one(i: int) -> StreamResult:
        async with gate:
            return await stream_http1(url, tenant_key(tenant(i)), REQUEST)

    async def run_all() -> list[StreamResult]:
        return list(await asyncio.gather(*(one(i) for i in range(STREAMS))))

    results = asyncio.run(run_all())
    registry = TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}])
    prompt = count_prompt_tokens(REQUEST, registry.counter_for("gpt-4.1"))
    for r in results:
        if r.status == 502:  # Envoy's own answer: complete, an error, and no model output
            assert r.clean_end and b"error" in r.body.lower(), (r.headers, r.body[:300])
            assert not any(isinstance(e, dict) and e.get("choices") for e in r.events)
        else:
            assert r.status == 200, (r.status, r.headers, r.body[:300])
    outcomes = {
        "completed": sum(r.done and r.error is None for r in results),
        "timed_out": sum(bool(r.error) and r.error.get("code") == "timeout" for r in results),
        "reset": sum(upstream_reset(r) for r in results),
    }
    # The chaos really happened: some streams were cut, some stalled past the watchdog.
    assert outcomes["reset"] > 0, outcomes
    assert outcomes["timed_out"] > 0, outcomes
    assert outcomes["completed"] > 0, outcomes

    # Every admitted request settles, exactly once.
    processor = gateway.processors[0]

    def settlements() -> float:
        return processor.metrics().get("extproc_settlements_total", 0)

    assert wait_until(lambda: settlements() >= STREAMS, timeout_s=10)
    assert processor.metrics()["extproc_requests_admitted_total"] == STREAMS == settlements()
    settled = [settlement(redis_client, tenant(i)) for i in range(STREAMS)]
    output_charged = 0
    for i, (result, (reserved, bill)) in enumerate(zip(results, settled, strict=True)):
        charged_prompt, received = expected_charge(result, prompt)
        expected = charged_prompt + received
        if upstream_reset(result):
            # Never less than the client received, never more than the lease covered.
            assert expected <= bill <= reserved, f"stream {i}: {result.status}"
        else:
            assert bill == expected, f"stream {i}"
        # The counter holds exactly what was settled: nothing left reserved.
        assert counter_value(redis_client, tenant(i), "tpm", "gpt-4.1") == bill, f"stream {i}"
        output_charged += bill - charged_prompt
    # All output charged, reset streams' included, is output the model really generated.
    assert output_charged <= generated_tokens(chaos_simulator) - generated_before
    assert processor.metrics()["extproc_malformed_events_total"] > 0
