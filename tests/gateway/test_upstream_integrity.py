"""Meter integrity against upstreams that misbehave (issue 18): whatever the model server
sends, what reaches the client is billed.

Real Envoy, processor and redis-server; the upstream is a scripted HTTP server. Every test
reads what the client received with a tolerant client of its own (Python's ``json``, as the
openai SDK parses; gzip opened when the bytes are gzip; every field a client accumulates
as generated output, per choice and field, as the SDK's stream accumulator does), counts it
with tiktoken, and checks the request's one usage-ledger entry: billed >= delivered, and the
ledger's net per counter window == the counters. No test relies on the upstream being honest.
"""

from __future__ import annotations

import asyncio
import gzip
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, dechunk, stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.support.client_view import O200K, delivered
from tests.support.quota_views import counter_total, ledger, live_books
from tests.support.scripted_upstream import Reply, ScriptedUpstream, usage

MODELS = {
    # o200k is gpt-4.1's own tokenizer: the meter's count is authoritative (the default).
    "gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 256},
    # o200k standing in for another model's tokenizer: the upstream's usage is (the default).
    "approx": {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 256},
    "approx-metered": {
        "tokenizer": "o200k_base",
        "max_tokens": 4096,
        "default_max_tokens": 256,
        "usage_authority": "meter",
    },
}
MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = count_prompt_tokens(
    {"messages": MESSAGES},
    TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}]).counter_for(
        "gpt-4.1"
    ),
)
PIECE = " hello"  # one o200k token
SSE = {"Content-Type": "text/event-stream"}
JSON = {"Content-Type": "application/json"}
BASE = {"id": "chatcmpl-u", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4.1"}
TIGHT = 40  # output tokens a tight tenant has room for

ROOMY = {"window_s": WINDOW_S, "limits": {"*": {"tpm": 1_000_000, "rpm": 10_000}}}


def tight() -> dict[str, Any]:
    return {"window_s": WINDOW_S, "limits": {"*": {"tpm": PROMPT + TIGHT}}}


FIELDS = ("function_call", "custom_tool", "audio_transcript", "content_parts")
NUMBERS = ("NaN", "Infinity", "1e400", "lone_surrogate")
TENANTS: dict[str, dict[str, Any]] = {
    **{f"number-{n}": ROOMY for n in NUMBERS},
    "number-tight": tight(),
    "unparseable": ROOMY,
    "running-zero": ROOMY,
    "running-zero-asked": ROOMY,
    "running-two-choices": ROOMY,
    "status-sse": ROOMY,
    "status-json": ROOMY,
    "status-error-body": ROOMY,
    "not-sse-json": ROOMY,
    "not-sse-gzip": ROOMY,
    **{f"field-{f}": ROOMY for f in FIELDS},
    **{f"field-tight-{f}": tight() for f in FIELDS},
    "index-list": ROOMY,
    "prompt-zero": ROOMY,
    "prompt-last-zero": ROOMY,
    "meter-lying-low": ROOMY,
    "upstream-honest": ROOMY,
    "upstream-lying-low": ROOMY,
    "upstream-pinned-meter": ROOMY,
    "after-done": ROOMY,
    "completions-limit": ROOMY,
    "error-event": ROOMY,
    "close-after-done": ROOMY,
    "lost-admission": ROOMY,
    # docs/limits.md's roll-out example: an enforced limit and a shadow one of the same window.
    "rollout": {
        "window_s": WINDOW_S,
        "limits": {
            "gpt-4.1": {
                "tpm": 1000,
                "rules": [{"metric": "tokens", "limit": 150, "shadow": True}],
            }
        },
    },
}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("upstream-integrity")
    config = write_processor_config(
        workdir / "quota.yaml",
        TENANTS,
        models=MODELS,
        default_model="gpt-4.1",
        redis_url=redis_server.url,
    )
    gw = start_gateway(config, workdir, [upstream.port])
    yield gw
    gw.stop()


def settled_entry(client: redis.Redis, tenant: str) -> dict[str, str]:
    """The request's one ledger entry; its counters hold exactly what the ledger says."""
    assert wait_until(lambda: len(ledger(client, tenant)) >= 1, timeout_s=10), (
        f"{tenant}: no ledger entry (never settled)"
    )
    entries = ledger(client, tenant)
    assert len(entries) == 1, entries
    counters, listed = live_books(client, tenant, "tpm")
    assert counters == listed and counters
    return entries[0]


def check_billed(client: redis.Redis, tenant: str, body: bytes) -> tuple[int, int, str]:
    """(delivered, billed output, ledger reason); fails unless billed >= delivered."""
    entry = settled_entry(client, tenant)
    got, billed = delivered(body), int(entry["output_tokens"])
    assert billed >= got, f"{tenant}: delivered {got}, billed {billed}"
    return got, billed, entry["reason"]


async def post(
    gateway: Gateway, tenant: str, payload: dict[str, Any], path: str = "/v1/chat/completions"
) -> StreamResult:
    return await stream_http1(gateway.base_url + path, tenant_key(tenant), payload)


def run(gateway: Gateway, tenant: str, **payload: Any) -> StreamResult:
    body: dict[str, Any] = {"model": "gpt-4.1", "messages": MESSAGES, **payload}
    return asyncio.run(post(gateway, tenant, body))


async def read_until(
    gateway: Gateway, tenant: str, payload: dict[str, Any], enough: Callable[[bytes], bool]
) -> bytes:
    """A client that reads the answer until ``enough(body so far)``, then hangs up."""
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
    raw = bytearray()
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=30)
            assert chunk, "the answer ended before the client had enough"
            raw += chunk
            content, _ = dechunk(bytes(raw).partition(b"\r\n\r\n")[2])
            if enough(content):
                return content
    finally:
        writer.close()


# -- scripted answers ----------------------------------------------------------------------


def event(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {**BASE, "choices": choices, **extra}


def delta(content: Any = None, index: int = 0, **fields: Any) -> dict[str, Any]:
    body = {} if content is None else {"content": content}
    return {"index": index, "delta": {**body, **fields}}


def sse(events: list[Any]) -> list[bytes]:
    """One ``data:`` event per chunk; a str or bytes payload is sent as it is."""
    out = []
    for e in events:
        data = e.encode() if isinstance(e, str) else e if isinstance(e, bytes) else orjson.dumps(e)
        out.append(b"data: " + data + b"\n\n")
    return out


def content_stream(pieces: int, report: dict[str, Any] | None = None) -> list[bytes]:
    events: list[Any] = [event([delta(role="assistant")])]
    events += [event([delta(PIECE)]) for _ in range(pieces)]
    events.append(event([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    if report is not None:
        events.append(event([], usage=report))
    return sse([*events, "[DONE]"])


def completion(text: str, report: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "chatcmpl-u",
        "object": "chat.completion",
        "model": "gpt-4.1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }
    if report is not None:
        doc["usage"] = report
    return doc


# -- item 1: events the processor's JSON parser refuses -------------------------------------

ODD_VALUES = {
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "1e400": b"1e400",
    "lone_surrogate": b'"\\ud800"',
}


def odd_stream(name: str, pieces: int, report: dict[str, Any] | None = None) -> list[bytes]:
    """Content events each carrying a value orjson refuses and Python's json reads."""
    chunks = content_stream(pieces, report)
    odd = b',"x":' + ODD_VALUES[name] + b"}\n\n"
    return [c[:-3] + odd if b'"content"' in c else c for c in chunks]


@pytest.mark.parametrize("name", NUMBERS)
def test_events_a_strict_parser_refuses_are_read_as_clients_read_them_and_billed(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis, name: str
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=odd_stream(name, 180))
    result = run(gateway, f"number-{name}", stream=True)
    assert result.status == 200
    got, billed, _ = check_billed(redis_client, f"number-{name}", result.body)
    assert got == 180 == billed


def test_events_a_strict_parser_refuses_are_cut_at_the_budget(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=odd_stream("NaN", 180))
    result = run(gateway, "number-tight", stream=True)
    assert result.error is not None and result.error["code"] == "tpm_limit_exceeded"
    got, billed, reason = check_billed(redis_client, "number-tight", result.body)
    assert got == billed == TIGHT and reason == "cutoff"


def test_an_event_no_json_parser_reads_ends_the_stream_as_an_upstream_error(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    broken = b'{"choices":[{"index":0,"delta":{"content":"' + PIECE.encode() * 50 + b'"}}]'
    good = content_stream(30)
    chunks = [*good[:11], *sse([broken]), *good[11:]]
    upstream.reply = lambda _: Reply(headers=SSE, chunks=chunks)
    result = run(gateway, "unparseable", stream=True)
    assert broken not in result.body  # a text no client parser reads is not handed out
    assert result.error is not None and result.error["code"] == "upstream_error"
    assert result.done
    got, billed, reason = check_billed(redis_client, "unparseable", result.body)
    assert got == billed == 10 and reason == "upstream_error"


# -- item 2: a running usage only ever raises the count --------------------------------------


def running_zero_stream(pieces: int) -> list[bytes]:
    events: list[Any] = [event([delta(role="assistant")])]
    events += [event([delta(PIECE)], usage=usage(PROMPT, 0)) for _ in range(pieces)]
    events += [event([], usage=usage(PROMPT, 0)), "[DONE]"]
    return sse(events)


def test_a_running_usage_of_zero_does_not_make_the_text_free(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=running_zero_stream(180))
    result = run(gateway, "running-zero", stream=True)
    got, billed, _ = check_billed(redis_client, "running-zero", result.body)
    assert got == 180 == billed


def test_a_client_asking_for_continuous_usage_cannot_change_how_it_is_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=running_zero_stream(180))
    options = {"include_usage": True, "continuous_usage_stats": True}
    result = run(gateway, "running-zero-asked", stream=True, stream_options=options)
    # Passed through (the client asked to see it): harmless, a running figure only raises.
    assert upstream.last().json()["stream_options"]["continuous_usage_stats"] is True
    got, billed, _ = check_billed(redis_client, "running-zero-asked", result.body)
    assert got == 180 == billed


def test_per_choice_running_counts_are_summed_for_a_client_that_hangs_up_before_the_usage(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    pieces = 180
    events: list[Any] = [event([delta(role="assistant", index=i)]) for i in (0, 1)]
    for n in range(1, pieces + 1):
        for i in (0, 1):  # each choice's own running count, as vLLM reports it
            events.append(event([delta(PIECE, index=i)], usage=usage(PROMPT, n)))
    held = len(events)
    events += [event([], usage=usage(PROMPT, 2 * pieces)), "[DONE]"]
    release = threading.Event()
    upstream.reply = lambda _: Reply(headers=SSE, chunks=sse(events), hold_at=held, release=release)
    try:
        body = asyncio.run(
            read_until(
                gateway,
                "running-two-choices",
                {"model": "gpt-4.1", "messages": MESSAGES, "stream": True, "n": 2},
                lambda body: delivered(body) >= 2 * pieces,
            )
        )
    finally:
        release.set()
    got, billed, reason = check_billed(redis_client, "running-two-choices", body)
    assert got == 2 * pieces <= billed and reason == "disconnect"


# -- item 3: an error status with a body is metered like any other ---------------------------


def test_an_error_status_with_an_event_stream_is_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(status=500, headers=SSE, chunks=content_stream(180))
    result = run(gateway, "status-sse", stream=True)
    assert result.status == 500
    got, billed, reason = check_billed(redis_client, "status-sse", result.body)
    assert got == 180 == billed and reason == "upstream_error"


def test_an_error_status_with_a_json_completion_is_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    doc = completion(PIECE * 180)
    upstream.reply = lambda _: Reply(status=503, headers=JSON, chunks=[orjson.dumps(doc)])
    result = run(gateway, "status-json", max_tokens=400)
    assert result.status == 503 and orjson.loads(result.body) == doc
    got, billed, reason = check_billed(redis_client, "status-json", result.body)
    assert got == 180 == billed and reason == "upstream_error"


def test_an_error_status_with_an_error_object_bills_no_output_and_reaches_the_client(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    doc = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}
    upstream.reply = lambda _: Reply(status=400, headers=JSON, chunks=[orjson.dumps(doc)])
    result = run(gateway, "status-error-body", max_tokens=400)
    assert result.status == 400 and orjson.loads(result.body) == doc
    entry = settled_entry(redis_client, "status-error-body")
    assert (int(entry["prompt_tokens"]), int(entry["output_tokens"])) == (PROMPT, 0)
    assert entry["reason"] == "upstream_error"


# -- item 4: an event stream that is not SSE is never billed prompt-only ---------------------


def test_one_json_document_labelled_event_stream_is_billed_from_its_text(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    doc = completion(PIECE * 180)
    upstream.reply = lambda _: Reply(headers=SSE, chunks=[orjson.dumps(doc)])
    result = run(gateway, "not-sse-json", stream=True)
    assert result.status == 200 and orjson.loads(result.body) == doc
    got, billed, _ = check_billed(redis_client, "not-sse-json", result.body)
    assert got == 180 == billed


def test_gzip_bytes_without_content_encoding_are_decoded_and_metered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    body = gzip.compress(b"".join(content_stream(180)))
    upstream.reply = lambda _: Reply(headers=SSE, chunks=[body[:7], body[7:]])
    result = run(gateway, "not-sse-gzip", stream=True)
    assert result.status == 200
    got, billed, _ = check_billed(redis_client, "not-sse-gzip", result.body)
    assert got == 180 == billed


# -- item 5: every field a client reads as output is counted as it streams -------------------


def field_stream(field: str, pieces: int, report: dict[str, Any] | None = None) -> list[bytes]:
    """``pieces`` one-token deltas of generated text, all in one field."""
    first: dict[str, Any]
    if field == "function_call":
        first = {"role": "assistant", "function_call": {"name": "lookup", "arguments": ""}}

        def one(text: str) -> dict[str, Any]:
            return {"function_call": {"arguments": text}}
    elif field == "custom_tool":
        call = {"index": 0, "id": "call_1", "type": "custom", "custom": {"name": "run"}}
        first = {"role": "assistant", "tool_calls": [call]}

        def one(text: str) -> dict[str, Any]:
            return {"tool_calls": [{"index": 0, "custom": {"input": text}}]}
    elif field == "audio_transcript":
        first = {"role": "assistant", "audio": {"id": "audio_1"}}

        def one(text: str) -> dict[str, Any]:
            return {"audio": {"transcript": text}}
    else:
        first = {"role": "assistant"}

        def one(text: str) -> dict[str, Any]:
            return {"content": [{"type": "text", "text": text}]}

    events: list[Any] = [event([{"index": 0, "delta": first}])]
    events += [event([{"index": 0, "delta": one(PIECE)}]) for _ in range(pieces)]
    if report is not None:
        events.append(event([], usage=report))
    return sse([*events, "[DONE]"])


@pytest.mark.parametrize("field", FIELDS)
def test_output_in_any_field_is_counted_as_it_streams(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis, field: str
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=field_stream(field, 180))
    result = run(gateway, f"field-{field}", stream=True)
    got, billed, _ = check_billed(redis_client, f"field-{field}", result.body)
    assert got >= 180 and billed == got


@pytest.mark.parametrize("field", FIELDS)
def test_output_in_any_field_is_held_to_the_budget(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis, field: str
) -> None:
    # With the usage chunk the final bill is right either way: the leases must cover it.
    upstream.reply = lambda _: Reply(
        headers=SSE, chunks=field_stream(field, 100, usage(PROMPT, 100))
    )
    result = run(gateway, f"field-tight-{field}", stream=True)
    got, billed, reason = check_billed(redis_client, f"field-tight-{field}", result.body)
    assert result.error is not None and result.error["code"] == "tpm_limit_exceeded"
    assert got == billed <= TIGHT and reason == "cutoff"


# -- item 6: settlement never raises ---------------------------------------------------------


def test_an_answer_that_broke_settlement_is_settled_once(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    events = [event([{"index": [0], "delta": {"content": PIECE}}]) for _ in range(180)]
    upstream.reply = lambda _: Reply(headers=JSON, chunks=sse([*events, "[DONE]"]))
    result = run(gateway, "index-list", stream=True)
    assert result.status == 200
    got, billed, _ = check_billed(redis_client, "index-list", result.body)
    assert got == 180 <= billed


# -- item 7: the prompt is never billed below the processor's own count ----------------------


def test_a_usage_that_says_the_prompt_was_free_is_not_believed(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=content_stream(20, usage(0, 20)))
    result = run(gateway, "prompt-zero", stream=True)
    entry = settled_entry(redis_client, "prompt-zero")
    assert int(entry["prompt_tokens"]) == PROMPT
    assert int(entry["output_tokens"]) >= delivered(result.body) == 20


def test_a_last_usage_of_nothing_does_not_undo_the_bill(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    chunks = content_stream(20, usage(PROMPT, 20))
    chunks.insert(-1, sse([event([], usage=usage(0, 0))])[0])
    upstream.reply = lambda _: Reply(headers=SSE, chunks=chunks)
    result = run(gateway, "prompt-last-zero", stream=True)
    entry = settled_entry(redis_client, "prompt-last-zero")
    assert int(entry["prompt_tokens"]) == PROMPT
    assert int(entry["output_tokens"]) >= delivered(result.body) == 20


# -- item 8: a shadow rule never changes what the enforced rules charge or report ------------


def test_the_readme_rollout_example_enforces_its_limit_and_quotes_it(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    answer = 50
    doc = completion(PIECE * answer, usage(PROMPT, answer))
    upstream.reply = lambda _: Reply(headers=JSON, chunks=[orjson.dumps(doc)])
    fits = 1000 // (PROMPT + answer)
    results = [run(gateway, "rollout", max_tokens=answer) for _ in range(fits)]
    assert [r.status for r in results] == [200] * fits
    for r in results:
        assert r.headers["x-ratelimit-limit-tokens"] == "1000"
    left = 1000 - fits * (PROMPT + answer)
    assert results[-1].headers["x-ratelimit-remaining-tokens"] == str(left)
    assert counter_total(redis_client, "rollout", "tpm") == fits * (PROMPT + answer)
    refused = run(gateway, "rollout", max_tokens=200)
    assert refused.status == 429
    error = orjson.loads(refused.body)["error"]
    assert error["code"] == "tpm_limit_exceeded"
    assert f"limit 1000 tokens per hour, {left} remaining" in error["message"]
    assert refused.headers["x-ratelimit-limit-tokens"] == "1000"
    # The shadow counter counted the same traffic, on its own key, and refused nothing.
    assert counter_total(redis_client, "rollout", "shadow_tpm") == fits * (PROMPT + answer)


# -- item 9: who is billed what when the meter and the upstream disagree ---------------------


def honest_usage_stream(pieces: list[str], ratio: float) -> list[bytes]:
    """A server whose tokenizer counts ``ratio`` × o200k on the same text."""
    text = "".join(pieces)
    events: list[Any] = [event([delta(role="assistant")])]
    events += [event([delta(p)]) for p in pieces]
    reported = round(len(O200K.encode(text)) * ratio)
    events += [event([], usage=usage(PROMPT, reported)), "[DONE]"]
    return sse(events)


def disagreements(gateway: Gateway) -> float:
    return gateway.processors[0].metrics().get("extproc_usage_disagreements_total", 0)


WORDS = [f" {w}" for w in ("metering", "tokenizers", "disagree", "upstream", "honestly")] * 40


def test_a_meter_authority_model_is_billed_at_least_what_was_delivered(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=honest_usage_stream(WORDS, 0.5))
    result = run(gateway, "meter-lying-low", stream=True)
    got, billed, _ = check_billed(redis_client, "meter-lying-low", result.body)
    assert billed == got


def test_an_honest_server_with_another_tokenizer_is_billed_its_own_usage(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # llm-d-inference-sim's regex tokenizer counts ~10.6% below o200k on such text.
    upstream.reply = lambda _: Reply(headers=SSE, chunks=honest_usage_stream(WORDS, 0.894))
    before = disagreements(gateway)
    result = run(gateway, "upstream-honest", model="approx", stream=True)
    entry = settled_entry(redis_client, "upstream-honest")
    got, billed = delivered(result.body), int(entry["output_tokens"])
    assert billed == round(got * 0.894) < got
    assert disagreements(gateway) == before  # within the model's tolerance: expected


def test_a_lying_low_server_cannot_bill_below_the_verified_floor(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=honest_usage_stream(WORDS, 0.0))
    before = disagreements(gateway)
    result = run(gateway, "upstream-lying-low", model="approx", stream=True)
    entry = settled_entry(redis_client, "upstream-lying-low")
    got, billed = delivered(result.body), int(entry["output_tokens"])
    assert billed == math.ceil(got * 0.85)  # usage_tolerance 0.15 (the default)
    assert disagreements(gateway) == before + 1
    assert int(entry["prompt_tokens"]) == PROMPT  # the usage's prompt is the honest one


def test_a_model_pinned_to_meter_authority_bills_the_meters_count(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(headers=SSE, chunks=honest_usage_stream(WORDS, 0.894))
    result = run(gateway, "upstream-pinned-meter", model="approx-metered", stream=True)
    got, billed, _ = check_billed(redis_client, "upstream-pinned-meter", result.body)
    assert billed == got


# -- item 10: smaller ones ---------------------------------------------------------------------


def test_text_after_done_is_dropped_and_not_billed(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    after = sse([event([delta(PIECE)]) for _ in range(50)])
    upstream.reply = lambda _: Reply(headers=SSE, chunks=[*content_stream(20), *after])
    result = run(gateway, "after-done", stream=True)
    # role, 20 pieces, finish, [DONE]: nothing after it
    assert result.body.endswith(b"data: [DONE]\n\n") and result.body.count(b"data:") == 23
    got, billed, reason = check_billed(redis_client, "after-done", result.body)
    assert got == 20 == billed and reason == "completed"


def test_max_completion_tokens_is_clamped_on_completions(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    doc = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": PIECE}]}
    upstream.reply = lambda _: Reply(headers=JSON, chunks=[orjson.dumps(doc)])
    payload = {"model": "gpt-4.1", "prompt": "Say", "max_completion_tokens": 100_000}
    result = asyncio.run(post(gateway, "completions-limit", payload, "/v1/completions"))
    assert result.status == 200
    sent = upstream.last().json()
    assert sent["max_completion_tokens"] == 4096  # the model's max_tokens
    assert "max_tokens" not in sent
    entry = settled_entry(redis_client, "completions-limit")
    assert int(entry["output_tokens"]) >= delivered(result.body) == 1


def test_an_error_event_in_a_200_stream_reaches_the_client_and_settles_as_upstream_error(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    # What llm-d-inference-sim v0.10.2 sends for a streamed request it refuses.
    error = {"error": {"message": "the request is too long", "type": "BadRequestError"}}
    chunks = sse([error, "[DONE]"])
    upstream.reply = lambda _: Reply(headers=SSE, chunks=chunks)
    result = run(gateway, "error-event", stream=True)
    assert result.status == 200 and result.body == b"".join(chunks)
    _, billed, reason = check_billed(redis_client, "error-event", result.body)
    assert billed == 0 and reason == "upstream_error"


def test_a_client_closing_right_after_done_is_settled_completed(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    upstream.reply = lambda _: Reply(
        headers=SSE, chunks=content_stream(119, usage(PROMPT, 119)), hold_open_s=3
    )
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "stream": True}
    body = asyncio.run(
        read_until(gateway, "close-after-done", payload, lambda b: b"data: [DONE]" in b)
    )
    got, billed, reason = check_billed(redis_client, "close-after-done", body)
    assert got == 119 == billed and reason == "completed"


# -- an admission Redis lost (a failover, a restart) while the stream was on -----------------


def test_an_admission_redis_lost_mid_stream_is_charged_at_its_settlement(
    gateway: Gateway, upstream: ScriptedUpstream, redis_client: redis.Redis
) -> None:
    """Redis acknowledged the admission, then lost it with its charges (a replica promoted
    before it had the writes): made here by putting the tenant's keys back as they were
    before the request, while the upstream holds the stream. The next lease finds no
    record, so the stream is cut; the settlement finds none either and charges what was
    used, with its ledger entry, instead of nothing."""
    tenant = "lost-admission"
    pattern = f"tq:{{{tenant}}}:*"
    before = {
        k: (redis_client.dump(k), redis_client.pttl(k))
        for k in redis_client.scan_iter(match=pattern)
    }
    lost_before = gateway.processors[0].metrics().get("extproc_lost_admissions_charged_total", 0)
    release = threading.Event()
    upstream.reply = lambda _: Reply(
        headers=SSE, chunks=content_stream(180), hold_at=4, release=release
    )
    answers: list[StreamResult] = []
    client = threading.Thread(target=lambda: answers.append(run(gateway, tenant, stream=True)))
    client.start()
    try:
        recorded = lambda: any(redis_client.scan_iter(match=f"tq:{{{tenant}}}:r:*"))  # noqa: E731
        assert wait_until(recorded, timeout_s=10)
        for k in set(redis_client.scan_iter(match=pattern)) - set(before):
            redis_client.delete(k)
        for k, (dump, ttl) in before.items():
            redis_client.restore(k, max(ttl, 0), dump, replace=True)
    finally:
        release.set()
        client.join(30)
    [result] = answers
    assert result.status == 200
    got, billed, reason = check_billed(redis_client, tenant, result.body)
    assert got < 180 and reason == "cutoff", (got, billed, reason)
    assert b'"code":"quota_unavailable"' in result.body  # the backend failed, not the budget
    # Its ledger entry still says whose plan and which model: admission's, sent again.
    entry = settled_entry(redis_client, tenant)
    assert (entry["plan"], entry["model"]) == (tenant, "gpt-4.1")
    lost = gateway.processors[0].metrics()["extproc_lost_admissions_charged_total"]
    assert lost == lost_before + 1
