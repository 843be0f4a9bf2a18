"""Stream format, usage, lengths and real-token output, over HTTP with the openai SDK too."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from extproc.tokens.encodings import load_tokenizer
from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import stream_events

CHAT = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "Tell me a story."}]}


def _content(events: list) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e["choices"]
    )


def _token_events(events: list) -> list[dict]:
    return [
        e
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
    ]


async def test_chat_stream_has_role_first_then_content_then_finish_then_done(fast_sim: Simulator):
    body = {**CHAT, "stream": True, "max_tokens": 30}
    async with aiohttp.ClientSession() as session:
        events = await stream_events(session, fast_sim.url("/v1/chat/completions"), body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks), "no usage without include_usage"


async def test_include_usage_adds_usage_chunk_matching_streamed_tokens(fast_sim: Simulator):
    body = {**CHAT, "stream": True, "max_tokens": 64, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:
        events = await stream_events(session, fast_sim.url("/v1/chat/completions"), body)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    tokens = _token_events(events)
    assert usage["completion_tokens"] == len(tokens)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    o200k = load_tokenizer("o200k_base")
    assert len(o200k.encode(_content(events))) == usage["completion_tokens"]
    assert all(len(o200k.encode(e["choices"][0]["delta"]["content"])) == 1 for e in tokens)


async def test_continuous_usage_stats_put_running_usage_on_every_chunk(fast_sim: Simulator):
    body = {
        **CHAT,
        "stream": True,
        "max_tokens": 20,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with aiohttp.ClientSession() as session:
        events = await stream_events(session, fast_sim.url("/v1/chat/completions"), body)
    chunks = [e for e in events if isinstance(e, dict)]
    token_counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    # The role event (0 tokens so far), one more token per event, then the finish event.
    assert token_counts == [0, *range(1, 21), 20]
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)


async def test_openai_sdk_parses_chat_stream_and_sees_usage(fast_sim: Simulator):
    client = openai.AsyncOpenAI(base_url=fast_sim.url("/v1"), api_key="unused")
    stream = await client.chat.completions.create(
        model="my-gpt-alias",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        max_tokens=15,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    text = ""
    finish = None
    usage = None
    async for chunk in stream:
        assert chunk.model == "gpt-4.1"  # aliases answer under the first served name
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    await client.close()
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 15
    assert len(load_tokenizer("o200k_base").encode(text)) == 15


async def test_openai_sdk_parses_text_completion_stream_and_plain_answers(fast_sim: Simulator):
    client = openai.AsyncOpenAI(base_url=fast_sim.url("/v1"), api_key="unused")
    stream = await client.completions.create(
        model="gpt-4.1",
        prompt="Once upon a time",
        stream=True,
        max_tokens=12,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    async for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 12
    assert len(load_tokenizer("o200k_base").encode("".join(pieces))) == 12

    plain = await client.chat.completions.create(
        model="gpt-4.1-2025-04-14",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=7,
        extra_body={"ignore_eos": True},
    )
    await client.close()
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 7
    content = plain.choices[0].message.content or ""
    assert len(load_tokenizer("o200k_base").encode(content)) == 7


async def test_max_tokens_bounds_length_and_sets_finish_reason(fast_sim: Simulator):
    url = fast_sim.url("/v1/chat/completions")
    reasons = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(25):
            body = {**CHAT, "max_tokens": 10}
            async with session.post(url, json=body) as resp:
                answer = await resp.json()
            n = answer["usage"]["completion_tokens"]
            reason = answer["choices"][0]["finish_reason"]
            assert 1 <= n <= 10
            assert reason == ("length" if n == 10 else "stop")
            reasons.add(reason)
        # max_completion_tokens wins over max_tokens in chat.
        body = {**CHAT, "max_tokens": 50, "max_completion_tokens": 3, "ignore_eos": True}
        async with session.post(url, json=body) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        # A one-token limit is always reached.
        async with session.post(url, json={**CHAT, "max_tokens": 1}) as resp:
            single = await resp.json()
    assert "stop" in reasons, "random lengths mostly end before the limit"
    assert single["choices"][0]["finish_reason"] == "length"
    assert single["usage"]["completion_tokens"] == 1


async def test_tokens_per_chunk_groups_whole_tokens_per_event(tmp_path):
    with running_simulator("fast.yaml", "--ext-tokens-per-chunk", "4", log_dir=tmp_path) as sim:
        body = {
            **CHAT,
            "stream": True,
            "max_tokens": 30,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with aiohttp.ClientSession() as session:
            events = await stream_events(session, sim.url("/v1/chat/completions"), body)
    o200k = load_tokenizer("o200k_base")
    counts = [len(o200k.encode(e["choices"][0]["delta"]["content"])) for e in _token_events(events)]
    assert counts == [4] * 7 + [2]
    assert events[-2]["usage"]["completion_tokens"] == 30
    assert len(o200k.encode(_content(events))) == 30


async def test_echo_mode_returns_the_prompt_counted_in_real_tokens(tmp_path):
    prompt = "Echo this back, please: naïve café – 東京 🚀 done."
    with running_simulator("fast.yaml", "--mode", "echo", log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            events = await stream_events(
                session,
                sim.url("/v1/chat/completions"),
                {
                    "model": "gpt-4.1",
                    "messages": [{"role": "user", "content": prompt}],
                    "stream": True,
                    "max_tokens": 2,
                    "stream_options": {"include_usage": True},
                },
            )
            async with session.post(
                sim.url("/v1/completions"), json={"model": "gpt-4.1", "prompt": prompt}
            ) as resp:
                plain = await resp.json()
    o200k = load_tokenizer("o200k_base")
    assert _content(events) == prompt  # echo ignores max_tokens, like the real simulator
    assert events[-2]["usage"]["completion_tokens"] == len(o200k.encode(prompt))
    assert plain["choices"][0]["text"] == prompt
    assert plain["choices"][0]["finish_reason"] == "stop"


async def test_random_mode_without_tokenizer_uses_the_word_split(tmp_path, write_profile):
    profile = write_profile("model: plain\nmax-model-len: 4096\n")
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                sim.url("/v1/completions"),
                json={"model": "plain", "prompt": "Hello, world!", "max_tokens": 40},
            ) as resp,
        ):
            answer = await resp.json()
    from llmsim.tokens import WORD_SPLIT

    text = answer["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == 4  # "Hello" "," " world" "!"
    assert len(WORD_SPLIT.findall(text)) == answer["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def multi_sim(tmp_path_factory) -> Simulator:
    with running_simulator("multi-model.yaml", log_dir=tmp_path_factory.mktemp("multi")) as sim:
        yield sim


async def test_multi_model_profile_serves_each_model_with_its_tokenizer(multi_sim: Simulator):
    async with aiohttp.ClientSession() as session:
        async with session.get(multi_sim.url("/v1/models")) as resp:
            listed = {m["id"]: m for m in (await resp.json())["data"]}
        answers = {}
        for model in ("mistral-7b", "gpt-4o-mini-2024-07-18"):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "ignore_eos": True,
            }
            async with session.post(multi_sim.url("/v1/chat/completions"), json=body) as resp:
                answers[model] = await resp.json()
    assert set(listed) == {
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistral-7b",
        "gpt-4o-mini",
        "gpt-4o-mini-2024-07-18",
    }
    assert listed["mistral-7b"]["root"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert answers["mistral-7b"]["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert answers["gpt-4o-mini-2024-07-18"]["model"] == "gpt-4o-mini"
    sp = load_tokenizer("mistral-7b-v0.1.sentencepiece.model")
    o200k = load_tokenizer("o200k_base")
    sp_text = answers["mistral-7b"]["choices"][0]["message"]["content"]
    gpt_text = answers["gpt-4o-mini-2024-07-18"]["choices"][0]["message"]["content"]
    assert len(sp.encode(sp_text)) == 40
    assert len(o200k.encode(gpt_text)) == 40


async def test_prompt_tokens_use_the_chat_template_of_each_tokenizer(multi_sim: Simulator):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?", "name": "ann"},
    ]
    sp = load_tokenizer("mistral-7b-v0.1.sentencepiece.model")
    o200k = load_tokenizer("o200k_base")

    def expected(tok, per_message: int, priming: int) -> int:
        total = priming
        for m in messages:
            total += per_message + len(tok.encode(m["role"])) + len(tok.encode(m["content"]))
            if "name" in m:
                total += 1 + len(tok.encode(m["name"]))
        return total

    usage = {}
    async with aiohttp.ClientSession() as session:
        for model in ("mistral-7b", "gpt-4o-mini"):
            body = {"model": model, "messages": messages, "max_tokens": 1}
            async with session.post(multi_sim.url("/v1/chat/completions"), json=body) as resp:
                usage[model] = (await resp.json())["usage"]["prompt_tokens"]
        body = {"model": "gpt-4o-mini", "prompt": "Say", "suffix": " please", "max_tokens": 1}
        async with session.post(multi_sim.url("/v1/completions"), json=body) as resp:
            completion_prompt = (await resp.json())["usage"]["prompt_tokens"]
    assert usage["mistral-7b"] == expected(sp, 7, 1)
    assert usage["gpt-4o-mini"] == expected(o200k, 3, 3)
    assert completion_prompt == len(o200k.encode("Say")) + len(o200k.encode(" please"))
