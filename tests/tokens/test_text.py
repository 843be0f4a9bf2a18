"""Turning wire bytes and JSON-decoded strings into countable text."""

from __future__ import annotations

import pytest

from extproc.tokens.prompt import MalformedRequest
from extproc.tokens.text import clean_text, decode_utf8, has_surrogates


def test_invalid_utf8_is_rejected_with_the_offending_byte_and_offset() -> None:
    with pytest.raises(MalformedRequest, match=r"not valid UTF-8 \(byte 0xff at offset 8\)"):
        decode_utf8(b'{"a": "x\xff"}')
    with pytest.raises(MalformedRequest, match="offset 0"):
        decode_utf8(b"\xc3\x28")  # truncated two-byte sequence


def test_valid_utf8_decodes_unchanged() -> None:
    assert decode_utf8("héllo 你好 😀".encode()) == "héllo 你好 😀"


def test_surrogates_are_joined_or_replaced() -> None:
    assert clean_text("\ud83d\ude00") == "😀"
    assert clean_text("a\ud800b\udfffc") == "a\ufffdb\ufffdc"
    assert clean_text("plain") == "plain"
    assert has_surrogates("x\ud800") and not has_surrogates("x😀")
