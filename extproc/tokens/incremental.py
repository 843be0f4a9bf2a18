"""Exact running token count of a streamed completion, fed one text delta at a time.

``IncrementalCounter(tok).feed(delta)`` returns the token count of *all text fed so far*,
equal to ``tok.count("".join(deltas))`` at every call, and ``.total`` holds the same.
Text is normalised per delta (lone surrogates -> U+FFFD, see ``extproc.tokens.text``), so
a surrogate pair split across two deltas counts as two replacement characters.

Why this is exact without re-tokenising everything: the text is kept as a *committed*
prefix, whose count is final, and a short *tail*, re-counted on every call. The cut between
them is always placed where no future text can change the tokens on its left:

* tiktoken (byte-level BPE): tokens never cross the encoding's regex pre-tokenizer pieces,
  and some adjacent character pairs always sit on a piece boundary whatever surrounds
  them (``extproc.tokens.pieces``: a letter then a space, a digit then a letter, ...).
  When a delta starts with such a character the old tail is committed as is and the
  delta becomes the tail; short deltas (" the", ".", "\\n") come from a shared memo,
  so the common call is one dict hit and a few stores. Otherwise the tail
  and delta are counted together; once the tail is long it is cut at its last
  "non-space | space" pair, or, failing that, before its last ``KEEP_PIECES`` pieces
  (appending text can only change the last two: o200k re-reads ``I'r`` as ``I're`` once
  ``e`` arrives; a whitespace run followed by a newline regroups), the committed part
  being priced in context as ``count(buffer) - count(kept)``. Cost per call is O(tail);
  the tail is the last word or so for ordinary text, but a single giant piece (10k
  letters, a CJK sentence without punctuation) is re-counted on every delta.
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

from collections.abc import Callable
from functools import lru_cache
from typing import Final

import regex

from extproc.tokens.encodings import TiktokenTokenizer
from extproc.tokens.estimator import TokenEstimator, millitokens_to_count, raw_millitokens
from extproc.tokens.model_tokenizer import DELTA_CACHE_LIMIT, ModelTokenizer
from extproc.tokens.pieces import NOTHING, piece_starters_after
from extproc.tokens.text import clean_text

KEEP_PIECES: Final = 3  # two can change (see module docstring); one more as margin
COMMIT_AFTER_CHARS: Final = 64  # look for a cut once the tail has grown this much
CACHED_DELTA_CHARS: Final = 32  # longer deltas are rarely repeated; count them directly


@lru_cache(maxsize=8)
def _piece_splitter(pattern: str) -> Callable[[str], list[str]]:
    return regex.compile(pattern).findall


# The rightmost non-space character followed by a space: a cut that is always safe.
_LAST_WORD_END: Final = regex.compile(r"(?r)\S(?= )")


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
        if not isinstance(backend, TiktokenTokenizer):  # picked by kind: "tiktoken"
            raise TypeError(f"{tok.name}: BPE counting needs a tiktoken encoding")
        self._count = backend.count
        self._split = _piece_splitter(backend.encoding._pat_str)
        self._known = tok.piece_deltas
        self._tail = ""
        self._tail_count = 0
        # Characters that, starting the next delta, begin a new piece: at the very start
        # anything does, but the first delta is rare enough to go the general way.
        self._starters = NOTHING
        self._cut_at = COMMIT_AFTER_CHARS  # tail length at which to look for a cut

    def feed(self, delta: str) -> int:
        # Hot path, once per SSE event: a known delta (so already clean) that starts a new
        # piece. The old tail's count is final; the delta becomes the tail.
        known = self._known.get(delta)
        if known is not None and delta[0] in self._starters:
            n, self._starters = known
            self._tail = delta
            self._tail_count = n
            self.total = total = self.total + n
            return total
        return self._feed_general(delta)

    def _feed_general(self, delta: str) -> int:
        if not delta:
            return self.total
        if not delta.isascii():
            delta = clean_text(delta)
        committed = self.total - self._tail_count
        if delta[0] in self._starters:
            committed += self._tail_count
            buf = delta
        else:
            tail = self._tail
            if len(tail) < self._cut_at - COMMIT_AFTER_CHARS:
                # Shorter than what the last look left: the tail was replaced since (a
                # new piece began), so measure growth from here, not from a giant piece.
                self._cut_at = len(tail) + COMMIT_AFTER_CHARS
            buf = tail + delta
        # Short tails repeat too (" wor" + "d" when text arrives a character at a time):
        # the memo answers those as well, since an entry depends on the text alone.
        known = self._known.get(buf) if len(buf) <= CACHED_DELTA_CHARS else None
        starters: frozenset[str] | None
        if known is not None:
            n, starters = known
        else:
            n = self._count(buf)
            starters = self._remember(buf, n) if len(buf) <= CACHED_DELTA_CHARS else None
            if len(buf) >= self._cut_at:
                cut = self._safe_cut(buf)
                if cut:
                    kept = buf[cut:]
                    kept_count = self._count(kept)
                    # The committed part is priced in context (count(buf) - count(kept)),
                    # not alone: standalone, its last piece would see end-of-text instead
                    # of the next character ("a  " is one token alone but " " + " "
                    # before "0").
                    committed += n - kept_count
                    buf, n = kept, kept_count
                # Amortise: the next look is another COMMIT_AFTER_CHARS of growth away,
                # so a tail that cannot be cut (one giant piece) is not re-split on
                # every delta.
                self._cut_at = len(buf) + COMMIT_AFTER_CHARS
                starters = None
            if starters is None:
                starters = piece_starters_after(buf)
        self._tail = buf
        self._tail_count = n
        self._starters = starters
        self.total = total = committed + n
        return total

    def _safe_cut(self, buf: str) -> int:
        """Index before which ``buf`` can be committed, or 0 if there is none yet."""
        word_end = _LAST_WORD_END.search(buf)
        if word_end is not None and not buf[word_end.start()].isspace():
            return word_end.end()  # "non-space | space" is a piece boundary (see above)
        pieces = self._split(buf)
        if len(pieces) <= KEEP_PIECES:
            return 0
        return len(buf) - sum(len(p) for p in pieces[-KEEP_PIECES:])

    def _remember(self, text: str, n: int) -> frozenset[str]:
        known = self._known
        if len(known) >= DELTA_CACHE_LIMIT:
            known.clear()  # crude but bounded; refills with what is hot
        starters = piece_starters_after(text)
        known[text] = (n, starters)
        return starters


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
        backend = tok.backend
        if not isinstance(backend, TokenEstimator):  # picked by kind: "estimator"
            raise TypeError(f"{tok.name}: estimated counting needs the estimator")
        self._safety_factor = backend.safety_factor
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
        self._last_char = last = delta[-1]
        raw_last = self._cache.get(last)  # one character: always worth the memo
        if raw_last is None:
            raw_last = self._cached_count(last, raw_millitokens)
        self._last_char_raw = raw_last
        self.total = total = millitokens_to_count(self._raw, self._safety_factor)
        return total


_STRATEGIES: Final[dict[str, type[IncrementalCounter]]] = {
    "tiktoken": _BpeCounter,
    "sentencepiece": _SentencePieceCounter,
    "estimator": _EstimatorCounter,
}
