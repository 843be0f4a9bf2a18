"""The summed token count of many separate texts, with as few tokenizer calls as possible.

A chat request is dozens to thousands of short texts (roles, contents, names, tool-call
arguments), each counted on its own. Every call into tiktoken has a fixed cost, so for
tiktoken the short texts are joined with a separator that provably keeps them apart (see
``extproc.tokens.pieces``) and counted with one call:

    count(t1 + " 0" + t2 + " 0" + ... + tn) == Σ count(ti) + (n - 1) × count(" 0")

when every ``ti`` ends with a non-whitespace character (so the space starts a piece) and
starts with an ASCII character that ends a digit run (so the ``0`` is a piece of its own
and ``ti`` starts afresh); the lone space before ``0`` is a piece too. Texts that do not
qualify (a code block ending in ``\\n``, a message starting with a CJK character) and long
ones (``JOIN_MAX_CHARS``) are counted alone; the sum is the same either way, only the
number of calls differs.

Texts are only collected by ``add``; the tokenizer runs when the total is asked for, so
admission can decide from ``chars`` where a big prompt is counted: ``total()`` here and now,
``total_large()`` in a worker thread (the GIL-releasing count), ``total_steps()`` in slices
with yields between them (for the estimator, which holds the GIL). All three give the
same number.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Final

from extproc.tokens.estimator import TokenEstimator
from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.pieces import AFTER_DIGIT

SEPARATOR: Final = " 0"
# Longer texts are counted alone: joining saves a call's fixed cost (~1 µs), nothing on a
# long text, and would copy it into a new string whose UTF-8 form tiktoken must build under
# the GIL (~3 ms per MiB), where the text itself already has one from the re-serialising.
JOIN_MAX_CHARS: Final = 1024


class TokenTally:
    """``add`` texts, then read ``total()``: the sum of their separate token counts."""

    __slots__ = ("_alone", "_joinable", "_separator_tokens", "_tok", "chars")

    def __init__(self, tok: ModelTokenizer) -> None:
        self._tok = tok
        self._alone: list[str] = []  # counted one call each
        self._joinable: list[str] | None = [] if tok.kind == "tiktoken" else None
        self._separator_tokens = 0
        if self._joinable is not None:
            self._separator_tokens = tok.cached_delta_count(SEPARATOR, tok.count)
        self.chars = 0  # characters the tokenizer will read, separators aside

    def add(self, text: str) -> None:
        if not text:
            return
        self.chars += len(text)
        joinable = self._joinable
        if (
            joinable is not None
            and len(text) <= JOIN_MAX_CHARS
            and text[0] in AFTER_DIGIT
            and not text[-1].isspace()
        ):
            joinable.append(text)
        else:
            self._alone.append(text)

    def total(self) -> int:
        return self._sum(self._tok.count)

    def total_large(self) -> int:
        """``total()`` with the backend's count for big texts: what a worker thread runs."""
        return self._sum(self._tok.count_large)

    def _sum(self, count: Callable[[str], int]) -> int:
        total = 0
        for text in self._alone:
            total += count(text)
        joinable = self._joinable
        if joinable:
            total += count(SEPARATOR.join(joinable))
            total -= (len(joinable) - 1) * self._separator_tokens
        return total

    def total_steps(self, step_chars: int) -> Generator[None, None, int]:
        """``total()``, yielding after about every ``step_chars`` characters counted.

        For the estimator only (its texts are never joined): a text longer than a step is
        estimated in slices (``TokenEstimator.count_steps``, exact).
        """
        estimator = self._tok.backend
        if not isinstance(estimator, TokenEstimator) or self._joinable is not None:
            raise TypeError("total_steps is for the estimator's tallies")
        total = 0
        pending = 0  # characters counted since the last yield
        for text in self._alone:
            if len(text) > step_chars:
                total += yield from estimator.count_steps(text, step_chars)
                pending = 0
            else:
                total += estimator.count(text)
                pending += len(text)
            if pending >= step_chars:
                pending = 0
                yield
        return total
