"""Exact running token count of a streamed completion, fed one text delta at a time.

``IncrementalCounter(tok).feed(delta)`` returns the token count of *all text fed so far*,
equal to ``tok.count("".join(deltas))`` at every call, and ``.total`` holds the same.
Text is normalised per delta (lone surrogates -> U+FFFD, see ``extproc.tokens.text``), so
a surrogate pair split across two deltas counts as two replacement characters.

Why this is exact without re-tokenising everything: the text is kept as a *committed*
prefix, whose count is final, and a short *tail*, re-counted on every call. The cut between
them is always placed where no future text can change the tokens on its left:

* tiktoken (byte-level BPE): tokens never cross the encoding's regex pre-tokenizer pieces,
  and appending text can only change the last two pieces (e.g. o200k re-reads ``I'r`` as
  ``I're`` once ``e`` arrives; a whitespace run followed by a newline regroups). The tail
  is therefore the last ``KEEP_PIECES`` pieces, and the committed part is priced in
  context as ``count(buffer) - count(tail)`` (alone, its last piece would see end-of-text
  where it really sees the tail's first character). Fast path: a delta that starts with an
  ASCII space/punctuation/newline after an ASCII letter or digit always starts a new piece
  (no pattern lets such a character join a letter or digit run), so the old tail is
  committed as is and the delta's count comes from a shared cache. Cost per call is O(tail);
  the tail is the last couple of words for ordinary text, but a single giant piece (10k
  letters without a break) is re-counted on every delta.
* SentencePiece (Mistral v1): the vocabulary has no piece with ``▁`` after another
  character and none containing ``\\n``, so merges never cross "non-space | space" or
  either side of a newline. The tail starts at the last such cut; it is counted as
  ``encode(tail[1:])`` after a space cut (the model's dummy prefix supplies that ``▁``) and
  as ``encode("\\n" + tail) - 2`` after a newline cut. Text with neither (long CJK runs)
  keeps a growing tail: exact, but O(run length) per call.
* Estimator: every term looks at one character or an adjacent pair, so adding
  ``raw(last_char + delta) - raw(last_char)`` is exactly additive; O(len(delta)) per call.
"""

from __future__ import annotations

from typing import Final

import regex

from extproc.tokens.estimator import millitokens_to_count, raw_millitokens
from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.text import clean_text

KEEP_PIECES: Final = 3  # two can change (see module docstring); one more as margin
COMMIT_AFTER_CHARS: Final = 64  # look for a cut once the tail is this long
CACHED_DELTA_CHARS: Final = 32  # longer deltas are rarely repeated; count them directly

_ASCII_ALNUM: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
# ASCII characters that can never extend a piece ending in an ASCII letter or digit. The
# apostrophe is excluded: o200k attaches "'s", "'re", ... to the preceding letters.
_PIECE_BREAKERS: Final = frozenset(" \t\n\r!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~")


def _normalise(delta: str) -> str:
    return delta if delta.isascii() else clean_text(delta)


class IncrementalCounter:
    """Running exact token count of streamed text; ``IncrementalCounter(tok)`` picks the
    strategy for ``tok.kind`` (see the module docstring). One instance per stream."""

    total: int

    def __new__(cls, tok: ModelTokenizer) -> IncrementalCounter:
        if cls is IncrementalCounter:
            strategy = _STRATEGIES.get(tok.kind)
            if strategy is None:
                raise ValueError(f"no incremental strategy for tokenizer kind {tok.kind!r}")
            return super().__new__(strategy)
        return super().__new__(cls)

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok
        self.total = 0

    def feed(self, delta: str) -> int:
        """Add ``delta``; return the exact token count of everything fed so far."""
        raise NotImplementedError


class _BpeCounter(IncrementalCounter):
    def __init__(self, tok: ModelTokenizer) -> None:
        super().__init__(tok)
        backend = tok.backend
        self._count = backend.count
        self._split = regex.compile(backend.encoding._pat_str).findall
        self._cache = tok.delta_counts
        self._cached_count = tok.cached_delta_count
        self._committed = 0
        self._tail = ""
        self._tail_count = 0

    def feed(self, delta: str) -> int:
        if not delta:
            return self.total
        if not delta.isascii():
            delta = clean_text(delta)
        tail = self._tail
        if tail and tail[-1] in _ASCII_ALNUM and delta[0] in _PIECE_BREAKERS:
            # Fast path: a piece boundary sits exactly between tail and delta.
            if len(delta) <= CACHED_DELTA_CHARS:
                n = self._cache.get(delta)
                if n is None:
                    n = self._cached_count(delta, self._count)
            else:
                n = self._count(delta)
            self._committed += self._tail_count
            self._tail = delta
            self._tail_count = n
            self.total = total = self._committed + n
            return total
        buf = tail + delta
        n = self._count(buf)
        if len(buf) > COMMIT_AFTER_CHARS:
            pieces = self._split(buf)
            if len(pieces) > KEEP_PIECES:
                keep = sum(len(p) for p in pieces[-KEEP_PIECES:])
                kept = buf[-keep:]
                kept_count = self._count(kept)
                # The committed part is priced in context (count(buf) - count(kept)), not
                # alone: standalone, its last piece would see end-of-text instead of the
                # next character ("a  " is one token alone but " " + " " before "0").
                self._committed += n - kept_count
                buf, n = kept, kept_count
        self._tail = buf
        self._tail_count = n
        self.total = total = self._committed + n
        return total


_NEWLINE_PREFIX_TOKENS: Final = 2  # encode("\n") == ["▁", "<0x0A>"] with the dummy prefix


class _SentencePieceCounter(IncrementalCounter):
    # How the tail was cut off from the committed text decides how it is counted.
    _START, _AFTER_SPACE, _AFTER_NEWLINE = 0, 1, 2

    def __init__(self, tok: ModelTokenizer) -> None:
        super().__init__(tok)
        self._count = tok.backend.count
        self._cached_count = tok.cached_delta_count
        self._committed = 0
        self._tail = ""
        self._tail_mode = self._START
        self._tail_count = 0

    def _count_tail(self, tail: str, mode: int) -> int:
        if mode == self._AFTER_SPACE:
            return self._count(tail[1:])
        if mode == self._AFTER_NEWLINE:
            return self._count("\n" + tail) - _NEWLINE_PREFIX_TOKENS
        return self._count(tail)

    @staticmethod
    def _last_cut(buf: str) -> tuple[int, int]:
        """(index, mode) of the rightmost safe cut with text after it, or (0, _START)."""
        end = len(buf) - 1
        space = buf.rfind(" ", 1, end)  # a space cut needs text after the space
        while space > 0 and buf[space - 1] == " ":
            space = buf.rfind(" ", 1, space)
        newline = buf.rfind("\n", 0, end) + 1  # cut right after the newline
        if space <= 0 and newline <= 0:
            return 0, _SentencePieceCounter._START
        if space >= newline:
            return space, _SentencePieceCounter._AFTER_SPACE
        return newline, _SentencePieceCounter._AFTER_NEWLINE

    def feed(self, delta: str) -> int:
        if not delta:
            return self.total
        if not delta.isascii():
            delta = clean_text(delta)
        tail = self._tail
        if tail and delta[0] == " " and len(delta) > 1 and tail[-1] != " ":
            # Fast path: "word| next" is a cut; the delta alone is the new tail.
            if len(delta) <= CACHED_DELTA_CHARS:
                n = self._cached_count(delta[1:], self._count)
            else:
                n = self._count(delta[1:])
            self._committed += self._tail_count
            self._tail, self._tail_mode, self._tail_count = delta, self._AFTER_SPACE, n
            self.total = total = self._committed + n
            return total
        buf = tail + delta
        mode = self._tail_mode
        cut, cut_mode = self._last_cut(buf)
        if cut > 0:
            self._committed += self._count_tail(buf[:cut], mode)
            buf, mode = buf[cut:], cut_mode
        self._tail, self._tail_mode = buf, mode
        self._tail_count = n = self._count_tail(buf, mode)
        self.total = total = self._committed + n
        return total


class _EstimatorCounter(IncrementalCounter):
    def __init__(self, tok: ModelTokenizer) -> None:
        super().__init__(tok)
        self._safety_factor = tok.backend.safety_factor
        # Shared memo of raw_millitokens(last_char + delta) for short deltas.
        self._cache = tok.delta_counts
        self._cached_count = tok.cached_delta_count
        self._raw = 0
        self._last_char = ""
        self._last_char_raw = 0

    def feed(self, delta: str) -> int:
        if not delta:
            return self.total
        delta = _normalise(delta)
        key = self._last_char + delta
        if len(key) <= CACHED_DELTA_CHARS:
            step = self._cache.get(key)
            if step is None:
                step = self._cached_count(key, raw_millitokens)
        else:
            step = raw_millitokens(key)
        self._raw += step - self._last_char_raw
        self._last_char = delta[-1]
        self._last_char_raw = raw_millitokens(self._last_char)
        self.total = millitokens_to_count(self._raw, self._safety_factor)
        return self.total


_STRATEGIES: Final[dict[str, type[IncrementalCounter]]] = {
    "tiktoken": _BpeCounter,
    "sentencepiece": _SentencePieceCounter,
    "estimator": _EstimatorCounter,
}
