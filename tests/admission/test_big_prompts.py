"""Big prompts through a real gateway: counted off the loop, charged exactly, failing clearly.

Real Envoy (the shipped bootstrap), the processor as a process, real redis-server; the
upstream is the scripted HTTP server, which records what reached it and answers a JSON
completion without usage and with no text, so a settled request is charged exactly the
prompt tokens the processor counted. Expected counts are ``count_prompt_tokens`` run in
this process on the same bodies with the processor's tokenizer rules.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from extproc.app.runtime import tokenizer_rules
from extproc.config import parse_config
from extproc.tokens.offload import OFFLOAD_MIN_CHARS
from extproc.tokens.prompt import WALK_STEP, count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import (
    Envoy,
    Gateway,
    Processor,
    grpc_serving,
    start_gateway,
    wait_until,
    write_config,
)
from loadlab.procs import ManagedProcess, free_ports
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.admission.failing_tokenizer_processor import MARK
from tests.gateway.conftest import (
    WINDOW_S,
    counter_value,
    processor_config,
    tenant_key,
)
from tests.support.scripted_upstream import Received, Reply, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[2]
MAX_BODY = 1 << 20  # the default max_body_bytes
MODELS: dict[str, Any] = {
    "gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 64},
    "open-mistral-7b": {"max_tokens": 64},  # the built-in Mistral v1 SentencePiece rule
    "guessed": {"tokenizer": "estimator", "max_tokens": 64},
}
PLAN = {
    "window_s": WINDOW_S,
    "limits": {"*": {"rpm": 1000, "tpm": 100_000_000}},
    "charge_mode": "reserve_max",
}
TENANTS = {"burst": PLAN, "fullsize": PLAN, "failing": PLAN, "survivor": PLAN}
DOC = processor_config(TENANTS, models=MODELS)
REGISTRY = TokenizerRegistry(tokenizer_rules(parse_config(DOC)))
WORDS = ("quota", "budget", "token", "2024", "3.14", "résumé", "東京", "데이터", "Stream", "x\n")


def text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    out = " ".join(rng.choice(WORDS) for _ in range(chars // 5))
    return out[:chars]


def empty_completion(_: Received) -> Reply:
    """No usage and no text: the settled charge is the admission's own prompt count."""
    answer = {
        "id": "chatcmpl-big",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4.1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}
        ],
    }
    return Reply(headers={"Content-Type": "application/json"}, chunks=[orjson.dumps(answer)])


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    server.reply = empty_completion
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("big-prompts")
    config = write_config(workdir / "quota.yaml", {**DOC, "redis_url": redis_server.url})
    gw = start_gateway(config, workdir, [upstream.port])
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def failing_gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    """The same gateway, its processor's tokenizer failing on texts holding ``MARK``."""
    workdir = tmp_path_factory.mktemp("big-prompts-failing")
    config = write_config(workdir / "quota.yaml", {**DOC, "redis_url": redis_server.url})
    port, metrics_port = free_ports(2)
    argv = [
        sys.executable, "-m", "tests.admission.failing_tokenizer_processor", "serve",
        "--config", str(config), "--listen", f"127.0.0.1:{port}",
        "--metrics-listen", f"127.0.0.1:{metrics_port}", "--drain-delay-s", "0",
        "--log-level", "warning",
    ]  # fmt: skip
    process = ManagedProcess(argv, workdir / f"extproc-{port}.log", cwd=ROOT)
    processor = Processor(process, port, metrics_port)
    try:
        process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
        envoy = Envoy.start(workdir, [port], [upstream.port])
    except Exception:
        processor.stop()
        raise
    gw = Gateway(envoy, [processor])
    yield gw
    gw.stop()


@pytest.fixture()
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    yield client
    client.close()


def chat(model: str, content: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return {"model": model, "max_tokens": 8, "messages": messages, **extra}


async def post(gateway: Gateway, tenant: str, path: str, payload: dict[str, Any]) -> StreamResult:
    return await stream_http1(gateway.base_url + path, tenant_key(tenant), orjson.dumps(payload))


def charged(client: redis.Redis, tenant: str, kind: str, model: str) -> int:
    return counter_value(client, tenant, kind, model)


def test_a_burst_of_big_prompts_is_all_counted_and_charged_exactly(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    many = [{"role": "user", "content": text(150, i)} for i in range(3 * WALK_STEP)]
    sent: list[tuple[str, str, dict[str, Any]]] = [
        *(("/v1/chat/completions", "gpt-4.1", chat("gpt-4.1", text(800_000, i))) for i in range(4)),
        ("/v1/chat/completions", "gpt-4.1", chat("gpt-4.1", many)),
        ("/v1/completions", "gpt-4.1", {"model": "gpt-4.1", "max_tokens": 8,
                                        "prompt": text(780_000, 9)}),
        # SentencePiece counts ~10x slower per character: smaller, so the burst fits well
        # inside Envoy's message_timeout on a loaded machine.
        *(("/v1/chat/completions", "open-mistral-7b", chat("open-mistral-7b", text(150_000, i)))
          for i in range(10, 12)),
        *(("/v1/chat/completions", "guessed", chat("guessed", text(800_000, i)))
          for i in range(20, 22)),
    ]  # fmt: skip
    for _, model, payload in sent:
        size = len(orjson.dumps(payload))
        assert size < MAX_BODY
        assert size > 2 * OFFLOAD_MIN_CHARS.get(REGISTRY.counter_for(model).kind, 0)
    before = len(upstream.received)

    async def burst() -> list[StreamResult]:
        return await asyncio.gather(
            *(post(gateway, "burst", path, payload) for path, _, payload in sent)
        )

    results = asyncio.run(burst())
    assert [r.status for r in results] == [200] * len(sent), [r.body[:300] for r in results]

    # What reached the model is each prompt as sent (re-serialised, nothing lost).
    forwarded = [r.json() for r in upstream.received[before:]]
    assert len(forwarded) == len(sent)
    prompts = sorted(orjson.dumps(b.get("messages", b.get("prompt"))) for b in forwarded)
    assert prompts == sorted(orjson.dumps(p.get("messages", p.get("prompt"))) for _, _, p in sent)

    expected: dict[str, int] = {}
    for _, model, payload in sent:
        tok = REGISTRY.counter_for(model)
        expected[model] = expected.get(model, 0) + count_prompt_tokens(payload, tok)
    for model, tokens in expected.items():
        wait_until(lambda m=model, t=tokens: charged(redis_client, "burst", "tpm", m) == t, 10)
        assert charged(redis_client, "burst", "tpm", model) == tokens, model
        requests = sum(1 for _, m, _ in sent if m == model)
        assert charged(redis_client, "burst", "rpm", model) == requests, model


def test_a_full_size_body_gets_through_envoy_and_is_admitted(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    payload = chat("gpt-4.1", "")
    overhead = len(orjson.dumps(payload))
    filler = "The quick brown fox jumps over the lazy dog. " * (MAX_BODY // 45 + 1)
    payload["messages"][0]["content"] = filler[: MAX_BODY - overhead]  # exactly max_body_bytes
    assert len(orjson.dumps(payload)) == MAX_BODY
    result = asyncio.run(post(gateway, "fullsize", "/v1/chat/completions", payload))
    assert result.status == 200, result.body[:300]
    tokens = count_prompt_tokens(payload, REGISTRY.counter_for("gpt-4.1"))
    wait_until(lambda: charged(redis_client, "fullsize", "tpm", "gpt-4.1") == tokens, 10)
    assert charged(redis_client, "fullsize", "tpm", "gpt-4.1") == tokens
    payload["messages"][0]["content"] += "."
    result = asyncio.run(post(gateway, "fullsize", "/v1/chat/completions", payload))
    assert result.status == 413
    assert orjson.loads(result.body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("where", "chars"),
    [("worker thread", 4 * OFFLOAD_MIN_CHARS["tiktoken"]), ("event loop", 200)],
)
def test_a_tokenizer_failure_is_a_clear_error_and_charges_nothing(
    failing_gateway: Gateway,
    upstream: ScriptedUpstream,
    redis_client: redis.Redis,
    where: str,
    chars: int,
) -> None:
    client = openai.OpenAI(
        base_url=failing_gateway.base_url + "/v1", api_key=tenant_key("failing"), max_retries=0
    )
    before = len(upstream.received)
    content = text(chars, 1) + " " + MARK
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": content}], max_tokens=8
        )
    error = raised.value
    assert error.status_code == 500
    assert error.body == {
        "message": "The gateway could not count the prompt's tokens; the request was not "
        "forwarded.",
        "type": "api_error",
        "param": None,
        "code": "token_count_failed",
    }
    assert len(upstream.received) == before  # nothing reached the model
    assert charged(redis_client, "failing", "tpm", "gpt-4.1") == 0
    assert charged(redis_client, "failing", "rpm", "gpt-4.1") == 0
    records = failing_gateway.processors[0].log_records()
    assert any(r.get("event") == "prompt_count_failed" for r in records)


def test_the_processor_keeps_counting_after_a_tokenizer_failure(
    failing_gateway: Gateway, redis_client: redis.Redis
) -> None:
    async def mixed() -> list[StreamResult]:
        bad = chat("gpt-4.1", text(200_000, 2) + MARK)
        good = [chat("gpt-4.1", text(200_000 + i, 3 + i)) for i in range(3)]
        return await asyncio.gather(
            post(failing_gateway, "survivor", "/v1/chat/completions", bad),
            *(post(failing_gateway, "survivor", "/v1/chat/completions", g) for g in good),
        )

    results = asyncio.run(mixed())
    assert [r.status for r in results] == [500, 200, 200, 200]
    assert failing_gateway.processors[0].process.proc.poll() is None  # still running
    tok = REGISTRY.counter_for("gpt-4.1")
    expected = sum(
        count_prompt_tokens(chat("gpt-4.1", text(200_000 + i, 3 + i)), tok) for i in range(3)
    )
    wait_until(lambda: charged(redis_client, "survivor", "tpm", "gpt-4.1") == expected, 10)
    assert charged(redis_client, "survivor", "tpm", "gpt-4.1") == expected
    assert charged(redis_client, "survivor", "rpm", "gpt-4.1") == 3
