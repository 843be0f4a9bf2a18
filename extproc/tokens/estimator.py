"""Conservative token estimate for models whose tokenizer we do not have.

A character ratio is not a tokenizer, so the estimate is built to over-count, never to be
accurate: ``count = ceil(raw × safety_factor)`` where ``raw`` charges every character by
its script, using weights at or above the worst of the real tokenizers we ship (o200k,
cl100k and the Mistral SentencePiece model) on ``tests/tokens/corpus_mixed.txt``:

=========================================  ===========  ===========================================
character class                            raw tokens   why
=========================================  ===========  ===========================================
ASCII lower-case letter                    0.30         English runs at ~0.2-0.25 tokens/letter
ASCII upper-case letter                    0.60         capitals split more (acronyms, base64)
start of an ASCII letter run (a "word")    +0.70        a short word is still a whole token
lower→upper case change inside a word      +0.50        camelCase and base64 split at case changes
ASCII digit                                1.0          SentencePiece (Llama/Mistral) splits digits
start of a digit run                       +0.75        SentencePiece spends a "▁" before numbers
ASCII space                                0.25         usually merged into the following word
other ASCII whitespace (``\\n``, ``\\t``)     1.0          byte tokens in SentencePiece
ASCII punctuation / symbols (code, JSON)   1.0          at most one token per byte in every model
2-byte UTF-8 (Cyrillic, Greek, Arabic, é)  1.5          Mistral falls back to 2 bytes for Greek
CJK ideographs, kana, Hangul               2.0          cl100k/Mistral often need 2-3 per char
other 3-byte UTF-8 (Thai, Devanagari, ...)  3.0          one token per byte: byte-fallback bound
4-byte UTF-8 (emoji, rare CJK)             4.0          one token per byte: byte-fallback bound
=========================================  ===========  ===========================================

Weights are integers in milli-tokens so the estimate is exact arithmetic. Every term looks
at one character or at a pair of adjacent characters, so for a text split in two,
``raw(a + b) == raw(a) + raw(a[-1] + b) - raw(a[-1])``: the streaming counter adds texts
piece by piece with that identity and reaches exactly the one-shot estimate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Generator
from typing import Final

MILLI: Final = 1000

W_ASCII_LOWER: Final = 300
W_ASCII_UPPER: Final = 600
W_WORD_START: Final = 700
W_CASE_CHANGE: Final = 500
W_ASCII_DIGIT: Final = 1000
W_NUMBER_START: Final = 750
W_ASCII_SPACE: Final = 250
W_ASCII_OTHER_SPACE: Final = 1000
W_ASCII_PUNCT: Final = 1000
W_UTF8_2: Final = 1500
W_CJK: Final = 2000
W_UTF8_3: Final = 3000
W_UTF8_4: Final = 4000

DEFAULT_SAFETY_FACTOR: Final = 1.25

# ASCII bytes -> one class letter each, so counting is a handful of C-level bytes.count calls.
_CLASS_OF_BYTE = bytearray(b"P" * 256)
for _b in range(256):
    _ch = chr(_b)
    if _b >= 128:
        _CLASS_OF_BYTE[_b] = ord("N")
    elif _ch.isupper():
        _CLASS_OF_BYTE[_b] = ord("U")
    elif _ch.isalpha():
        _CLASS_OF_BYTE[_b] = ord("L")
    elif _ch.isdigit():
        _CLASS_OF_BYTE[_b] = ord("D")
    elif _ch == " ":
        _CLASS_OF_BYTE[_b] = ord("S")
    elif _ch.isspace():
        _CLASS_OF_BYTE[_b] = ord("W")
_ASCII_CLASS_TABLE: Final = bytes(_CLASS_OF_BYTE)
_LETTER_RUN: Final = re.compile(rb"[LU]+")
_DIGIT_RUN: Final = re.compile(rb"D+")

_UTF8_2: Final = re.compile("[\u0080-\u07ff]")
_UTF8_4: Final = re.compile("[\U00010000-\U0010ffff]")
# Han (incl. extension A, compatibility), kana, Hangul syllables and jamo, CJK punctuation.
_CJK: Final = re.compile(
    "[\u1100-\u11ff\u3000-\u303f\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)


def raw_millitokens(text: str) -> int:
    """Raw estimate of ``text`` in milli-tokens.

    Linear in ``len(text)`` with C-level passes only (a 1 MB prompt takes a few ms).
    """
    if not text:
        return 0
    if text.isascii():
        ascii_part = text.encode("ascii")
        non_ascii = ""
    else:
        ascii_part = text.encode("utf-8", "surrogatepass")
        non_ascii = text
    classes = ascii_part.translate(_ASCII_CLASS_TABLE)
    total = (
        classes.count(b"L") * W_ASCII_LOWER
        + classes.count(b"U") * W_ASCII_UPPER
        + len(_LETTER_RUN.findall(classes)) * W_WORD_START
        + classes.count(b"LU") * W_CASE_CHANGE
        + classes.count(b"D") * W_ASCII_DIGIT
        + len(_DIGIT_RUN.findall(classes)) * W_NUMBER_START
        + classes.count(b"S") * W_ASCII_SPACE
        + classes.count(b"W") * W_ASCII_OTHER_SPACE
        + classes.count(b"P") * W_ASCII_PUNCT
    )
    if non_ascii:
        # Multi-byte characters broke letter runs in ``classes`` only where a non-letter
        # stood, so runs are counted right; now charge the non-ASCII characters themselves.
        n2 = len(_UTF8_2.findall(non_ascii))
        n4 = len(_UTF8_4.findall(non_ascii))
        n_cjk = len(_CJK.findall(non_ascii))
        n_ascii = len(classes) - classes.count(b"N")
        n3 = len(text) - n_ascii - n2 - n4 - n_cjk
        total += n2 * W_UTF8_2 + n_cjk * W_CJK + n3 * W_UTF8_3 + n4 * W_UTF8_4
    return total


def millitokens_to_count(raw_milli: int, safety_factor: float) -> int:
    """``ceil(raw × safety_factor)`` done in integers so equal raw sums give equal counts."""
    factor_milli = round(safety_factor * MILLI)
    return -(-raw_milli * factor_milli // (MILLI * MILLI))


class TokenEstimator:
    """The tokenizer-shaped stand-in used when a model's real tokenizer is unavailable."""

    def __init__(self, safety_factor: float = DEFAULT_SAFETY_FACTOR) -> None:
        if not math.isfinite(safety_factor) or safety_factor < 1.0:
            raise ValueError(f"safety_factor must be a finite number >= 1.0, got {safety_factor}")
        self.safety_factor = safety_factor
        self.name = f"estimator(x{safety_factor:g})"

    def count(self, text: str) -> int:
        return millitokens_to_count(raw_millitokens(text), self.safety_factor)

    def count_large(self, text: str) -> int:
        return self.count(text)

    def count_steps(self, text: str, step_chars: int) -> Generator[None, None, int]:
        """``count(text)`` in slices of ``step_chars``, yielding between them.

        The estimate holds the GIL throughout (regex and bytes passes), so a thread would
        not spare the event loop; slices with a yield between them do. Exact by the pair
        identity in the module docstring: ``raw(a + b) = raw(a) + raw(a[-1] + b) - raw(a[-1])``.
        """
        raw = raw_millitokens(text[:step_chars])
        for start in range(step_chars, len(text), step_chars):
            yield
            last = text[start - 1]
            raw += raw_millitokens(text[start - 1 : start + step_chars]) - raw_millitokens(last)
        return millitokens_to_count(raw, self.safety_factor)
