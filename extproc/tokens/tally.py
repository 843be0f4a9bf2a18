"""The summed token count of many separate texts, with as few tokenizer calls as possible.

A chat request is dozens to thousands of short texts (roles, contents, names, tool-call
arguments), each counted on its own. Every call into tiktoken has a fixed cost, so for
tiktoken the texts are joined with a separator that provably keeps them apart (see
``extproc.tokens.pieces``) and counted with one call:

    count(t1 + " 0" + t2 + " 0" + ... + tn) == Σ count(ti) + (n - 1) × count(" 0")

when every ``ti`` ends with a non-whitespace character (so the space starts a piece) and
starts with an ASCII character that ends a digit run (so the ``0`` is a piece of its own
and ``ti`` starts afresh); the lone space before ``0`` is a piece too. Texts that do not
qualify (a code block ending in ``\\n``, a message starting with a CJK character) are
counted alone; the sum is the same either way, only the number of calls differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.pieces import AFTER_DIGIT

SEPARATOR: Final = " 0"


class TokenTally:
    """``add`` texts, then read ``total()``: the sum of their separate token counts."""

    __slots__ = ("_count", "_joinable", "_separator_tokens", "_sum")

    def __init__(self, tok: ModelTokenizer) -> None:
        self._count: Callable[[str], int] = tok.count
        self._sum = 0
        self._joinable: list[str] | None = [] if tok.kind == "tiktoken" else None
        self._separator_tokens = 0
        if self._joinable is not None:
            self._separator_tokens = tok.cached_delta_count(SEPARATOR, tok.count)

    def add(self, text: str) -> None:
        if not text:
            return
        joinable = self._joinable
        if joinable is not None and text[0] in AFTER_DIGIT and not text[-1].isspace():
            joinable.append(text)
        else:
            self._sum += self._count(text)

    def total(self) -> int:
        joinable = self._joinable
        if not joinable:
            return self._sum
        joined = self._count(SEPARATOR.join(joinable))
        return self._sum + joined - (len(joinable) - 1) * self._separator_tokens
