"""The piece boundaries the fast paths rely on hold for the real tokenizers.

``extproc.tokens.pieces`` claims that after certain characters certain others always
start a new tiktoken piece, so ``count(a + b) == count(a) + count(b)`` whatever surrounds
them; the streaming counter commits text and the prompt tally joins texts on that claim.
Here it is checked against the real encodings: exhaustively for every ASCII character on
the left, in many contexts, and for random texts cut wherever the claim allows. The fast
regex patterns the encodings run are checked against the published ones the same way.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.tokens.encodings import TIKTOKEN_SPECS, TiktokenTokenizer, load_tokenizer
from extproc.tokens.pieces import piece_starters_after
from tests.tokens.conftest import CORPUS_PATH

ENCODINGS = ["o200k_base", "cl100k_base"]

# Left contexts end in each kind of character, including the ones that make a following
# piece behave differently (a contraction's apostrophe, a digit run, whitespace).
LEFT = ["", "a", "I'", "1", "12", ".", "中", "x ", "\n"]
# Right contexts try to pull the pair into one piece: contractions, digit runs, marks,
# whitespace runs (lookaheads), newlines after punctuation, other scripts.
RIGHT = ["", "s", "'s", "re", "  ", " x", "\n", "0", "000", "/", "\u0301", "中", "😀", "a b"]
NON_ASCII_LEFT = ["é", "中", "ж", "😀", "\u0301", "²", "٣", "\ufffd", "ﬁ", "\u00a0", "\u3000"]
UNICODE_WHITE_SPACE = [
    *range(0x09, 0x0E),
    0x20,
    0x85,
    0xA0,
    0x1680,
    *range(0x2000, 0x200B),
    0x2028,
    0x2029,
    0x202F,
    0x205F,
    0x3000,
]

TRICKY = [
    "a",
    "Z",
    "I",
    "'",
    "s",
    "re",
    "'re",
    " ",
    "  ",
    "\n",
    "\r",
    "\t",
    "0",
    "7",
    "42",
    ".",
    ",",
    "(",
    "/",
    "_",
    "é",
    "ж",
    "中",
    "😀",
    "\u0301",
    "\u00a0",
    "<|endoftext|>",
    " the",
]
texts = st.one_of(
    st.lists(st.sampled_from(TRICKY), max_size=80).map("".join),
    st.text(max_size=200),
)


@pytest.fixture(scope="module", params=ENCODINGS)
def tok(request: pytest.FixtureRequest) -> TiktokenTokenizer:
    loaded = load_tokenizer(request.param)
    assert isinstance(loaded, TiktokenTokenizer)
    return loaded


def test_python_isspace_covers_unicode_white_space() -> None:
    # The boundary rules ask "not str.isspace()" where the Rust regex asks "not \s".
    assert all(chr(c).isspace() for c in UNICODE_WHITE_SPACE)


def test_every_claimed_ascii_boundary_splits_the_count_in_every_context(
    tok: TiktokenTokenizer,
) -> None:
    count = tok.count
    right_counts: dict[str, int] = {}
    checked = 0
    for left in LEFT:
        for x in [chr(c) for c in range(128)] + NON_ASCII_LEFT:
            text = left + x
            starters = piece_starters_after(text)
            if not starters:
                continue
            left_count = count(text)
            for y in starters:
                for right in RIGHT:
                    tail = y + right
                    if tail not in right_counts:
                        right_counts[tail] = count(tail)
                    assert count(text + tail) == left_count + right_counts[tail], (text, tail)
                    checked += 1
    assert checked > 100_000  # the claim is broad; make sure it was really exercised


def test_whitespace_and_control_characters_claim_no_boundary() -> None:
    # Lookaheads decide pieces that end in whitespace, so nothing is claimed after one,
    # except the single space after a non-space (then only digits).
    for c in [*range(32), 127, *(c for c in UNICODE_WHITE_SPACE if c != 0x20)]:
        assert piece_starters_after("a" + chr(c)) == frozenset(), hex(c)
    assert piece_starters_after("a ") == frozenset("0123456789")
    assert piece_starters_after("a  ") == frozenset()
    assert piece_starters_after("a\n ") == frozenset()


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_random_texts_cut_at_any_claimed_boundary_count_the_same(text: str) -> None:
    for spec in ENCODINGS:
        count = load_tokenizer(spec).count
        whole = count(text)
        for i in range(1, len(text)):
            if text[i] in piece_starters_after(text[:i]):
                assert count(text[:i]) + count(text[i:]) == whole, (spec, text[:i], text[i:])


@lru_cache(maxsize=2)
def _published(spec: str) -> tiktoken.Encoding:
    """The encoding built with the pattern exactly as tiktoken publishes it."""
    fast = load_tokenizer(spec)
    assert isinstance(fast, TiktokenTokenizer)
    return tiktoken.Encoding(
        name=f"{spec}-published",
        pat_str=TIKTOKEN_SPECS[spec].pat_str,
        mergeable_ranks=fast.encoding._mergeable_ranks,
        special_tokens=TIKTOKEN_SPECS[spec].special_tokens,
    )


def test_encodings_run_the_fast_pattern(tok: TiktokenTokenizer) -> None:
    spec = TIKTOKEN_SPECS[tok.name]
    assert tok.encoding._pat_str == spec.fast_pat_str != spec.pat_str


def test_fast_pattern_tokenizes_the_corpus_like_the_published_one(
    tok: TiktokenTokenizer,
) -> None:
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    samples = [corpus, *corpus.splitlines(), "a  \n\n  b\t \r\n", "x   ", "  1234567 ", "I'RE"]
    published = _published(tok.name)
    for sample in samples:
        assert tok.encoding.encode_ordinary(sample) == published.encode_ordinary(sample)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_fast_pattern_tokenizes_random_texts_like_the_published_one(text: str) -> None:
    for spec in ENCODINGS:
        fast = load_tokenizer(spec)
        assert isinstance(fast, TiktokenTokenizer)
        clean = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        assert fast.encoding.encode_ordinary(clean) == _published(spec).encode_ordinary(clean)
