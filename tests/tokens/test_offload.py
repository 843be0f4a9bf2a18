"""Big prompts counted off the event loop (or in slices) give exactly the on-loop count.

The charge must not change with where a prompt is counted: every path here is compared
with ``count_prompt_tokens`` run straight through on the same body, for each tokenizer
kind, on prompts big enough to take the off-loop path.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.tokens import offload
from extproc.tokens.encodings import load_tokenizer
from extproc.tokens.estimator import TokenEstimator
from extproc.tokens.model_tokenizer import ModelTokenizer, model_tokenizer_for
from extproc.tokens.offload import (
    ESTIMATOR_STEP_CHARS,
    OFFLOAD_MIN_CHARS,
    CountFailed,
    PromptCounter,
)
from extproc.tokens.pieces import AFTER_DIGIT
from extproc.tokens.prompt import (
    ID_STEP,
    WALK_STEP,
    MalformedRequest,
    count_prompt_tokens,
    run_through,
)
from extproc.tokens.registry import TokenizerRegistry
from extproc.tokens.tally import JOIN_MAX_CHARS, SEPARATOR, TokenTally

# One model per tokenizer kind (and both tiktoken encodings), by the built-in rules.
MODELS = ["gpt-4o", "gpt-4", "mixtral-8x7b", "unknown-model"]
WORDS = (
    "quota", "budget", "token", "Stream", "gateway", "CamelCase", "2024", "42", "3.14",
    "résumé", "naïve", "東京", "데이터", "función", "😀", "<|endoftext|>", "a\tb", "x\n\ny",
    "'s", "  ", "-->", '{"k": [1, 2]}',
)  # fmt: skip


def mixed_text(chars: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS) + rng.choice((" ", " ", "", ", ", ".\n"))
        parts.append(word)
        size += len(word)
    return "".join(parts)[:chars]


@pytest.fixture(scope="module", params=MODELS)
def tok(request: pytest.FixtureRequest, registry: TokenizerRegistry) -> ModelTokenizer:
    return registry.counter_for(request.param)


def big_chat(chars: int, seed: int = 1) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": mixed_text(chars, seed)}]}


def bodies() -> list[tuple[str, dict[str, Any]]]:
    """Big bodies of every shape the walk knows, each well over every threshold."""
    many = [
        {"role": "user" if i % 2 else "assistant", "content": mixed_text(40, i)}
        for i in range(3 * WALK_STEP + 5)
    ]
    parts = [{"type": "text", "text": mixed_text(30, i)} for i in range(WALK_STEP + 7)]
    parts.insert(5, {"type": "image_url", "image_url": {"url": "data:,"}})
    calls = [
        {"id": f"call_{i}", "function": {"name": "f", "arguments": f'{{"x": {i}}}'}}
        for i in range(WALK_STEP + 3)
    ]
    return [
        ("one big message", big_chat(300_000)),
        ("a message with surrogates", {"messages": [
            {"role": "user", "content": "\ud83d" + mixed_text(100_000) + "\udc00 end"}
        ]}),
        ("many messages", {"messages": many}),
        ("many parts", {"messages": [{"role": "user", "content": parts}]}),
        ("many tool calls", {"messages": [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": mixed_text(50_000)},
        ]}),
        ("tools", big_chat(80_000) | {"tools": [
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        ]}),
        ("completions string", {"prompt": mixed_text(200_000), "suffix": "end"}),
        ("completions list", {"prompt": [mixed_text(200, i) for i in range(2 * WALK_STEP)]}),
        ("token ids", {"prompt": list(range(3 * ID_STEP + 11))}),
        ("token id lists", {"prompt": [list(range(ID_STEP + 1)), [5] * 10, list(range(7))]}),
    ]  # fmt: skip


BODIES = bodies()


@pytest.mark.parametrize(("shape", "body"), BODIES, ids=[name for name, _ in BODIES])
async def test_the_admission_count_equals_the_one_shot_count(
    tok: ModelTokenizer, shape: str, body: dict[str, Any]
) -> None:
    counter = PromptCounter()
    try:
        assert await counter.count(body, tok, image_tokens=765) == count_prompt_tokens(
            body, tok, image_tokens=765
        )
    finally:
        counter.close()


async def test_big_prompts_take_the_off_loop_path_and_small_ones_do_not(
    tok: ModelTokenizer,
) -> None:
    counter = PromptCounter()
    try:
        # Under every kind's threshold: counted where it is, no thread hop.
        small = big_chat(min(*OFFLOAD_MIN_CHARS.values(), ESTIMATOR_STEP_CHARS) // 2)
        assert await counter.count(small, tok) == count_prompt_tokens(small, tok)
        assert (counter.offloaded, counter.sliced) == (0, 0)
        big = big_chat(2 * max(*OFFLOAD_MIN_CHARS.values(), ESTIMATOR_STEP_CHARS))
        assert await counter.count(big, tok) == count_prompt_tokens(big, tok)
        if tok.kind == "estimator":
            assert (counter.offloaded, counter.sliced) == (0, 1)
        else:
            assert (counter.offloaded, counter.sliced) == (1, 0)
    finally:
        counter.close()


async def test_a_four_k_token_prompt_is_counted_on_the_loop(registry: TokenizerRegistry) -> None:
    tok = registry.counter_for("gpt-4o")
    body = {"messages": [{"role": "user", "content": "The quick brown fox jumps over it. " * 512}]}
    assert 4_000 <= count_prompt_tokens(body, tok) <= 4_200
    counter = PromptCounter()
    try:
        await counter.count(body, tok)
        assert counter.offloaded == 0
    finally:
        counter.close()


@pytest.mark.parametrize(
    "spec", ["o200k_base", "cl100k_base", "mistral-7b-v0.1.sentencepiece.model"]
)
def test_count_large_is_count_on_big_and_odd_texts(spec: str, corpus_lines: list[str]) -> None:
    backend = load_tokenizer(spec)
    texts = [
        mixed_text(1 << 20),
        "\n".join(corpus_lines),
        "<|endoftext|><|fim_prefix|><|endofprompt|> special-token text is ordinary text",
        "lone \ud800 surrogate and a pair \ud83d\ude00 and \udc00",
        "",
        " " * 5000,
        "\u0301" * 3,
    ]
    for text in texts:
        assert backend.count_large(text) == backend.count(text), text[:40]


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.one_of(st.characters(), st.sampled_from("\ud800\udfff <|")), max_size=300))
def test_count_large_is_count_on_any_text(text: str) -> None:
    for spec in ("o200k_base", "mistral-7b-v0.1.sentencepiece.model"):
        backend = load_tokenizer(spec)
        assert backend.count_large(text) == backend.count(text)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(
        st.one_of(
            st.sampled_from("aZ09 .\n\t-éß東데😀\ud800\udc00"),
            st.characters(codec="utf-8"),
        ),
        max_size=200,
    ),
    step=st.integers(min_value=1, max_value=64),
)
def test_estimator_slices_give_the_one_shot_estimate(text: str, step: int) -> None:
    estimator = TokenEstimator()
    steps = estimator.count_steps(text, step)
    pauses = 0
    try:
        while True:
            next(steps)
            pauses += 1
    except StopIteration as done:
        assert done.value == estimator.count(text)
    assert pauses == max(0, (len(text) - 1) // step)


@pytest.mark.parametrize(("chars", "step"), [(300_000, ESTIMATOR_STEP_CHARS), (300_000, 4093),
                                             (5_000, 1)])  # fmt: skip
def test_estimator_slices_of_a_big_prompt_give_the_one_shot_estimate(chars: int, step: int) -> None:
    estimator = TokenEstimator()
    text = mixed_text(chars) + "CamelCaseRunsAcross 12345 digits"
    assert run_through(estimator.count_steps(text, step)) == estimator.count(text)


async def test_the_loop_runs_between_estimator_slices(registry: TokenizerRegistry) -> None:
    tok = registry.counter_for("unknown-model")
    assert tok.kind == "estimator"
    body = big_chat(20 * ESTIMATOR_STEP_CHARS)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    counter = PromptCounter()
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        before = ticks
        assert await counter.count(body, tok) == count_prompt_tokens(body, tok)
        assert ticks - before >= 19  # the loop ran between the slices
    finally:
        task.cancel()
        counter.close()


async def test_the_worker_count_runs_outside_the_loop_thread(
    registry: TokenizerRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = registry.counter_for("gpt-4o")
    seen: list[str] = []
    real = tok.count_large

    def spy(text: str) -> int:
        seen.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(tok, "count_large", spy)
    counter = PromptCounter()
    try:
        body = big_chat(100_000)
        assert await counter.count(body, tok) == count_prompt_tokens(body, tok)
    finally:
        counter.close()
    assert seen and all(name.startswith("extproc-count") for name in seen)


async def test_a_burst_queues_for_a_bounded_pool_and_every_count_is_right(
    registry: TokenizerRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    toks = [registry.counter_for(m) for m in MODELS]
    threads: set[str] = set()
    for tok in toks:
        real = tok.count_large

        def spy(text: str, real: Any = real) -> int:
            threads.add(threading.current_thread().name)
            return real(text)

        monkeypatch.setattr(tok, "count_large", spy)
    counter = PromptCounter()
    try:
        jobs = [(toks[i % len(toks)], big_chat(60_000 + 997 * i, seed=i)) for i in range(24)]
        counted = await asyncio.gather(*(counter.count(body, tok) for tok, body in jobs))
    finally:
        counter.close()
    assert counted == [count_prompt_tokens(body, tok) for tok, body in jobs]
    assert 1 <= len(threads) <= offload.COUNT_THREADS


class FakePanic(BaseException):
    """What a Rust panic in a tokenizer surfaces as (pyo3's PanicException)."""


@pytest.mark.parametrize("error", [RuntimeError("tokenizer broke"), FakePanic("panicked")])
async def test_a_failure_in_the_worker_is_a_count_failed_error(
    registry: TokenizerRegistry, error: BaseException
) -> None:
    good = registry.counter_for("gpt-4o")

    def broken(text: str) -> int:
        raise error

    tok = model_tokenizer_for(good.backend)  # a copy: the shared one stays intact
    tok.count_large = broken  # type: ignore[method-assign]
    counter = PromptCounter()
    try:
        with pytest.raises(CountFailed, match=type(error).__name__):
            await counter.count(big_chat(100_000), tok)
        # The worker survived: the next big prompt is counted.
        tok.count_large = good.count_large  # type: ignore[method-assign]
        body = big_chat(100_000, seed=2)
        assert await counter.count(body, tok) == count_prompt_tokens(body, tok)
    finally:
        counter.close()


async def test_a_malformed_big_body_is_named_like_the_one_shot_walk(
    registry: TokenizerRegistry,
) -> None:
    tok = registry.counter_for("gpt-4o")
    many: list[Any] = [{"role": "user", "content": "hi"} for _ in range(3 * WALK_STEP)]
    many[2 * WALK_STEP + 1] = {"role": "user", "content": 5}
    body = {"messages": many}
    with pytest.raises(MalformedRequest) as one_shot:
        count_prompt_tokens(body, tok)
    counter = PromptCounter()
    try:
        with pytest.raises(MalformedRequest) as off_loop:
            await counter.count(body, tok)
    finally:
        counter.close()
    assert str(off_loop.value) == str(one_shot.value)
    assert "messages[2049]" in str(off_loop.value)


async def test_a_cancelled_count_leaves_the_pool_working(registry: TokenizerRegistry) -> None:
    tok = registry.counter_for("mixtral-8x7b")  # SentencePiece: the slowest to count
    counter = PromptCounter()
    try:
        first = asyncio.create_task(counter.count(big_chat(200_000), tok))
        queued = asyncio.create_task(counter.count(big_chat(200_000, seed=3), tok))
        await asyncio.sleep(0)
        queued.cancel()
        body = big_chat(50_000, seed=4)
        assert await counter.count(body, tok) == count_prompt_tokens(body, tok)
        assert await first == count_prompt_tokens(big_chat(200_000), tok)
        with pytest.raises(asyncio.CancelledError):
            await queued
    finally:
        counter.close()


def test_long_texts_counted_alone_give_the_joined_count(registry: TokenizerRegistry) -> None:
    """Texts over JOIN_MAX_CHARS are no longer joined: the total is what joining gave."""
    tok = registry.counter_for("gpt-4o")
    texts = ["user", mixed_text(50_000, 1), "assistant", "x" * (JOIN_MAX_CHARS + 1), "Done."]
    joinable = [t for t in texts if t[0] in AFTER_DIGIT and not t[-1].isspace()]
    alone = [t for t in texts if t not in joinable]
    separator = tok.count(SEPARATOR)
    joined = tok.count(SEPARATOR.join(joinable)) - (len(joinable) - 1) * separator
    tally = TokenTally(tok)
    for text in texts:
        tally.add(text)
    assert tally.total() == tally.total_large() == joined + sum(tok.count(t) for t in alone)
    assert tally.total() == sum(tok.count(t) for t in texts)
