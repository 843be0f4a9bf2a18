"""Meter integrity against clients and upstreams that misbehave (issue 8).

Real Envoy, real processor, real redis-server; the upstream is a scripted HTTP server that
lies about usage, compresses, mislabels its content type or reports nothing, and records
every request it gets, so each test sees both what the client got and what the model got.
"""

from __future__ import annotations

import asyncio
import gzip
import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import stream_http1
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.go_json import GoView
from tests.support.scripted_upstream import (
    Received,
    Reply,
    ScriptedUpstream,
    chat_stream,
    usage,
)

SECRET_ENV = "TQ_TEST_UPSTREAM_KEY"
SECRET = "sk-upstream-secret-for-tests"
MODELS = {
    "gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 256},
    "served": {"tokenizer": "o200k_base", "upstream_name": "served-upstream-name"},
    "vllm": {"tokenizer": "o200k_base", "continuous_usage": True},
    "reasoner": {"tokenizer": "o200k_base", "reserve_max": True},
    "keyed": {"tokenizer": "o200k_base", "upstream_api_key_env": SECRET_ENV},
}
MESSAGES = [{"role": "user", "content": "Say something."}]
TOKENIZER = TokenizerRegistry.from_config(
    [{"match": "gpt-4.1", "tokenizer": "o200k_base"}]
).counter_for("gpt-4.1")
PROMPT = count_prompt_tokens({"messages": MESSAGES}, TOKENIZER)
# " hello" is one o200k token: N pieces are N visible tokens.
PIECE = " hello"


def plan(tpm: int = 1_000_000, **extra: Any) -> dict[str, Any]:
    return {"window_s": WINDOW_S, "limits": {"*": {"tpm": tpm, "rpm": 10_000}}, **extra}


TENANTS = {
    "replay": plan(),
    "replay_refused": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1}}},
    "replay_concurrent": plan(),
    "replay_poison": plan(tpm=200, charge_mode="reserve_max"),
    "close_after_done": plan(),
    "continuous": plan(tpm=PROMPT + 50),
    "reserve_max": plan(tpm=3 * PROMPT + 250),
    "gzip_stream": plan(tpm=PROMPT + 40),
    "gzip_json": plan(),
    "brotli": plan(),
    "accept_encoding": plan(),
    "case_sse": plan(tpm=PROMPT + 40),
    "plain_sse": plan(),
    "json_no_usage": plan(),
    "json_bad_usage": plan(),
    "json_unreadable": plan(),
    "prompt_list": plan(tpm=5_000, charge_mode="reserve_max"),
    "duplicate_model": plan(),
    "go_smuggle": plan(tpm=PROMPT + 50),
    "go_duplicates": plan(tpm=PROMPT + 50),
    "lookalike": plan(),
    "served_name": plan(),
    "credentials": plan(),
    "window_name": {"window_s": 3600, "limits": {"*": {"rpm": 1}}},
}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("integrity")
    config = write_processor_config(
        workdir / "quota.yaml",
        TENANTS,
        models=MODELS,
        default_model="gpt-4.1",
        redis_url=redis_server.url,
    )
    os.environ[SECRET_ENV] = SECRET  # read by the processor at start, never from the YAML
    try:
        gw = start_gateway(config, workdir, [upstream.port])
    finally:
        del os.environ[SECRET_ENV]
    yield gw
    gw.stop()


def stream_request(model: str = "gpt-4.1", **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": True, "messages": MESSAGES, **extra}


async def post(
    gateway: Gateway, tenant: str, payload: dict | bytes, headers: dict[str, str] | None = None
) -> Any:
    url = gateway.base_url + "/v1/chat/completions"
    return await stream_http1(url, tenant_key(tenant), payload, headers)


def tokens_charged(client: redis.Redis, tenant: str, model: str = "gpt-4.1") -> int:
    return counter_value(client, tenant, "tpm", model)


def settled(client: redis.Redis, tenant: str, expected: int, model: str = "gpt-4.1") -> int:
    """The tpm counter once settlement has brought it to ``expected`` (or its last value)."""
    wait_until(lambda: tokens_charged(client, tenant, model) == expected, timeout_s=10)
    return tokens_charged(client, tenant, model)


def visible_stream(pieces: int, completion: int | None = None, **kw: Any) -> list[bytes]:
    report = None if completion is None else usage(PROMPT, completion)
    return chat_stream([PIECE] * pieces, report, **kw)


SSE = {"Content-Type": "text/event-stream"}


# -- item 1: a client's request id never makes a request free ---------------------------


def test_a_replayed_request_id_is_charged_as_its_own_request(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(5, 5))
    headers = {"x-request-id": "same-id"}
    for _ in range(3):
        result = asyncio.run(post(gateway, "replay", stream_request(), headers))
        assert result.status == 200 and result.done
    assert settled(redis_client, "replay", 3 * (PROMPT + 5)) == 3 * (PROMPT + 5)
    assert counter_value(redis_client, "replay", "rpm", "gpt-4.1") == 3


def test_a_replayed_id_gets_no_answer_once_the_tenant_is_refused(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(5, 5))
    headers = {"x-request-id": "old-admitted-id"}
    first = asyncio.run(post(gateway, "replay_refused", stream_request(), headers))
    assert first.status == 200
    before = len(upstream.received)
    replay = asyncio.run(post(gateway, "replay_refused", stream_request(), headers))
    assert replay.status == 429
    assert orjson.loads(replay.body)["error"]["code"] == "rpm_limit_exceeded"
    assert len(upstream.received) == before  # the model never saw the replay


def test_concurrent_copies_of_one_id_are_each_charged(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(7, 7))

    async def burst() -> list[Any]:
        headers = {"x-request-id": "one-id-ten-times"}
        return await asyncio.gather(
            *(post(gateway, "replay_concurrent", stream_request(), headers) for _ in range(10))
        )

    results = asyncio.run(burst())
    assert all(r.status == 200 and r.done for r in results)
    assert settled(redis_client, "replay_concurrent", 10 * (PROMPT + 7)) == 10 * (PROMPT + 7)


def test_a_refused_request_id_is_not_poisoned(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "application/json"},
        chunks=[orjson.dumps(json_completion("hi", usage(PROMPT, 1)))],
    )
    headers = {"x-request-id": "retried-id"}
    too_big = {"model": "gpt-4.1", "messages": MESSAGES, "max_tokens": 500}
    refused = asyncio.run(post(gateway, "replay_poison", too_big, headers))
    assert refused.status == 429
    fits = {"model": "gpt-4.1", "messages": MESSAGES, "max_tokens": 20}
    assert asyncio.run(post(gateway, "replay_poison", fits, headers)).status == 200


# -- item 2: the usage chunk settles the request, whatever the client does next -----------


async def read_until_done_then_close(gateway: Gateway, tenant: str, payload: dict) -> bytes:
    """Reads the response until ``data: [DONE]`` arrives, then closes the connection."""
    body = orjson.dumps(payload)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.envoy.ports.listen)
    writer.write(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {tenant_key(tenant)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    seen = bytearray()
    while b"data: [DONE]" not in seen:
        chunk = await asyncio.wait_for(reader.read(65536), timeout=30)
        assert chunk, "the stream ended before [DONE]"
        seen += chunk
    writer.close()
    return bytes(seen)


def test_usage_chunk_settles_even_when_the_client_closes_right_after_done(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # The upstream keeps its connection open after [DONE]: the client's close comes first.
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(10, 110), hold_open_s=2)
    asyncio.run(read_until_done_then_close(gateway, "close_after_done", stream_request()))
    assert settled(redis_client, "close_after_done", PROMPT + 110) == PROMPT + 110


# -- item 3: output the client cannot see is still held to the budget ---------------------


def test_continuous_usage_leases_hidden_output_before_it_is_delivered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # Every visible token comes with nine hidden ones, reported by a running usage.
    def reply(_: Received) -> Reply:
        chunks = chat_stream(
            [PIECE] * 20,
            usage(PROMPT, 200),
            usage_per_chunk=lambda i: usage(PROMPT, 10 * i),
        )
        return Reply(headers=SSE, chunks=chunks)

    upstream.reply = reply
    result = asyncio.run(post(gateway, "continuous", stream_request("vllm", max_tokens=500)))
    sent = upstream.last().json()
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert result.status == 200 and result.error["code"] == "tpm_limit_exceeded"
    assert result.content.count(PIECE) == 5  # 50 tokens of budget: 5 chunks of 10
    assert settled(redis_client, "continuous", PROMPT + 50, "vllm") == PROMPT + 50


def test_reserve_max_holds_the_budget_when_usage_exceeds_the_visible_text(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # 10 visible tokens, 100 reported: only max_tokens reserved up front bounds such output.
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(10, 100))

    async def three() -> list[Any]:
        payload = stream_request("reasoner", max_tokens=100)
        return await asyncio.gather(*(post(gateway, "reserve_max", payload) for _ in range(3)))

    results = asyncio.run(three())
    admitted = [r for r in results if r.status == 200]
    assert len(admitted) == 2 and sum(r.status == 429 for r in results) == 1
    charged = settled(redis_client, "reserve_max", 2 * (PROMPT + 100), "reasoner")
    assert charged == 2 * (PROMPT + 100) <= 3 * PROMPT + 250


# -- item 4: compressed answers are read, or refused --------------------------------------


def test_metered_requests_ask_the_upstream_for_identity_encoding(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(2, 2))
    headers = {"Accept-Encoding": "gzip, br, zstd"}
    assert asyncio.run(post(gateway, "accept_encoding", stream_request(), headers)).status == 200
    assert upstream.last().headers["accept-encoding"] == "identity"


def test_a_gzipping_upstream_is_decoded_and_cut_at_the_exact_budget(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # No usage at all: only the meter's own count of the decoded text can bill this.
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(100), gzip=True)
    result = asyncio.run(post(gateway, "gzip_stream", stream_request()))
    assert result.status == 200 and "content-encoding" not in result.headers
    assert result.content.count(PIECE) == 40
    assert result.error["code"] == "tpm_limit_exceeded"
    assert settled(redis_client, "gzip_stream", PROMPT + 40) == PROMPT + 40


def test_a_gzipped_json_answer_is_billed_from_its_usage(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = json_completion(PIECE * 12, usage(PROMPT, 12))
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "application/json"}, chunks=[orjson.dumps(answer)], gzip=True
    )
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "max_tokens": 50}
    result = asyncio.run(post(gateway, "gzip_json", payload))
    assert result.status == 200 and orjson.loads(result.body) == answer
    assert settled(redis_client, "gzip_json", PROMPT + 12) == PROMPT + 12


def test_an_encoding_the_meter_cannot_read_is_refused_and_keeps_the_reservation(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    body = gzip.compress(b"".join(visible_stream(10, 10)))  # labelled br: unreadable
    upstream.reply = lambda _: Reply(headers={**SSE, "Content-Encoding": "br"}, chunks=[body])
    result = asyncio.run(post(gateway, "brotli", stream_request(max_tokens=64)))
    assert result.status == 502
    assert orjson.loads(result.body)["error"]["code"] == "upstream_unreadable"
    assert settled(redis_client, "brotli", PROMPT + 32) == PROMPT + 32  # one batch kept


# -- item 5: answers the meter did not expect are never billed prompt-only ----------------


def json_completion(text: str, report: dict | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-4.1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }
    if report is not None:
        doc["usage"] = report
    return doc


def test_an_event_stream_in_other_letter_case_is_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "Text/Event-Stream; charset=utf-8"}, chunks=visible_stream(100)
    )
    result = asyncio.run(post(gateway, "case_sse", stream_request()))
    assert result.content.count(PIECE) == 40 and result.error["code"] == "tpm_limit_exceeded"
    assert settled(redis_client, "case_sse", PROMPT + 40) == PROMPT + 40


def test_a_stream_without_event_stream_content_type_is_billed_from_its_text(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "text/plain"}, chunks=visible_stream(30)
    )
    result = asyncio.run(post(gateway, "plain_sse", stream_request()))
    assert result.status == 200 and result.content.count(PIECE) == 30
    assert settled(redis_client, "plain_sse", PROMPT + 30) == PROMPT + 30


@pytest.mark.parametrize(
    ("tenant", "report"),
    [
        ("json_no_usage", None),
        ("json_bad_usage", {"prompt_tokens": "some", "completion_tokens": "many"}),
    ],
)
def test_a_json_answer_without_readable_usage_is_billed_from_its_text(
    gateway: Gateway,
    upstream: ScriptedUpstream,
    redis_client: redis.Redis,
    tenant: str,
    report: dict | None,
) -> None:
    doc = json_completion(PIECE * 25, None)
    if report is not None:
        doc["usage"] = report
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "application/json"}, chunks=[orjson.dumps(doc)]
    )
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "max_tokens": 100}
    assert asyncio.run(post(gateway, tenant, payload)).status == 200
    assert settled(redis_client, tenant, PROMPT + 25) == PROMPT + 25


def test_an_unreadable_answer_keeps_its_reservation(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(
        headers={"Content-Type": "application/octet-stream"}, chunks=[b"\x00\xff garbage" * 50]
    )
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "max_tokens": 77}
    assert asyncio.run(post(gateway, "json_unreadable", payload)).status == 200
    assert settled(redis_client, "json_unreadable", PROMPT + 77) == PROMPT + 77


# -- item 6: every prompt of a completions list is reserved for ---------------------------


def test_a_list_of_prompts_reserves_a_completion_per_prompt(gateway: Gateway) -> None:
    prompts = ["p"] * 50
    payload = {"model": "gpt-4.1", "prompt": prompts, "max_tokens": 200}
    url = gateway.base_url + "/v1/completions"
    result = asyncio.run(stream_http1(url, tenant_key("prompt_list"), payload))
    assert result.status == 429
    error = orjson.loads(result.body)["error"]
    assert "needs 10050 tokens" in error["message"]  # 50 × 200 + 50 prompt tokens

    too_many = {"model": "gpt-4.1", "prompt": ["p"] * 200, "max_tokens": 1}
    result = asyncio.run(stream_http1(url, tenant_key("prompt_list"), too_many))
    assert result.status == 400 and orjson.loads(result.body)["error"]["param"] == "prompt"


# -- item 7: the model served is the model charged ----------------------------------------


def test_a_duplicate_model_key_reaches_the_upstream_as_the_charged_model(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(3, 3))
    body = (
        b'{"model": "served", "stream": true, "model": "gpt-4.1", "max_tokens": 9,'
        b' "max_tokens": 2000, "stream_options": {"include_usage": true},'
        b' "messages": ' + orjson.dumps(MESSAGES) + b"}"
    )
    assert asyncio.run(post(gateway, "duplicate_model", body)).status == 200
    sent = upstream.last().body
    assert sent.count(b'"model"') == 1 and sent.count(b'"max_tokens"') == 1
    assert orjson.loads(sent)["model"] == "gpt-4.1"
    assert settled(redis_client, "duplicate_model", PROMPT + 3) == PROMPT + 3


def go_server(received: Received) -> Reply:
    """An upstream reading the body as Go's encoding/json does (llm-d-inference-sim): any
    case, the last key winning; it answers as many tokens as the limit it read, streamed if
    it read ``stream``."""
    go = GoView(received.body)
    limits = [go.field(go.doc, f) for f in ("max_tokens", "max_completion_tokens")]
    tokens = min([v for v in limits if isinstance(v, int)] or [16])
    if go.field(go.doc, "stream"):
        return Reply(headers=SSE, chunks=visible_stream(tokens, tokens))
    doc = json_completion(PIECE * tokens, usage(PROMPT, tokens))
    return Reply(headers={"Content-Type": "application/json"}, chunks=[orjson.dumps(doc)])


SMUGGLED: list[tuple[str, dict[str, Any]]] = [
    ("MAX_TOKENS", {"max_tokens": 16, "MAX_TOKENS": 1000}),
    ("Max_Completion_Tokens", {"max_tokens": 16, "Max_Completion_Tokens": 1000}),
    ("max_to\u212aens", {"max_tokens": 16, "max_to\u212aens": 1000}),  # the Kelvin sign
    ("maxTokens", {"max_tokens": 16, "maxTokens": 1000}),  # encoding/json/v2 nocase
    ("N", {"max_tokens": 16, "N": 8}),
    ("Stream", {"max_tokens": 16, "stream": False, "Stream": True}),
    ("stream_options.Include_Usage", {
        "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True, "Include_Usage": False},
    }),
    ("messages[0].CONTENT", {
        "max_tokens": 16, "messages": [{**MESSAGES[0], "CONTENT": "long " * 2000}],
    }),
]  # fmt: skip


@pytest.mark.parametrize(("param", "extra"), SMUGGLED, ids=[p for p, _ in SMUGGLED])
def test_a_field_spelt_for_a_case_insensitive_upstream_is_refused_before_it(
    gateway: Gateway,
    upstream: ScriptedUpstream,
    redis_client: redis.Redis,
    param: str,
    extra: dict[str, Any],
) -> None:
    upstream.reply = go_server
    seen = len(upstream.received)
    payload = {"model": "gpt-4.1", "messages": MESSAGES, **extra}
    result = asyncio.run(post(gateway, "go_smuggle", payload))
    assert result.status == 400, result.body
    error = orjson.loads(result.body)["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", param)
    assert len(upstream.received) == seen  # nothing reached the model
    assert tokens_charged(redis_client, "go_smuggle") == 0


def test_duplicate_keys_reach_a_case_insensitive_upstream_as_the_value_charged(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    """orjson keeps the last duplicate, a parser may keep the first: only one is forwarded."""
    upstream.reply = go_server
    head = b'{"model": "gpt-4.1", "messages": ' + orjson.dumps(MESSAGES)
    fits = head + b', "max_tokens": 2000, "max_tokens": 5}'
    assert asyncio.run(post(gateway, "go_duplicates", fits)).status == 200
    sent = upstream.last().body
    assert sent.count(b'"max_tokens"') == 1
    assert GoView(sent).field(GoView(sent).doc, "max_tokens") == 5
    assert settled(redis_client, "go_duplicates", PROMPT + 5) == PROMPT + 5
    # The other order asks for 2,000: refused at admission, it never reaches the upstream.
    seen = len(upstream.received)
    over = head + b', "max_tokens": 5, "max_tokens": 2000}'
    assert asyncio.run(post(gateway, "go_duplicates", over)).status == 429
    assert len(upstream.received) == seen
    assert tokens_charged(redis_client, "go_duplicates") == PROMPT + 5


def test_a_lookalike_name_charged_to_the_default_model_is_served_as_it(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(3, 3))
    for name in ("GPT-4.1", "openai/gpt-4.1"):
        assert asyncio.run(post(gateway, "lookalike", stream_request(name))).status == 200
        assert upstream.last().json()["model"] == "gpt-4.1"
    assert settled(redis_client, "lookalike", 2 * (PROMPT + 3)) == 2 * (PROMPT + 3)


def test_a_model_is_forwarded_under_its_configured_upstream_name(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(3, 3))
    assert asyncio.run(post(gateway, "served_name", stream_request("served"))).status == 200
    assert upstream.last().json()["model"] == "served-upstream-name"


# -- item 8: the gateway's keys never reach the upstream ----------------------------------


def test_gateway_api_keys_never_reach_the_upstream_and_a_model_may_bring_its_own(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(2, 2))
    headers = {"x-api-key": tenant_key("credentials")}
    assert asyncio.run(post(gateway, "credentials", stream_request(), headers)).status == 200
    seen = upstream.last().headers
    assert "authorization" not in seen and "x-api-key" not in seen
    assert asyncio.run(post(gateway, "credentials", stream_request("keyed"))).status == 200
    assert upstream.last().headers["authorization"] == f"Bearer {SECRET}"
    assert tenant_key("credentials") not in str(upstream.last().headers)


# -- item 14: a refusal names the real window ---------------------------------------------


def test_a_refusal_names_the_window_it_counts_in(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=visible_stream(2, 2))
    assert asyncio.run(post(gateway, "window_name", stream_request())).status == 200
    refused = asyncio.run(post(gateway, "window_name", stream_request()))
    message = orjson.loads(refused.body)["error"]["message"]
    assert "requests per hour" in message and "minute" not in message
    assert 1 <= int(refused.headers["retry-after"]) <= 3600
