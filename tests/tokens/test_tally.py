"""Summing many texts' token counts through TokenTally gives exactly the per-text sum."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.registry import TokenizerRegistry
from extproc.tokens.tally import TokenTally

MODELS = ["gpt-4o", "gpt-4", "mixtral-8x7b", "unknown-model"]
FRAGMENTS = [
    "user",
    "assistant",
    "Hello",
    " world",
    ".",
    "\n",
    "  ",
    "0",
    "12",
    "'s",
    '{"a": 1}',
    "中文",
    "😀",
    "é",
    "\u0301",
    "\t",
    " 0",
    "x ",
    "<|endoftext|>",
    "\ud83d",
    "\ude00",
]
texts = st.lists(
    st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=8).map("".join), st.text(max_size=40)),
    max_size=30,
)


@pytest.fixture(scope="module", params=MODELS)
def tok(request: pytest.FixtureRequest, registry: TokenizerRegistry) -> ModelTokenizer:
    return registry.counter_for(request.param)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(items=texts)
def test_tally_equals_the_sum_of_separate_counts(tok: ModelTokenizer, items: list[str]) -> None:
    tally = TokenTally(tok)
    for text in items:
        tally.add(text)
    assert tally.total() == sum(tok.count(text) for text in items)


def test_joinable_texts_cost_one_tokenizer_call(registry: TokenizerRegistry) -> None:
    tok = registry.counter_for("gpt-4o")
    calls: list[str] = []
    counted = ModelTokenizer(name=tok.name, kind=tok.kind, family=tok.family, backend=tok.backend)
    counted.count = lambda text: calls.append(text) or tok.count(text)  # type: ignore[method-assign]
    tally = TokenTally(counted)
    items = [f"Message {i} says hello." for i in range(500)] + ["code:\n", "中文"]
    for text in items:
        tally.add(text)
    assert tally.total() == sum(tok.count(text) for text in items)
    # One call for the 500 joinable texts, one each for the two that are not (a trailing
    # newline; a first character outside ASCII); the separator count is memoised.
    assert len([c for c in calls if c != " 0"]) == 3
