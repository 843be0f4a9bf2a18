"""``ext-compat: llm-d-v0.10.2``: llmsim answers as llm-d-inference-sim v0.10.2 does.

Every behaviour over real HTTP, streamed and not, against ``llm-d-v0.10.2.yaml``. The
simulators are seeded; assertions are on shapes, counts and events, never on timing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from llmsim.llmd.answers import STOCK_SENTENCES, STOCK_TOKENS
from llmsim.llmd.tokenizer import split
from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import parse_sse, read_metric, stream_events, wait_for_metric

PROFILE = "llm-d-v0.10.2.yaml"
SEED = 7
HI = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": "gpt-4.1", "messages": HI}
MODEL = {"model_name": "gpt-4.1"}
STOCK_PIECES = {t for tokens in STOCK_TOKENS for t in tokens}
UUID_LEN = 36


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    log_dir = tmp_path_factory.mktemp("compat")
    with running_simulator(PROFILE, "--seed", str(SEED), log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def busy_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    """One slot, one waiting place, 10 ms per token, a 4096-token window, request-id headers."""
    with running_simulator(
        PROFILE,
        "--seed", "3",
        "--max-num-seqs", "1",
        "--max-waiting-queue-length", "1",
        "--inter-token-latency", "10ms",
        "--max-model-len", "4096",
        "--enable-request-id-headers",
        log_dir=tmp_path_factory.mktemp("compat-busy"),
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def echo_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    log_dir = tmp_path_factory.mktemp("compat-echo")
    with running_simulator(PROFILE, "--mode", "echo", log_dir=log_dir) as s:
        yield s


async def _post(sim: Simulator, path: str, body: dict, **kw: Any) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url(path), json=body, **kw) as resp,
    ):
        raw = await resp.read()
        return resp.status, resp.headers, orjson.loads(raw)


async def _chat(sim: Simulator, **extra: Any) -> dict:
    status, _, body = await _post(sim, "/v1/chat/completions", {**CHAT, **extra})
    assert status == 200, body
    return body


async def _raw_stream(sim: Simulator, path: str, body: dict) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url(path), json=body) as resp,
    ):
        return resp.status, resp.headers["Content-Type"], await resp.read()


async def _events(sim: Simulator, body: dict, path: str = "/v1/chat/completions") -> list:
    async with aiohttp.ClientSession() as session:
        return await stream_events(session, sim.url(path), body)


def _chunks(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict)]


def _content(events: list, index: int = 0) -> list[str]:
    choices = [c["choices"][0] for c in _chunks(events) if c["choices"]]
    return [
        c["delta"]["content"] for c in choices if c["index"] == index and "content" in c["delta"]
    ]


def _dummy_count(text: str) -> int:
    return len(split(text))


# --- the dummy tokenizer ----------------------------------------------------------------


async def test_chat_prompt_is_the_dummy_tokens_of_the_rendered_messages(sim: Simulator):
    plain = await _chat(sim, max_tokens=1)
    assert plain["usage"]["prompt_tokens"] == 6  # "#", "#", "# ", "user", ": ", "hi\n"
    cjk = [{"role": "user", "content": "你好 😀"}]
    assert (await _chat(sim, messages=cjk, max_tokens=1))["usage"]["prompt_tokens"] == 5
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    expected = _dummy_count("### system: Be brief.\n### user: Why?\n")
    assert (await _chat(sim, messages=two, max_tokens=1))["usage"]["prompt_tokens"] == expected
    events = await _events(
        sim, {**CHAT, "stream": True, "max_tokens": 1, "stream_options": {"include_usage": True}}
    )
    assert _chunks(events)[-1]["usage"]["prompt_tokens"] == 6


async def test_text_prompt_is_its_dummy_tokens_or_its_token_ids(sim: Simulator):
    body = {"model": "gpt-4.1", "prompt": "Hello, world! ¿Qué?", "max_tokens": 1}
    status, _, answer = await _post(sim, "/v1/completions", body)
    assert status == 200
    assert answer["usage"]["prompt_tokens"] == len(["Hello", ", ", "world", "! ", "Q", "?"])
    status, _, answer = await _post(sim, "/v1/completions", {**body, "prompt": [1, 2, 3, 4]})
    assert answer["usage"]["prompt_tokens"] == 4


# --- stock answers ------------------------------------------------------------------------


async def test_answers_are_stock_sentence_tokens_that_keep_their_trailing_space(sim: Simulator):
    answer = await _chat(sim, max_tokens=200, ignore_eos=True)
    text = answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 200 == _dummy_count(text)
    assert any(s in text for s in STOCK_SENTENCES)
    events = await _events(sim, {**CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True})
    pieces = _content(events)
    assert len(pieces) == 200
    assert set(pieces) <= STOCK_PIECES
    assert all(split(p) == [p] for p in pieces)  # one dummy token per chunk
    assert any(p.endswith(" ") and len(p) > 1 for p in pieces)


# --- chunk shape --------------------------------------------------------------------------


async def test_stream_chunks_have_the_real_shape(sim: Simulator):
    body = {**CHAT, "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True}}
    status, content_type, raw = await _raw_stream(sim, "/v1/chat/completions", body)
    assert status == 200 and content_type == "text/event-stream"
    datas = parse_sse(raw)
    assert datas[-1] == b"[DONE]"
    chunks = [orjson.loads(d) for d in datas[:-1]]
    assert all(list(c) == ["id", "model", "object", "created", "usage", "choices"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(b'"usage":null' in d for d in datas[:-2])
    role = chunks[0]["choices"][0]
    assert role == {"index": 0, "finish_reason": None, "delta": {"role": "assistant"}}
    assert all("logprobs" not in c["choices"][0] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    (response_id,) = {c["id"] for c in chunks}
    assert response_id.startswith("chatcmpl-")
    uuid.UUID(response_id.removeprefix("chatcmpl-"))
    assert len(response_id) == len("chatcmpl-") + UUID_LEN


async def test_non_streamed_answer_has_the_real_shape(sim: Simulator):
    answer = await _chat(sim, max_tokens=5)
    assert list(answer) == ["id", "model", "object", "created", "usage", "choices"]
    (choice,) = answer["choices"]
    assert list(choice) == ["index", "finish_reason", "message"]
    assert list(choice["message"]) == ["role", "content"]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    text_body = {"model": "gpt-4.1", "prompt": "Say it.", "max_tokens": 3}
    _, _, text = await _post(sim, "/v1/completions", text_body)
    assert text["object"] == "text_completion"
    assert text["id"].startswith("cmpl-") and text["id"].endswith("-0")
    assert list(text["choices"][0]) == ["index", "finish_reason", "text"]


async def test_ids_are_sha1_uuids_of_the_seed_port_and_a_count(sim: Simulator):
    answer = await _chat(sim, max_tokens=1)
    generated = answer["id"].removeprefix("chatcmpl-")
    candidates = {
        str(uuid.uuid5(uuid.NAMESPACE_URL, f"{SEED}-{sim.port}-{n}")) for n in range(5000)
    }
    assert generated in candidates


async def test_request_id_header_names_the_answer(busy_sim: Simulator):
    headers = {"X-Request-Id": "client-chosen"}
    status, got, answer = await _post(
        busy_sim, "/v1/chat/completions", {**CHAT, "max_tokens": 2}, headers=headers
    )
    assert status == 200 and got["X-Request-Id"] == "client-chosen"
    assert answer["id"] == "chatcmpl-client-chosen"
    status, got, answer = await _post(busy_sim, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert answer["id"] == "chatcmpl-" + got["X-Request-Id"]
    uuid.UUID(got["X-Request-Id"])
    text = {"model": "gpt-4.1", "prompt": "x", "max_tokens": 2}
    _, got, answer = await _post(busy_sim, "/v1/completions", text, headers=headers)
    assert (got["X-Request-Id"], answer["id"]) == ("client-chosen", "cmpl-client-chosen-0")
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            busy_sim.url("/v1/chat/completions"),
            json={**CHAT, "stream": True, "max_tokens": 2},
            headers={"X-Request-Id": "streamed-one"},
        ) as resp,
    ):
        assert resp.headers["X-Request-Id"] == "streamed-one"
        chunks = [orjson.loads(d) for d in parse_sse(await resp.read())[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-streamed-one"}


async def test_without_request_id_headers_none_is_sent(sim: Simulator):
    _, headers, _ = await _post(
        sim, "/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers={"X-Request-Id": "a"}
    )
    assert "X-Request-Id" not in headers


async def test_continuous_usage_stats_does_not_exist(sim: Simulator):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = await _events(
        sim, {**CHAT, "stream": True, "max_tokens": 5, "stream_options": options}
    )
    chunks = _chunks(events)
    assert all(c["usage"] is None for c in chunks[:-1])
    events = await _events(sim, {**CHAT, "stream": True, "max_tokens": 5})
    assert all(c["choices"] for c in _chunks(events)), "no usage chunk without include_usage"


# --- errors inside a 200 stream -----------------------------------------------------------


async def test_stream_over_the_context_window_is_a_200_with_an_error_event(busy_sim: Simulator):
    body = {**CHAT, "max_tokens": 5000}
    events = await _events(busy_sim, {**body, "stream": True})
    assert len(events) == 2 and events[1] == "[DONE]"
    error = events[0]["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["param"] is None
    assert error["message"].startswith("This model's maximum context length is 4096 tokens.")
    assert "(6 in the messages, 5000 in the completion)" in error["message"]
    status, headers, answer = await _post(busy_sim, "/v1/chat/completions", body)
    assert status == 400 and answer["error"] == error
    assert "X-Request-Id" in headers  # the answer had begun: headers were set before the error


async def _open_stream(sim: Simulator, body: dict) -> tuple[asyncio.StreamReader, Any]:
    raw = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(raw) + raw
    )
    await writer.drain()
    seen = bytearray()
    while b"data: " not in seen:
        data = await reader.read(65536)
        assert data, "the stream ended before its first event"
        seen += data
    return reader, writer


LONG = {**CHAT, "stream": True, "max_tokens": 60, "ignore_eos": True}


async def test_stream_into_a_full_queue_is_a_200_with_an_error_event(busy_sim: Simulator):
    reader, writer = await _open_stream(busy_sim, LONG)  # holds the only slot
    async with aiohttp.ClientSession() as session:
        waiting = asyncio.create_task(
            _post(busy_sim, "/v1/chat/completions", {**CHAT, "max_tokens": 1})
        )
        queued = await wait_for_metric(
            session, busy_sim, "vllm:num_requests_waiting", lambda v: v == 1, timeout_s=30, **MODEL
        )
        assert queued == 1
        events = await stream_events(
            session, busy_sim.url("/v1/chat/completions"), {**CHAT, "stream": True}
        )
        status, _, refused = await _post(busy_sim, "/v1/chat/completions", CHAT)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"] == {
        "message": "Failed to enqueue request, waiting requests queue is full",
        "type": "RateLimitError",
        "param": None,
        "code": 429,
    }
    assert status == 429 and refused == events[0]
    rest = bytearray()
    while b"data: [DONE]" not in rest:  # the long answer runs to its end
        data = await reader.read(65536)
        assert data, "the stream ended before [DONE]"
        rest += data
    writer.close()
    assert (await waiting)[0] == 200


# --- length distribution ------------------------------------------------------------------


async def test_fifteen_percent_of_answers_are_exactly_max_tokens_and_say_length(sim: Simulator):
    limit = 40
    async with aiohttp.ClientSession() as session:

        async def one() -> tuple[int, str]:
            async with session.post(
                sim.url("/v1/chat/completions"), json={**CHAT, "max_tokens": limit}
            ) as resp:
                body = await resp.json()
            return body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]

        results = [await one() for _ in range(400)]
    assert all(1 <= n <= limit for n, _ in results)
    assert all((reason == "length") == (n == limit) for n, reason in results)
    at_limit = sum(n == limit for n, _ in results)
    assert 35 <= at_limit <= 85, at_limit  # 15% of 400 is 60; ±3.5 standard deviations
    assert len({n for n, _ in results}) > 20
    events = await _events(sim, {**CHAT, "stream": True, "max_tokens": 3})
    reason = _chunks(events)[-1]["choices"][0]["finish_reason"]
    assert (reason == "length") == (len(_content(events)) == 3)


async def test_ignore_eos_without_a_token_limit_is_a_400(sim: Simulator):
    message = "Ignore_eos is true but max_completion_tokens (or max_tokens) is not set"
    for stream in (False, True):
        body = {**CHAT, "ignore_eos": True, "stream": stream}
        status, _, answer = await _post(sim, "/v1/chat/completions", body)
        assert (status, answer["error"]["message"]) == (400, message)
    answer = await _chat(sim, ignore_eos=True, max_completion_tokens=17)
    assert answer["usage"]["completion_tokens"] == 17
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_go_field_names_match_in_any_case_and_the_last_one_wins(sim: Simulator):
    answer = await _chat(sim, max_tokens=5, MAX_TOKENS=30, Ignore_EOS=True)
    assert answer["usage"]["completion_tokens"] == 30


async def test_validation_errors_are_the_real_ones(sim: Simulator):
    cases = [
        ({**CHAT, "max_tokens": 0}, 400, "Max completion tokens and max tokens should be positive"),
        ({**CHAT, "n": 0}, 400, "n must be at least 1"),
        ({**CHAT, "model": "nope"}, 404, "The model `nope` does not exist."),
    ]
    for body, status, message in cases:
        got, _, answer = await _post(sim, "/v1/chat/completions", body)
        assert (got, answer["error"]["message"]) == (status, message)
        assert answer["error"]["param"] is None
    got, _, answer = await _post(sim, "/v1/chat/completions", {**CHAT, "stream": "yes"})
    assert got == 400
    assert answer["error"]["message"].startswith("Failed to read and parse request body, ")


# --- disconnects ----------------------------------------------------------------------------


async def _send_and_leave(session: aiohttp.ClientSession, sim: Simulator, body: dict) -> None:
    """Send a request and close the connection once it runs, before any answer."""
    raw = orjson.dumps(body)
    _, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(raw) + raw
    )
    await writer.drain()
    running = await wait_for_metric(
        session, sim, "vllm:num_requests_running", lambda v: v == 1, timeout_s=30, **MODEL
    )
    writer.close()
    assert running == 1


async def test_a_client_that_leaves_is_never_noticed(busy_sim: Simulator):
    async with aiohttp.ClientSession() as session:
        before = await read_metric(session, busy_sim, "vllm:generation_tokens_total", **MODEL)
        lengths = await read_metric(
            session, busy_sim, "vllm:request_success_total", finish_reason="length", **MODEL
        )
        _, writer = await _open_stream(busy_sim, LONG)
        writer.close()  # after the first event: the client got at most a few tokens
        done = await wait_for_metric(
            session,
            busy_sim,
            "vllm:request_success_total",
            lambda v: v == lengths + 1,
            timeout_s=30,
            finish_reason="length",
            **MODEL,
        )
        after = await read_metric(session, busy_sim, "vllm:generation_tokens_total", **MODEL)
        async with session.get(busy_sim.url("/metrics")) as resp:
            text = await resp.text()
    assert done == lengths + 1
    assert after - before == LONG["max_tokens"]  # the whole planned answer
    assert 'finish_reason="abort"' not in text


async def test_a_client_that_leaves_an_unstreamed_request_is_never_noticed(busy_sim: Simulator):
    unstreamed = {**LONG, "stream": False}
    async with aiohttp.ClientSession() as session:
        before = await read_metric(session, busy_sim, "vllm:generation_tokens_total", **MODEL)
        lengths = await read_metric(
            session, busy_sim, "vllm:request_success_total", finish_reason="length", **MODEL
        )
        await _send_and_leave(session, busy_sim, unstreamed)
        done = await wait_for_metric(
            session,
            busy_sim,
            "vllm:request_success_total",
            lambda v: v == lengths + 1,
            timeout_s=30,
            finish_reason="length",
            **MODEL,
        )
        after = await read_metric(session, busy_sim, "vllm:generation_tokens_total", **MODEL)
    assert done == lengths + 1
    assert after - before == unstreamed["max_tokens"]


# --- n > 1 --------------------------------------------------------------------------------


async def test_n_choices_non_streamed(sim: Simulator):
    answer = await _chat(sim, n=3, max_tokens=20)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    counted = sum(_dummy_count(c["message"]["content"]) for c in choices)
    assert answer["usage"]["completion_tokens"] == counted
    assert answer["usage"]["prompt_tokens"] == 6  # the prompt once, for the three copies
    for c in choices:
        n = _dummy_count(c["message"]["content"])
        assert (c["finish_reason"] == "length") == (n == 20)


async def test_n_choices_streamed_close_with_the_first_choices_reason(sim: Simulator):
    body = {
        **CHAT,
        "stream": True,
        "n": 3,
        "max_tokens": 8,
        "stream_options": {"include_usage": True},
    }
    events = await _events(sim, body)
    chunks = _chunks(events)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    roles = [c["index"] for c in choices if "role" in c["delta"]]
    assert sorted(roles) == [0, 1, 2]
    finishes = [c for c in choices if c["finish_reason"]]
    assert [f["index"] for f in finishes] == [0, 1, 2]
    assert len({f["finish_reason"] for f in finishes}) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == sum(len(_content(events, i)) for i in range(3))
    assert usage["prompt_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1


async def test_openai_sdk_reads_n_choices_and_tool_calls(sim: Simulator):
    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="unused")
    reply = await client.chat.completions.create(model="gpt-4.1", messages=HI, n=2, max_tokens=4)
    assert len(reply.choices) == 2 and reply.usage is not None
    tooled = await client.chat.completions.create(
        model="gpt-4.1", messages=HI, tools=[WEATHER], tool_choice="required"
    )
    assert tooled.choices[0].finish_reason == "tool_calls"
    assert tooled.choices[0].message.tool_calls
    await client.close()


# --- tool calls ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}


def _check_weather_arguments(arguments: str) -> None:
    args = orjson.loads(arguments)
    assert {"city", "unit"} <= set(args) <= {"city", "days", "unit", "hourly"}
    assert isinstance(args["city"], str) and args["unit"] in ("C", "F")
    assert 0 <= args.get("days", 0) <= 100 and isinstance(args.get("hourly", True), bool)
    assert list(args) == sorted(args)  # a Go map: keys sorted


async def test_tool_calls_non_streamed_fit_the_schema_and_are_counted(sim: Simulator):
    answer = await _chat(sim, tools=[WEATHER], tool_choice="required")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert "content" not in message
    calls = message["tool_calls"]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert len(call["id"]) == len("chatcmpl-tool-") + 10
        assert call["function"]["name"] == "get_weather"
        _check_weather_arguments(call["function"]["arguments"])
    expected = sum(3 + _dummy_count(c["function"]["arguments"]) for c in calls)
    assert answer["usage"]["completion_tokens"] == expected


async def test_tool_calls_stream_one_argument_token_per_chunk(sim: Simulator):
    body = {
        **CHAT,
        "stream": True,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
        "stream_options": {"include_usage": True},
    }
    events = await _events(sim, body)
    chunks = _chunks(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    deltas = [c["choices"][0] for c in chunks[1:-1]]
    assert all(list(d["delta"]) == ["tool_calls"] for d in deltas), "no finish chunk after"
    calls: dict[int, list[dict]] = {}
    for d in deltas:
        (call,) = d["delta"]["tool_calls"]
        calls.setdefault(call["index"], []).append({**call, "finish": d["finish_reason"]})
    completion = 0
    for parts in calls.values():
        assert parts[0]["function"]["name"] in ("get_weather", "get_time")
        assert all(p["function"]["name"] is None for p in parts[1:])
        assert len({p["id"] for p in parts}) == 1
        arguments = "".join(p["function"]["arguments"] for p in parts)
        assert all(split(p["function"]["arguments"]) == [p["function"]["arguments"]] for p in parts)
        if parts[0]["function"]["name"] == "get_weather":
            _check_weather_arguments(arguments)
        assert [p["finish"] for p in parts] == [None] * (len(parts) - 1) + ["tool_calls"]
        completion += 3 + len(parts)
    assert chunks[-1]["usage"]["completion_tokens"] == completion


async def test_a_named_tool_choice_calls_exactly_that_tool(sim: Simulator):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = await _chat(sim, tools=[WEATHER, CLOCK], tool_choice=choice)
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    none = await _chat(sim, tools=[WEATHER], tool_choice="none", max_tokens=3)
    assert "tool_calls" not in none["choices"][0]["message"]


async def test_tools_the_real_schema_refuses_are_400s(sim: Simulator):
    no_params = {"type": "function", "function": {"name": "f", "description": "d"}}
    titled = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "title": "F", "properties": {}},
        },
    }
    for tool in (no_params, titled):
        status, _, body = await _post(sim, "/v1/chat/completions", {**CHAT, "tools": [tool]})
        assert status == 400
        assert body["error"]["message"].startswith("Tool validation failed: ")


async def test_metrics_count_tool_calls_and_never_abort(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        await _chat(sim, tools=[WEATHER], tool_choice="required")
        value = await read_metric(
            session, sim, "vllm:request_success_total", finish_reason="tool_calls", **MODEL
        )
        async with session.get(sim.url("/metrics")) as resp:
            text = await resp.text()
    assert value >= 1
    assert 'finish_reason="abort"' not in text


# --- logprobs -----------------------------------------------------------------------------


async def test_chat_logprobs_are_the_real_synthetic_ones(sim: Simulator):
    answer = await _chat(sim, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    content = answer["choices"][0]["logprobs"]["content"]
    text = answer["choices"][0]["message"]["content"]
    assert "".join(e["token"] for e in content) == text
    assert [e["logprob"] for e in content] == [-1, -1.1, -1.2] * 2
    first = content[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [t["token"] for t in first["top_logprobs"]] == [first["token"], first["token"] + "_1"]
    assert first["top_logprobs"][1]["logprob"] == -1.5
    events = await _events(
        sim, {**CHAT, "stream": True, "max_tokens": 4, "ignore_eos": True, "logprobs": True}
    )
    streamed = [c["choices"][0] for c in _chunks(events) if "content" in c["choices"][0]["delta"]]
    assert all(len(c["logprobs"]["content"]) == 1 for c in streamed)
    assert all(c["logprobs"]["content"][0]["token"] == c["delta"]["content"] for c in streamed)
    assert len({c["logprobs"]["content"][0]["logprob"] for c in streamed}) == 1
    assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 1 for c in streamed)


async def test_text_logprobs_follow_the_logprobs_count(sim: Simulator):
    body = {"model": "gpt-4.1", "prompt": "Go.", "max_tokens": 3, "ignore_eos": True}
    _, _, answer = await _post(sim, "/v1/completions", {**body, "logprobs": 2})
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3 and logprobs["token_logprobs"] == [
        -1,
        -1.1,
        -1.2,
    ]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token.encode()))
    assert logprobs["text_offset"] == offsets
    _, _, plain = await _post(sim, "/v1/completions", {**body, "logprobs": 0})
    assert "logprobs" not in plain["choices"][0]
    events = await _events(sim, {**body, "stream": True, "logprobs": 1}, "/v1/completions")
    texts = [c["choices"][0] for c in _chunks(events) if c["choices"][0]["text"]]
    assert all(c["logprobs"]["tokens"] == [c["text"]] for c in texts)
    assert all(c["logprobs"]["text_offset"] == [0] for c in texts)


# --- echo ---------------------------------------------------------------------------------


async def test_echo_answers_the_last_messages_dummy_tokens(echo_sim: Simulator):
    said = [{"role": "user", "content": "  Café, naïve 😀 plan: A|B"}]
    answer = await _chat(echo_sim, messages=said, max_tokens=3)
    text = answer["choices"][0]["message"]["content"]
    assert text == "".join(split(said[0]["content"])) == "Caf, nave plan: AB"
    assert answer["choices"][0]["finish_reason"] == "length"  # 8 tokens, max_tokens 3
    assert answer["usage"]["completion_tokens"] == 8
    events = await _events(echo_sim, {**CHAT, "messages": said, "stream": True})
    assert "".join(_content(events)) == text


async def test_echo_of_nothing_ends_the_stream_without_done(echo_sim: Simulator):
    empty = [{"role": "user", "content": "你好"}]
    answer = await _chat(echo_sim, messages=empty)
    assert answer["choices"][0]["message"] == {"role": "assistant"}
    assert answer["usage"]["completion_tokens"] == 0
    status, _, raw = await _raw_stream(
        echo_sim, "/v1/chat/completions", {**CHAT, "messages": empty, "stream": True}
    )
    assert status == 200 and parse_sse(raw) == []


def test_compat_refuses_llmsim_extensions(tmp_path):
    from llmsim.settings import ConfigError, build_config
    from loadlab.simulator import profile_path

    with pytest.raises(ConfigError) as raised:
        build_config(profile_path(PROFILE), {"ext-tokenizer": "o200k_base"}, {})
    assert raised.value.key == "ext-tokenizer"
    with pytest.raises(ConfigError) as raised:
        build_config(profile_path(PROFILE), {"ext-compat": "llm-d-v0.9"}, {})
    assert raised.value.key == "ext-compat"
