"""What a request will answer: how many tokens, which text, and why it stops.

Lengths follow the real simulator's documented rules (``docs/response_generation.md``):
with a token limit, a six-bucket histogram (exactly the limit with ``ignore_eos``); without
one, a Gaussian around 40 tokens bounded by the context left. Echo mode returns the prompt
and ignores limits, as the real one does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmsim.tokens import TokenCodec

SENTENCES: tuple[str, ...] = (
    "Today is a nice sunny day.",
    "The temperature here is twenty-five degrees centigrade.",
    "Today it is partially cloudy and raining.",
    "To be or not to be that is the question.",
    "Alas, poor Yorick! I knew him, Horatio: A fellow of infinite jest.",
    "The rest is silence.",
    "Give a man a fish and you feed him for a day;"
    " teach a man to fish and you feed him for a lifetime.",
    "I am fine, how are you today?",
    "I am not sure what the weather will be tomorrow.",
    "The sun rises in the east and sets in the west.",
    "Time flies like an arrow; fruit flies like a banana.",
    "All that glitters is not gold.",
)

_BUCKET_WEIGHTS = (20, 30, 20, 5, 10, 15)
_LARGE_LIMIT = 120
_FIXED_BUCKET = 20
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def _buckets(limit: int) -> list[tuple[int, int]]:
    """Inclusive token ranges of the six buckets for a limit."""
    if limit <= _LARGE_LIMIT:
        edges = [round(i * limit / 6) for i in range(7)]
    else:
        sizes = [_FIXED_BUCKET] * 3 + [limit - 5 * _FIXED_BUCKET] + [_FIXED_BUCKET] * 2
        edges = [0]
        for size in sizes:
            edges.append(edges[-1] + size)
    return [(edges[i] + 1, edges[i + 1]) for i in range(6)]


def sample_length(
    max_tokens: int | None, ignore_eos: bool, context_left: int, rng: random.Random
) -> int:
    """Number of output tokens for a random-mode answer."""
    if max_tokens is not None:
        if ignore_eos:
            return max_tokens
        buckets = [(b, w) for b, w in zip(_buckets(max_tokens), _BUCKET_WEIGHTS, strict=True)]
        usable = [(b, w) for b, w in buckets if b[0] <= b[1]]
        (low, high) = rng.choices([b for b, _ in usable], [w for _, w in usable])[0]
        return rng.randint(low, high)
    limit = max(1, context_left)
    if ignore_eos:
        return limit
    if limit < 20:
        return rng.randint(1, limit)
    return min(limit, max(1, round(rng.gauss(40, 20))))


@dataclass(frozen=True, slots=True)
class Answer:
    """The planned output: token-aligned pieces (one per token) and the finish reason."""

    pieces: list[str]
    finish_reason: str

    @property
    def completion_tokens(self) -> int:
        return len(self.pieces)


def plan_answer(
    codec: TokenCodec,
    mode: str,
    echo_text: str,
    max_tokens: int | None,
    ignore_eos: bool,
    context_left: int,
    rng: random.Random,
) -> Answer:
    if mode == "echo":
        return Answer(codec.echo_pieces(echo_text), FINISH_STOP)
    n = sample_length(max_tokens, ignore_eos, context_left, rng)
    limit = max_tokens if max_tokens is not None else max(1, context_left)
    reason = FINISH_LENGTH if n >= limit else FINISH_STOP
    return Answer(codec.random_pieces(n, rng), reason)


def group_pieces(pieces: list[str], per_chunk: int) -> list[tuple[str, int]]:
    """SSE event payloads as (text, tokens); tokens with no text of their own join the next."""
    groups: list[tuple[str, int]] = []
    carried = 0
    for start in range(0, len(pieces), per_chunk):
        part = pieces[start : start + per_chunk]
        text = "".join(part)
        if not text:
            carried += len(part)
            continue
        groups.append((text, len(part) + carried))
        carried = 0
    if carried:
        if groups:
            text, count = groups[-1]
            groups[-1] = (text, count + carried)
        else:
            groups.append(("", carried))
    return groups
