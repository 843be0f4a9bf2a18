"""The estimator over-counts on purpose: never below any real tokenizer on the corpus."""

from __future__ import annotations

import math

import pytest

from extproc.tokens.encodings import load_tokenizer
from extproc.tokens.estimator import (
    DEFAULT_SAFETY_FACTOR,
    TokenEstimator,
    millitokens_to_count,
    raw_millitokens,
)

REAL = ("o200k_base", "cl100k_base", "mistral-7b-v0.1.sentencepiece.model")


def _max_real(text: str) -> int:
    return max(load_tokenizer(spec).count(text) for spec in REAL)


def test_estimate_is_never_below_a_real_tokenizer_on_any_corpus_line(
    corpus_lines: list[str],
) -> None:
    estimator = TokenEstimator()
    under = [
        (line[:40], estimator.count(line), _max_real(line))
        for line in corpus_lines
        if estimator.count(line) < _max_real(line)
    ]
    assert under == []


def test_estimate_is_never_below_a_real_tokenizer_on_the_whole_corpus_and_windows(
    corpus_lines: list[str],
) -> None:
    estimator = TokenEstimator()
    whole = "\n".join(corpus_lines)
    assert estimator.count(whole) >= _max_real(whole)
    # Arbitrary windows cut words and lines in the middle.
    for start in range(0, len(whole) - 200, 97):
        window = whole[start : start + 200]
        assert estimator.count(window) >= _max_real(window), window


def test_raw_estimate_alone_already_covers_the_corpus_within_the_safety_margin(
    corpus_lines: list[str],
) -> None:
    # The safety factor is a margin on top of script weights that are already close to the
    # worst real tokenizer, not the thing that makes the estimate work.
    worst = max(_max_real(line) * 1000 / raw_millitokens(line) for line in corpus_lines)
    assert worst < DEFAULT_SAFETY_FACTOR


def test_count_is_ceil_of_raw_times_safety_factor() -> None:
    text = "Привет, world 123 你好 😀"
    raw = raw_millitokens(text)
    for factor in (1.0, 1.1, 1.25, 2.0):
        assert TokenEstimator(factor).count(text) == math.ceil(raw * factor / 1000)
    assert millitokens_to_count(1, 1.0) == 1  # any text at all is at least one token
    assert TokenEstimator().count("") == 0


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan"), float("inf")])
def test_safety_factor_below_one_or_not_finite_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="safety_factor"):
        TokenEstimator(bad)


def test_script_weights_rank_scripts_by_real_cost() -> None:
    # Same character count, very different real costs: the estimate must follow.
    latin, cyrillic, cjk, emoji = "abcdefgh", "абвгдежз", "你好世界你好世界", "😀😃😄😁😆😅😂🤣"
    assert raw_millitokens(latin) < raw_millitokens(cyrillic) < raw_millitokens(cjk)
    assert raw_millitokens(cjk) < raw_millitokens(emoji)


def test_raw_estimate_is_additive_across_any_split_given_the_previous_character() -> None:
    text = "fooBar 12 34\n你好 Ωmega😀x'y"
    for cut in range(1, len(text)):
        left, right = text[:cut], text[cut:]
        joined = raw_millitokens(left) + raw_millitokens(left[-1] + right)
        assert joined - raw_millitokens(left[-1]) == raw_millitokens(text)
