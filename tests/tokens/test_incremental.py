"""The streaming counter equals one-shot counting after every delta, for any split."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.tokens.incremental import IncrementalCounter
from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.registry import TokenizerRegistry
from extproc.tokens.text import clean_text
from tests.tokens.conftest import CORPUS_PATH

MODELS = {
    "o200k": "gpt-4o",
    "cl100k": "gpt-4",
    "sentencepiece": "mixtral-8x7b",
    "estimator": "unknown-model",
}

# Characters that stress BPE and pre-tokenizer boundaries: contractions, whitespace runs
# before newlines, digits (split in threes / singly), combining marks, ZWJ, CJK, emoji,
# non-breaking space, ligatures and lone / paired surrogates.
TRICKY = [
    "a",
    "b",
    "Z",
    "I",
    "'",
    "s",
    "re",
    "'re",
    "'S",
    "ll",
    "ve",
    " ",
    "  ",
    "\n",
    "\r",
    "\t",
    "\n\n",
    "0",
    "1",
    "9",
    ".",
    ",",
    "(",
    "}",
    "/",
    "_",
    "-",
    "é",
    "ж",
    "中",
    "の",
    "한",
    "😀",
    "👍🏽",
    "\u0301",
    "\u200d",
    "\u00a0",
    "ﬁ",
    "\ud83d",
    "\ude00",
    "<|endoftext|>",
]
# Deltas the way a model streams them (one token each): they take the counter's fast path
# whenever the previous text ends where a new piece must start.
TOKEN_DELTAS = [
    " the",
    "The",
    " 429",
    "42",
    ".",
    ",",
    ":",
    ":\n",
    "\n\n",
    " (",
    ")",
    " '",
    "'s",
    " I",
    "'m",
    " don",
    "'t",
    "   ",
    " ",
    "\t",
    "é",
    " 中文",
    "。",
    " 😀",
    "\ufffd",
    "x",
    "2",
]

text_strategy = st.one_of(
    st.lists(st.sampled_from(TRICKY), max_size=120).map("".join),
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
)


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def assert_exact_after_every_delta(tok: ModelTokenizer, chunks: list[str]) -> None:
    counter = IncrementalCounter(tok)
    fed = ""
    for chunk in chunks:
        total = counter.feed(chunk)
        fed += clean_text(chunk)  # normalisation is per delta (documented)
        assert total == tok.count(fed) == counter.total, (chunks, fed)


@pytest.fixture(scope="module", params=list(MODELS))
def tok(request: pytest.FixtureRequest, registry: TokenizerRegistry) -> ModelTokenizer:
    return registry.counter_for(MODELS[request.param])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=text_strategy, cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=40))
def test_random_splits_of_random_texts_count_like_one_shot(
    tok: ModelTokenizer, text: str, cuts: list[int]
) -> None:
    assert_exact_after_every_delta(tok, chunks_of(text, cuts))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(deltas=st.lists(st.sampled_from(TRICKY + TOKEN_DELTAS), max_size=60))
def test_random_sequences_of_token_like_deltas_count_like_one_shot(
    tok: ModelTokenizer, deltas: list[str]
) -> None:
    # Each delta is fed whole, so every pair of adjacent deltas meets at a delta boundary,
    # where the counter decides whether the text before is final.
    assert_exact_after_every_delta(tok, deltas)


def test_corpus_streamed_one_character_at_a_time_equals_one_shot(tok: ModelTokenizer) -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    counter = IncrementalCounter(tok)
    for ch in text:
        counter.feed(ch)
    assert counter.total == tok.count(text)


def test_corpus_streamed_in_real_token_deltas_equals_one_shot(
    registry: TokenizerRegistry,
) -> None:
    # The shape of an LLM stream: each delta is the text of one token.
    tok = registry.counter_for("gpt-4o")
    enc = tok.backend.encoding
    text = CORPUS_PATH.read_text(encoding="utf-8")
    deltas = [enc.decode([t]) for t in enc.encode_ordinary(text) if "\ufffd" not in enc.decode([t])]
    stream_text = "".join(deltas)
    for model in MODELS.values():
        assert_exact_after_every_delta(registry.counter_for(model), deltas)
        assert IncrementalCounter(registry.counter_for(model)).feed(stream_text) > 0


def test_empty_deltas_change_nothing(tok: ModelTokenizer) -> None:
    counter = IncrementalCounter(tok)
    assert counter.feed("") == 0
    first = counter.feed("Hello")
    assert counter.feed("") == first == counter.total


def test_surrogate_pair_split_across_deltas_counts_as_two_replacements(
    tok: ModelTokenizer,
) -> None:
    counter = IncrementalCounter(tok)
    counter.feed("x\ud83d")
    assert counter.feed("\ude00y") == tok.count("x\ufffd\ufffdy")


def _spy_on_counted_chars(counter: IncrementalCounter) -> Callable[[], int]:
    seen = [0]
    inner = counter._count  # type: ignore[attr-defined]

    def counting(text: str) -> int:
        seen[0] += len(text)
        return inner(text)

    counter._count = counting  # type: ignore[attr-defined]
    return lambda: seen[0]


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4", "mixtral-8x7b"])
def test_work_per_stream_is_linear_not_quadratic(registry: TokenizerRegistry, model: str) -> None:
    # Not a timing test: it measures how many characters reach the tokenizer. Re-tokenising
    # the whole text per delta would send ~n²/2 (≈ 10^9 here); a bounded tail sends O(n).
    tok = registry.counter_for(model)
    text = CORPUS_PATH.read_text(encoding="utf-8") * 20
    counter = IncrementalCounter(tok)
    counted = _spy_on_counted_chars(counter)
    for i in range(0, len(text), 3):
        counter.feed(text[i : i + 3])
    assert counter.total == tok.count(text)
    assert counted() < 40 * len(text)


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_work_stays_linear_after_a_giant_piece_is_finally_cut(
    registry: TokenizerRegistry, model: str
) -> None:
    # A long unbroken piece pushes the next cut attempt far out; once a space ends it, the
    # shorter text that follows (CJK with full stops: cuttable, but only by pieces) must
    # be looked at again soon, not only after it has grown as long as the giant piece.
    tok = registry.counter_for(model)
    giant, rest = "a" * 3000, " " + "中文。" * 1500
    counter = IncrementalCounter(tok)
    counted = _spy_on_counted_chars(counter)
    for i in range(0, len(giant), 3):
        counter.feed(giant[i : i + 3])
    giant_work = counted()
    for ch in rest:
        counter.feed(ch)
    assert counter.total == tok.count(giant + rest)
    assert counted() - giant_work < 200 * len(rest)


def test_unknown_tokenizer_kind_is_refused(registry: TokenizerRegistry) -> None:
    tok = registry.counter_for("gpt-4o")
    odd = ModelTokenizer(name="x", kind="tiktoken", family="openai", backend=tok.backend)
    odd.kind = "wordpiece"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no incremental strategy"):
        IncrementalCounter(odd)
