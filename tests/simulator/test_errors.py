"""Injected failures and bad input get OpenAI-style errors, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import openai
import pytest

from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import post_json

GOOD = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

FAILURES = [
    # type, status, openai.error type, SDK exception, param
    ("rate_limit", 429, "RateLimitError", openai.RateLimitError, None),
    ("invalid_api_key", 401, "AuthenticationError", openai.AuthenticationError, None),
    ("context_length", 400, "BadRequestError", openai.BadRequestError, "messages"),
    ("server_error", 503, "InternalServerError", openai.InternalServerError, None),
    ("invalid_request", 400, "BadRequestError", openai.BadRequestError, "model"),
    ("model_not_found", 404, "NotFoundError", openai.NotFoundError, "model"),
]


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[Simulator]:
    with running_simulator("fast.yaml", log_dir=tmp_path_factory.mktemp("errors")) as s:
        yield s


@pytest.mark.parametrize(("failure", "status", "type_", "sdk_error", "param"), FAILURES)
async def test_each_failure_type_has_the_real_simulators_status_and_body(
    sim: Simulator, failure, status, type_, sdk_error, param
):
    async with aiohttp.ClientSession() as session:
        update = {"failure-injection-rate": 100, "failure-types": [failure]}
        assert (await post_json(session, sim.url("/admin/config"), update))[0] == 200
        try:
            got_status, body = await post_json(
                session, sim.url("/v1/chat/completions"), {**GOOD, "stream": True}
            )
            client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x", max_retries=0)
            with pytest.raises(sdk_error) as raised:
                await client.chat.completions.create(
                    model="gpt-4.1", messages=[{"role": "user", "content": "hi"}]
                )
            await client.close()
        finally:
            await post_json(session, sim.url("/admin/config"), {"failure-injection-rate": 0})
        after, _ = await post_json(session, sim.url("/v1/chat/completions"), GOOD)
    assert got_status == status
    error = body["error"]
    assert error["type"] == type_
    assert error["code"] == status
    assert error["param"] == param
    assert error["message"]
    if failure == "rate_limit":
        assert "gpt-4.1" in error["message"]
    assert raised.value.status_code == status
    assert after == 200


BAD_BODIES = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "gpt-4.1"}, "messages"),
    ({"model": "gpt-4.1", "messages": "hi"}, "messages"),
    ({"model": "gpt-4.1", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": "gpt-4.1", "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "stream": True, "stream_options": []}, "stream_options"),
    ({**GOOD, "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ({**GOOD, "ignore_eos": "true"}, "ignore_eos"),
    ({**GOOD, "n": 2}, "n"),
    ({**GOOD, "max_tokens": 200_000}, "messages"),  # beyond max-model-len
    ([1, 2, 3], "body"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
async def test_bad_chat_input_is_a_400_naming_the_field(sim: Simulator, body, param):
    async with aiohttp.ClientSession() as session:
        status, answer = await post_json(session, sim.url("/v1/chat/completions"), body)
        after, _ = await post_json(session, sim.url("/v1/chat/completions"), GOOD)
    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["code"] == 400
    assert answer["error"]["param"] == param
    assert after == 200


async def test_malformed_json_and_bad_prompts_are_400_and_the_server_keeps_serving(sim):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sim.url("/v1/chat/completions"),
            data=b'{"model": "gpt-4.1", "messages": [',
            headers={"Content-Type": "application/json"},
        ) as resp:
            truncated = (resp.status, await resp.json())
        status, bad_prompt = await post_json(
            session, sim.url("/v1/completions"), {"model": "gpt-4.1", "prompt": {"x": 1}}
        )
        after, _ = await post_json(session, sim.url("/v1/chat/completions"), GOOD)
    assert truncated[0] == 400
    assert "Invalid JSON" in truncated[1]["error"]["message"]
    assert status == 400 and bad_prompt["error"]["param"] == "prompt"
    assert after == 200


async def test_unknown_model_is_404_not_found_error(sim: Simulator):
    client = openai.AsyncOpenAI(base_url=sim.url("/v1"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    await client.close()
    error = raised.value.body
    assert raised.value.status_code == 404
    assert error["type"] == "NotFoundError"
    assert "no-such-model" in error["message"]


async def test_unknown_route_and_wrong_method_are_json_errors(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.url("/v1/nothing")) as resp:
            missing = (resp.status, await resp.json())
        async with session.get(sim.url("/v1/chat/completions")) as resp:
            wrong = (resp.status, await resp.json())
    assert missing[0] == 404 and missing[1]["error"]["type"] == "NotFoundError"
    assert wrong[0] == 405 and wrong[1]["error"]["code"] == 405


async def test_x_return_error_header_forces_that_status(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        url = sim.url("/v1/chat/completions")
        forced, body = await post_json(session, url, GOOD, headers={"X-Return-Error": "429"})
        invalid, _ = await post_json(session, url, GOOD, headers={"X-Return-Error": "soon"})
    assert forced == 429 and body["error"]["type"] == "RateLimitError"
    assert invalid == 400


async def test_request_id_header_is_echoed_when_enabled(tmp_path):
    with running_simulator("fast.yaml", "--enable-request-id-headers", log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sim.url("/v1/chat/completions"), json=GOOD, headers={"X-Request-Id": "req-42"}
            ) as resp:
                echoed = resp.headers.get("X-Request-Id")
            async with session.post(sim.url("/v1/chat/completions"), json=GOOD) as resp:
                generated = resp.headers.get("X-Request-Id")
                answer_id = (await resp.json())["id"]
    assert echoed == "req-42"
    assert generated == answer_id
