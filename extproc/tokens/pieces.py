"""Where a tiktoken pre-tokenizer piece is certain to end, whatever text surrounds it.

tiktoken first splits text with its encoding's regex into pieces and runs BPE inside each
piece, so ``count(a + b) == count(a) + count(b)`` whenever the split of ``a + b`` is the
split of ``a`` followed by the split of ``b``. That holds when the pair ``(a[-1], b[0])``
can never sit inside one piece under the pattern, *and* ``a[-1]`` is not whitespace: the
only places the patterns look ahead (``\\s+(?!\\S)``, ``\\s+$``) end in whitespace, so
no piece of ``a`` is decided by what follows it. Pairs that qualify under both the o200k
and the cl100k pattern (checked against the alternatives one by one; tested exhaustively
over ASCII in tests/tokens/test_piece_boundaries.py):

* a letter, then a space, tab, newline, digit or punctuation other than ``'`` (o200k joins
  ``'s``, ``'re`` ... to the word before);
* a digit, then anything ASCII but a digit or ``'``;
* any non-whitespace character, then a space or tab (no alternative continues past a
  non-space into a space);
* ASCII punctuation, then a digit;
* a single space after a non-space (or at the start), then a digit: no alternative takes
  a space before a digit, so the space is a piece of its own either way.

Only ASCII is trusted on the right, and nothing but "not whitespace" is asked of a
non-ASCII character on the left: Python's Unicode tables may be older than those of the
Rust regex crate tiktoken uses, so a character Python calls unassigned could be a letter
or digit there. White_Space is stable, and ``str.isspace()`` is a superset of it.
"""

from __future__ import annotations

import string
from typing import Final

NOTHING: Final[frozenset[str]] = frozenset()
_BLANKS: Final = " \t"
_PUNCTUATION: Final = string.punctuation.replace("'", "")
_AFTER_LETTER: Final = frozenset(_BLANKS + "\r\n" + string.digits + _PUNCTUATION)
AFTER_DIGIT: Final = frozenset(_BLANKS + "\r\n" + string.ascii_letters + _PUNCTUATION)
_AFTER_SYMBOL: Final = frozenset(_BLANKS + string.digits)
_AFTER_NON_ASCII: Final = frozenset(_BLANKS)
_AFTER_LONE_SPACE: Final = frozenset(string.digits)
_AFTER_ASCII: Final[dict[str, frozenset[str]]] = {
    **dict.fromkeys(string.ascii_letters, _AFTER_LETTER),
    **dict.fromkeys(string.digits, AFTER_DIGIT),
    **dict.fromkeys(string.punctuation, _AFTER_SYMBOL),
}


def piece_starters_after(text: str) -> frozenset[str]:
    """Characters that, coming right after ``text``, always start a new piece.

    ``text`` must sit at the start of the whole text or right after a non-whitespace
    character at a piece boundary; that is what makes a lone leading space safe.
    """
    last = text[-1]
    starters = _AFTER_ASCII.get(last)
    if starters is not None:
        return starters
    if last == " ":
        return _AFTER_LONE_SPACE if len(text) == 1 or not text[-2].isspace() else NOTHING
    if last.isascii() or last.isspace():
        return NOTHING  # whitespace or control characters: lookaheads depend on them
    return _AFTER_NON_ASCII
