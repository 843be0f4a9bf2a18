"""Cached input is priced at its own rate, end to end: llmsim reports vLLM's
``prompt_tokens_details.cached_tokens`` for a prompt it has seen (``--ext-prefix-cache-block``),
the processor reads it from the closing usage chunk, and settlement refunds the difference
between the input price admission charged and the cached price, to the nano-unit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis

from extproc.config.schema import NANO_PER_UNIT
from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import stream_http1
from tests.gateway.conftest import FAST_PROFILE, tenant_key, write_processor_config
from tests.support.quota_views import ledger, ledger_net, live_books

BLOCK = 16
PRICES = {"input": "2.50", "output": "10.00", "cached_input": "0.625"}  # per 1M tokens
IN, OUT, CACHED = (int(Decimal(PRICES[k]) * NANO_PER_UNIT / 10**6) for k in PRICES)
MODELS = {
    "gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096, "prices": PRICES},
}
TENANT = "cached"


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("cached-prices")
    sim = Simulator(FAST_PROFILE, "--ext-prefix-cache-block", str(BLOCK), log_dir=workdir)
    config = write_processor_config(
        workdir / "quota.yaml",
        {TENANT: {"window_s": 3600, "limits": {"*": {"cost": "1000"}}}},
        redis_url=redis_server.url,
        models=MODELS,
    )
    gw = start_gateway(config, workdir, [sim.port])
    try:
        yield gw
    finally:
        gw.stop()
        sim.stop()


def ask(gateway: Gateway, prompt: str) -> None:
    request: dict[str, Any] = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": 20,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    result = asyncio.run(
        stream_http1(gateway.base_url + "/v1/chat/completions", tenant_key(TENANT), request)
    )
    assert result.status == 200 and result.clean_end and result.done


def test_a_repeated_prompt_is_billed_its_cached_tokens_at_the_cached_price(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    prompt = "Summarise the history of budgets in three long sentences, please. " * 4
    ask(gateway, prompt)
    ask(gateway, prompt)
    assert wait_until(lambda: len(ledger(redis_client, TENANT)) == 2)
    first, second = ledger(redis_client, TENANT)
    prompt_tokens = int(first["prompt_tokens"])
    assert prompt_tokens > BLOCK and int(second["prompt_tokens"]) == prompt_tokens
    output = int(first["output_tokens"])
    assert output == int(second["output_tokens"]) == 20
    cached = prompt_tokens // BLOCK * BLOCK  # what llmsim reports for a prompt seen before
    assert ledger_net([first], "cost") == prompt_tokens * IN + output * OUT
    assert (
        ledger_net([second], "cost")
        == (prompt_tokens - cached) * IN + cached * CACHED + output * OUT
    )
    counters, listed = live_books(redis_client, TENANT, "cost")
    assert counters == listed and counters
