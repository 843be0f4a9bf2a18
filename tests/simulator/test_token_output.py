"""Generated words re-tokenize to exactly one token each, whatever sequence is drawn."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.tokens.encodings import load_tokenizer
from llmsim.textgen import SENTENCES, group_pieces, sample_length
from llmsim.tokens import TokenizerCodec, WordSplitCodec

TOKENIZERS = ["o200k_base", "cl100k_base", "mistral-7b-v0.1.sentencepiece.model"]
_codecs: dict[str, TokenizerCodec] = {}


def codec(name: str) -> TokenizerCodec:
    if name not in _codecs:
        _codecs[name] = TokenizerCodec(load_tokenizer(name))
    return _codecs[name]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), per_chunk=st.integers(1, 5))
def test_concatenated_random_output_counts_exactly_its_pieces(name, seed, n, per_chunk):
    c = codec(name)
    pieces = c.random_pieces(n, random.Random(seed))
    assert len(pieces) == n
    assert c.count("".join(pieces)) == n
    groups = group_pieces(pieces, per_chunk)
    assert sum(tokens for _, tokens in groups) == n
    for text, tokens in groups:
        # SentencePiece adds a dummy-prefix token to text that starts with a space.
        counted = c.count(text.lstrip()) if "sentencepiece" in name else c.count(text)
        assert counted == tokens


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=80))
def test_echo_pieces_cover_the_text_with_one_piece_per_token(name, text):
    c = codec(name)
    pieces = c.echo_pieces(text)
    assert len(pieces) == c.count(text)
    if "sentencepiece" not in name:  # SentencePiece normalises some characters
        assert "".join(pieces) == text


def test_word_split_counts_words_and_punctuation_with_their_spaces():
    c = WordSplitCodec(SENTENCES)
    assert c.echo_pieces("Hi, you  there.\n") == ["Hi", ",", " you", "  there", ".", "\n"]
    pieces = c.random_pieces(200, random.Random(3))
    assert c.count("".join(pieces)) == 200


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 5000), seed=st.integers(0, 2**31))
def test_sampled_length_stays_within_the_limit(limit, seed):
    rng = random.Random(seed)
    assert 1 <= sample_length(limit, False, 10**6, rng) <= limit
    assert sample_length(limit, True, 10**6, rng) == limit
    assert 1 <= sample_length(None, False, limit, rng) <= limit
