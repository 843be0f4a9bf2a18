"""What a ``text/event-stream`` body is, from its first bytes.

gzip (the magic, with no ``Content-Encoding``: decoded, as clients decode it), SSE (a field
line after any BOM and blank lines), or anything else (one JSON answer, JSON lines, text:
read whole like a JSON answer). Until the bytes in tell, the meter holds them.
"""

from __future__ import annotations

from typing import Literal

GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
# How an event stream starts: a field line (after any BOM and blank lines).
_SSE_STARTS = (b"data", b"event", b"id", b"retry", b":")


def maybe_gzip(held: bytes, end_of_stream: bool) -> bool:
    """Too few bytes yet to tell whether they start with the gzip magic."""
    return len(held) < 2 and GZIP_MAGIC.startswith(held) and not end_of_stream


def event_stream_kind(held: bytes, end_of_stream: bool) -> Literal["undecided", "sse", "other"]:
    """SSE, something else, or too few bytes yet to tell (decoded bytes)."""
    start = 3 if held.startswith(_BOM) else 0
    if start == 0 and len(held) < 3 and _BOM.startswith(held) and held:
        start = len(held)  # maybe the start of a BOM
    rest = held[start:].lstrip(b"\r\n")
    if not end_of_stream and (
        not rest or (len(rest) < 5 and any(f.startswith(rest) for f in _SSE_STARTS))
    ):
        return "undecided"
    return "sse" if not rest or rest.startswith(_SSE_STARTS) else "other"
