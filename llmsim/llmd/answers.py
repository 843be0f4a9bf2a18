"""Random answers as v0.10.2 builds them: how many tokens, which ones, and the finish reason.

Length: ``ignore_eos`` gives exactly the limit; with ``max_tokens`` a histogram in which the
last bucket is the limit itself (15%); without one, a Gaussian (mean 40, sd 20) redrawn
until it fits the context left. ``finish_reason`` is ``length`` exactly when the answer has
the limit's length. Text: whole stock sentences, each split with the dummy tokenizer, drawn
at random until the length is reached (the last one cut), so every token carries the
whitespace after it ("Today " is one token).

The sentences are llmsim's own: the same shape as the real ones (eleven, each ending in a
space, one dense with punctuation, two without a full stop) and about the same count per
o200k token, not the same words. Echo answers are the dummy tokens of the last message
(chat, without its role) or of the prompt.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from llmsim.llmd.tokenizer import split

STOCK_SENTENCES: tuple[str, ...] = (
    "Probe#7: {alpha=2; beta=3} & (x+y)*z / 4 ~ 5 @ host? <ok> [a-b] ! $1 ^ % \\ . ",
    "Checking, checking 4,5,6. ",
    "All good here, and how is your week going? ",
    "I am a simulated model, what would you like to know about? ",
    "The garden looks bright and green this morning. ",
    "The thermometer reads nineteen degrees by noon. ",
    "Tonight it may turn windy with some light showers. ",
    "A long journey begins with one small step. ",
    "Hark, Marcellus! The watch is set: midnight upon the rampart ",
    "Silence fell over the hall. ",
    "Plant a seed and you wait a season; plant a forest and you wait for a generation ",
)
STOCK_TOKENS: tuple[tuple[str, ...], ...] = tuple(tuple(split(s)) for s in STOCK_SENTENCES)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_TOOLS = "tool_calls"

# Bucket probabilities of the length histogram; the last bucket is the limit alone.
_BUCKET_P = (0.2, 0.3, 0.2, 0.05, 0.1, 0.15)
_CUMULATIVE = tuple(itertools.accumulate(_BUCKET_P))
_FLEX_BUCKET = 3  # the bucket that stretches when the limit is large
_FIXED_SIZE = 20  # size of every other bucket then
_MEAN, _STD_DEV = 40, 20


def _bucket_bounds(limit: int, index: int) -> tuple[int, int]:
    buckets = len(_BUCKET_P)
    if limit <= _FIXED_SIZE * (buckets - 1) + 1:
        size = (limit - 1) / (buckets - 1)
        start, end = int(size * index) + 1, int(size * (index + 1))
    else:
        flex = limit - _FIXED_SIZE * (buckets - 2)
        if index < _FLEX_BUCKET:
            start, end = _FIXED_SIZE * index + 1, _FIXED_SIZE * (index + 1)
        elif index == _FLEX_BUCKET:
            start, end = _FIXED_SIZE * index + 1, _FIXED_SIZE * index + flex
        else:
            start, end = _FIXED_SIZE * (index - 1) + flex + 1, _FIXED_SIZE * index + flex
    end = min(end, limit - 1)  # the limit itself is the last bucket's
    return start, max(start, end)


def histogram_length(limit: int, rng: random.Random) -> int:
    """Answer length for a request with ``max_tokens`` = ``limit``."""
    if limit <= 1:
        return limit
    if limit <= len(_BUCKET_P):
        return rng.randint(1, limit)
    r = rng.random()
    if r > _CUMULATIVE[-2]:
        return limit
    index = next((i for i, c in enumerate(_CUMULATIVE) if r <= c), len(_BUCKET_P) - 1)
    start, end = _bucket_bounds(limit, index)
    return rng.randint(start, end)


def gaussian_length(context_left: int, rng: random.Random) -> int:
    """Answer length without a limit: redrawn until within [1, context left], then rounded."""
    if context_left < 1:
        # The real one redraws for ever here (the request never answers); answer 1 token.
        return 1
    while True:
        value = rng.gauss(_MEAN, _STD_DEV)
        if 1 <= value <= context_left:
            return math.floor(value + 0.5)  # Go's math.Round: halves away from zero


def stock_tokens(n: int, rng: random.Random) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        out.extend(rng.choice(STOCK_TOKENS)[: n - len(out)])
    return out


@dataclass(frozen=True, slots=True)
class TextAnswer:
    tokens: list[str]
    finish_reason: str


def random_answer(
    max_tokens: int | None, ignore_eos: bool, context_left: int, rng: random.Random
) -> TextAnswer:
    limit = max_tokens if max_tokens is not None else context_left
    if ignore_eos:
        n = limit
    elif max_tokens is not None:
        n = histogram_length(max_tokens, rng)
    else:
        n = gaussian_length(context_left, rng)
    reason = FINISH_LENGTH if n == limit else FINISH_STOP
    return TextAnswer(stock_tokens(n, rng), reason)


def echo_answer(tokens: list[str], max_tokens: int | None) -> TextAnswer:
    """The prompt's tokens back, whole; ``length`` when they reach ``max_tokens``."""
    reason = FINISH_LENGTH if max_tokens is not None and len(tokens) >= max_tokens else FINISH_STOP
    return TextAnswer(tokens, reason)
