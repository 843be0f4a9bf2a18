"""Making arbitrary request text countable.

JSON allows ``"\\ud800"`` escapes, so a parsed body can hold lone UTF-16 surrogates that
no tokenizer accepts (tiktoken's Rust core and SentencePiece both refuse them). Counting
must not fail on them, so they are replaced the same way tiktoken itself does it: valid
surrogate pairs are joined into their character and lone halves become U+FFFD.
"""

from __future__ import annotations

from extproc.tokens.errors import MalformedRequest


def has_surrogates(text: str) -> bool:
    """True when ``text`` cannot be encoded as UTF-8 (it holds surrogate code points)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def clean_text(text: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if not has_surrogates(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def decode_utf8(raw: bytes, what: str = "request body") -> str:
    """Decode bytes from the wire, or raise MalformedRequest naming the first bad byte.

    Replacing bad bytes silently would let a client shape what gets counted, so a body
    that is not UTF-8 is rejected rather than repaired.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise MalformedRequest(
            f"{what} is not valid UTF-8 (byte 0x{bad} at offset {exc.start})"
        ) from None
