"""Streaming billing end to end: lease-ahead batches, clean cut-off, exact settlement."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, http_get, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1, stream_http2
from tests.gateway.conftest import (
    FAST_PROFILE,
    WINDOW_S,
    counter_value,
    tenant_key,
    write_processor_config,
)

MODELS = {
    "gpt-4.1": {
        "aliases": ["gpt-4.1-2025-04-14", "my-gpt-alias"],
        "tokenizer": "o200k_base",
        "max_tokens": 4096,
        "default_max_tokens": 256,
    }
}
MESSAGES = [{"role": "user", "content": "Tell me a long story about quotas."}]


def budget_plan(tpm: int, **extra: Any) -> dict[str, Any]:
    return {
        "window_s": WINDOW_S,
        "limits": {"*": {"tpm": tpm}},
        "charge_mode": "incremental",
        "batch_tokens": 32,
        **extra,
    }


TENANTS = {
    "within": budget_plan(1_000_000),
    "within_usage": budget_plan(1_000_000),
    "cut_h1": budget_plan(300),
    "cut_h2": budget_plan(300),
    "cut_sdk": budget_plan(300),
    "cut_abort": budget_plan(300),
    "truncate": budget_plan(300, on_exhaustion="truncate"),
    "completions": budget_plan(300),
    "continuous": budget_plan(300),
    "disconnect": budget_plan(1_000_000),
    "upstream_error": {**budget_plan(1_000_000), "limits": {"*": {"rpm": 100, "tpm": 1_000_000}}},
}


def prompt_tokens(payload: dict[str, Any]) -> int:
    registry = TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}])
    return count_prompt_tokens(payload, registry.counter_for("gpt-4.1"))


@pytest.fixture(scope="module")
def slow_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    """A simulator that is still generating when the gateway cuts the stream off."""
    sim = Simulator(
        FAST_PROFILE,
        "--inter-token-latency", "4ms",
        log_dir=tmp_path_factory.mktemp("slow-sim"),
    )  # fmt: skip
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, slow_simulator: Simulator
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("streaming")
    config = write_processor_config(
        workdir / "quota.yaml",
        TENANTS,
        redis_url=redis_server.url,
        models=MODELS,
        stream_idle_timeout_s=2,
    )
    gw = start_gateway(config, workdir, [slow_simulator.port])
    yield gw
    gw.stop()


def payload(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4.1", "stream": True, "messages": MESSAGES, **extra}


def url(gw: Gateway) -> str:
    return gw.base_url + "/v1/chat/completions"


def sim_metric(sim: Simulator, name: str, label: str = "") -> int:
    """One simulator metric summed over its series (those whose labels contain ``label``)."""
    _, text = http_get(sim.url("/metrics"))
    total = 0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def aborts(sim: Simulator) -> int:
    return sim_metric(sim, "vllm:request_success_total", 'finish_reason="abort"')


def running(sim: Simulator) -> int:
    return sim_metric(sim, "vllm:num_requests_running")


def generated(sim: Simulator) -> int:
    return sim_metric(sim, "vllm:generation_tokens_total")


def test_within_budget_the_client_gets_the_models_stream_minus_the_forced_usage_chunk(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    request = payload(max_tokens=40, extra_body=None)
    request.pop("extra_body")
    result = asyncio.run(stream_http1(url(gateway), tenant_key("within"), request))
    assert result.status == 200 and result.clean_end and result.done
    assert result.usage is None  # the client didn't ask for it; admission forced it upstream
    assert result.error is None
    assert 0 < result.output_tokens() <= 40

    asked = asyncio.run(
        stream_http1(
            url(gateway),
            tenant_key("within_usage"),
            payload(max_tokens=40, stream_options={"include_usage": True}),
        )
    )
    assert asked.usage is not None
    assert asked.usage["completion_tokens"] == asked.output_tokens()
    # Settlement commits the upstream's own usage for a stream that completed normally.
    assert wait_until(
        lambda: (
            counter_value(redis_client, "within_usage", "tpm", "gpt-4.1")
            == asked.usage["total_tokens"]
        )
    )


def _assert_cut_exactly_at_budget(
    result: StreamResult, redis_client: redis.Redis, tenant: str, request: dict[str, Any]
) -> None:
    assert result.status == 200
    assert result.clean_end, "the cut-off must end the response cleanly"
    assert result.done
    assert result.error is not None
    assert result.error["code"] == "tpm_limit_exceeded"
    assert result.error["type"] == "rate_limit_error"
    # Exactly the budget: every token the 300-token budget allows after the prompt, no more.
    assert result.output_tokens() == 300 - prompt_tokens(request)
    assert wait_until(lambda: counter_value(redis_client, tenant, "tpm", "gpt-4.1") == 300)


def test_budget_cut_off_over_http1_delivers_exactly_the_budget_then_error_and_done(
    gateway: Gateway, redis_client: redis.Redis, slow_simulator: Simulator
) -> None:
    request = payload(max_tokens=2000, ignore_eos=True)
    result = asyncio.run(stream_http1(url(gateway), tenant_key("cut_h1"), request))
    _assert_cut_exactly_at_budget(result, redis_client, "cut_h1", request)


def test_budget_cut_off_over_http2_ends_the_stream_cleanly(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    request = payload(max_tokens=2000, ignore_eos=True)
    result = stream_http2(url(gateway), tenant_key("cut_h2"), request)
    _assert_cut_exactly_at_budget(result, redis_client, "cut_h2", request)


def test_openai_sdk_raises_api_error_with_the_gateway_message_on_cut_off(
    gateway: Gateway,
) -> None:
    client = openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=tenant_key("cut_sdk"), max_retries=0
    )
    received = []
    with pytest.raises(openai.APIError) as info:
        stream = client.chat.completions.create(
            model="gpt-4.1",
            messages=MESSAGES,
            stream=True,
            max_tokens=2000,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
    assert not isinstance(info.value, openai.APIConnectionError)
    assert "token budget" in info.value.message
    assert received


def test_cut_off_stops_the_model_generating(gateway: Gateway, slow_simulator: Simulator) -> None:
    assert wait_until(lambda: running(slow_simulator) == 0)  # earlier tests' streams are over
    before, tokens_before = aborts(slow_simulator), generated(slow_simulator)
    request = payload(max_tokens=3000, ignore_eos=True)
    result = asyncio.run(stream_http1(url(gateway), tenant_key("cut_abort"), request))
    assert result.error is not None
    # The model stops: its request ends as an abort, long before the 3000 tokens (12 s at
    # 4 ms a token) it was asked for. What it generated past the cut is what it produced
    # while the cut travelled to it, bounded by a multiple of what the client was sent;
    # benchmarks/ measures the real delay.
    assert wait_until(lambda: running(slow_simulator) == 0, timeout_s=10)
    assert aborts(slow_simulator) == before + 1
    produced = generated(slow_simulator) - tokens_before
    assert result.output_tokens() <= produced <= 4 * result.output_tokens(), produced


def test_completions_stream_is_cut_at_the_budget_too(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    request = {
        "model": "gpt-4.1",
        "prompt": "Once upon a time, a quota",
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    result = asyncio.run(
        stream_http1(gateway.base_url + "/v1/completions", tenant_key("completions"), request)
    )
    assert result.clean_end and result.done
    assert result.error is not None and result.error["code"] == "tpm_limit_exceeded"
    assert result.output_tokens() == 300 - prompt_tokens(request)
    assert wait_until(lambda: counter_value(redis_client, "completions", "tpm", "gpt-4.1") == 300)


def test_continuous_usage_from_the_upstream_is_metered_to_the_same_exact_budget(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = payload(max_tokens=2000, ignore_eos=True, stream_options=options)
    result = asyncio.run(stream_http1(url(gateway), tenant_key("continuous"), request))
    assert any(isinstance(e, dict) and e.get("choices") and e.get("usage") for e in result.events)
    _assert_cut_exactly_at_budget(result, redis_client, "continuous", request)


def test_truncate_mode_ends_with_a_length_stop_instead_of_an_error(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    request = payload(max_tokens=2000, ignore_eos=True)
    result = asyncio.run(stream_http1(url(gateway), tenant_key("truncate"), request))
    assert result.clean_end and result.done and result.error is None
    finals = [
        c["finish_reason"]
        for e in result.events
        if isinstance(e, dict)
        for c in e.get("choices", [])
        if c.get("finish_reason")
    ]
    assert finals == ["length"]
    assert result.output_tokens() == 300 - prompt_tokens(request)
    assert wait_until(lambda: counter_value(redis_client, "truncate", "tpm", "gpt-4.1") == 300)


def test_client_disconnect_mid_stream_bills_what_was_delivered(
    gateway: Gateway, redis_client: redis.Redis, slow_simulator: Simulator
) -> None:
    request = payload(max_tokens=2000, ignore_eos=True)
    assert wait_until(lambda: running(slow_simulator) == 0)  # earlier tests' streams are over
    tokens_before = generated(slow_simulator)

    async def read_then_leave() -> str:
        text = bytearray()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                url(gateway),
                json=request,
                headers={"authorization": f"Bearer {tenant_key('disconnect')}"},
            ) as reply,
        ):
            async for chunk in reply.content.iter_any():
                text += chunk
                if text.count(b"\n\n") >= 60:
                    break
        return text.decode()

    received = asyncio.run(read_then_leave())
    from loadlab.sse_client import parse_events

    got = StreamResult(200, {}, received.encode(), False, parse_events(received.encode()))
    read_tokens = got.output_tokens()
    prompt = prompt_tokens(request)
    # The disconnect stops the model; what it generated bounds what can have been delivered.
    assert wait_until(lambda: running(slow_simulator) == 0, timeout_s=10)
    produced = generated(slow_simulator) - tokens_before
    assert produced < 2000

    # The tenant's one request; its record is keyed by the processor's own id.
    (record,) = redis_client.scan_iter(match="tq:{disconnect}:r:*")
    assert wait_until(lambda: redis_client.hget(record, "st") is not None)
    summary = redis_client.hget(record, "st").split(",")
    reserved, billed, refunded = (int(x) for x in summary[:3])
    # Tokens forwarded but still in Envoy's or the sockets' buffers when the client left
    # were delivered too, so the bill may exceed what was read, never what the model made.
    assert prompt + read_tokens <= billed <= prompt + produced, (read_tokens, produced)
    assert reserved == billed + refunded
    assert counter_value(redis_client, "disconnect", "tpm", "gpt-4.1") == billed


def test_upstream_error_refunds_the_output_reservation_and_keeps_the_attempt(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    request = payload(max_tokens=50)
    result = asyncio.run(
        stream_http1(url(gateway), tenant_key("upstream_error"), request, {"x-return-error": "503"})
    )
    assert result.status == 503
    # Output reservation refunded; the prompt stays charged, as does the request itself.
    assert wait_until(
        lambda: (
            counter_value(redis_client, "upstream_error", "tpm", "gpt-4.1")
            == prompt_tokens(request)
        )
    )
    assert counter_value(redis_client, "upstream_error", "rpm", "gpt-4.1") == 1


def test_overshoot_is_bounded_across_two_envoys_and_two_processors(
    tmp_path: Path, redis_server: RedisServer, simulators: list[Simulator]
) -> None:
    budget = 4000
    tenants = {"crowd": budget_plan(budget)}
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS
    )
    backends = [s.port for s in simulators]
    gateways: list[Gateway] = []
    request = payload(max_tokens=4000, ignore_eos=True)
    try:
        gateways.extend(start_gateway(config, tmp_path, backends) for _ in range(2))
        results = asyncio.run(
            _concurrent_streams([url(gw) for gw in gateways], tenant_key("crowd"), request, 50)
        )
    finally:
        for gw in gateways:
            gw.stop()
    admitted = [r for r in results if r.status == 200]
    delivered = sum(r.output_tokens() for r in admitted)
    charged = counter_value(redis.Redis(port=redis_server.port), "crowd", "tpm", "gpt-4.1")
    total = delivered + len(admitted) * prompt_tokens(request)
    assert all(r.clean_end for r in admitted)
    assert total == charged
    assert total <= budget
    assert total >= 0.9 * budget, f"budget under-used: {total}/{budget}"


async def _concurrent_streams(
    urls: list[str], key: str, request: dict[str, Any], n: int
) -> list[StreamResult]:
    return list(
        await asyncio.gather(*(stream_http1(urls[i % len(urls)], key, request) for i in range(n)))
    )
