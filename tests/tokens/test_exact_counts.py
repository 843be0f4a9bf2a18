"""Real tokenizers, loaded offline, give the published counts for fixed strings.

Expected values were computed once with these files and checked by decoding each token
(e.g. cl100k "Hello, world!" -> "Hello" "," " world" "!"), then frozen here as literals.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from extproc.tokens.encodings import DATA_DIR, TokenizerLoadError, load_tokenizer

MISTRAL = "mistral-7b-v0.1.sentencepiece.model"

SAMPLES = {
    "ascii": "Hello, world!",
    "cjk": "你好世界",
    "emoji": "😀👍🏽",
    "code": "def f(x):\n    return x * 2\n",
    "mixed": "Hello 世界 👋 — naïve café 123",
    "special_token_text": "<|endoftext|>",
}

EXPECTED = {
    "o200k_base": {
        "ascii": 4,
        "cjk": 2,
        "emoji": 4,
        "code": 11,
        "mixed": 10,
        "special_token_text": 7,
    },
    "cl100k_base": {
        "ascii": 4,
        "cjk": 5,
        "emoji": 8,
        "code": 11,
        "mixed": 13,
        "special_token_text": 7,
    },
    MISTRAL: {
        "ascii": 4,
        "cjk": 5,
        "emoji": 4,
        "code": 13,
        "mixed": 18,
        "special_token_text": 7,
    },
}


@pytest.mark.parametrize(
    ("spec", "sample"),
    [(spec, sample) for spec in EXPECTED for sample in SAMPLES],
)
def test_fixed_strings_count_exactly_in_each_encoding(spec: str, sample: str) -> None:
    tok = load_tokenizer(spec)
    assert tok.count(SAMPLES[sample]) == EXPECTED[spec][sample]
    assert len(tok.encode(SAMPLES[sample])) == EXPECTED[spec][sample]


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_encode_decode_round_trips(spec: str) -> None:
    tok = load_tokenizer(spec)
    text = SAMPLES["mixed"]
    assert tok.decode(tok.encode(text)).strip() == text


def test_user_typed_special_token_is_counted_as_text_not_control() -> None:
    tok = load_tokenizer("o200k_base")
    ids = tok.encode("<|endoftext|>")
    assert 199999 not in ids  # the real <|endoftext|> id


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_lone_surrogates_are_counted_as_replacement_characters(spec: str) -> None:
    tok = load_tokenizer(spec)
    assert tok.count("a\ud800b") == tok.count("a\ufffdb")
    assert tok.count("x\udfff") == tok.count("x\ufffd")
    # A valid pair held as two code points is the character it encodes.
    assert tok.count("\ud83d\ude00") == tok.count("😀")


def test_corrupt_tiktoken_file_is_refused_by_sha256(tmp_path: Path) -> None:
    blob = gzip.decompress((DATA_DIR / "cl100k_base.tiktoken.gz").read_bytes())
    tampered = blob.replace(b" 0\n", b" 1\n", 1)
    (tmp_path / "cl100k_base.tiktoken.gz").write_bytes(gzip.compress(tampered))
    with pytest.raises(TokenizerLoadError, match="sha256"):
        load_tokenizer("cl100k_base", tmp_path)


def test_missing_files_and_unknown_specs_raise_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError):
        load_tokenizer("o200k_base", tmp_path)
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_tokenizer("nope.model", tmp_path)
    with pytest.raises(TokenizerLoadError, match="unknown tokenizer"):
        load_tokenizer("p50k_base", tmp_path)


def test_copied_data_dir_loads_the_same_tokenizer(tmp_path: Path) -> None:
    shutil.copy(DATA_DIR / MISTRAL, tmp_path / MISTRAL)
    fresh = load_tokenizer(MISTRAL, tmp_path)
    assert fresh is not load_tokenizer(MISTRAL)
    assert fresh.count(SAMPLES["mixed"]) == EXPECTED[MISTRAL]["mixed"]
