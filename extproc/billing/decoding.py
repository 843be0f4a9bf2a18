"""Content-Encoding of an answer the meter must read.

Metered requests reach the upstream asking for ``Accept-Encoding: identity``; an upstream
that compresses anyway is decoded here (gzip, deflate) and the client gets the decoded
bytes. Anything else cannot be metered and is refused by the caller.
"""

from __future__ import annotations

import zlib

# One body message may not inflate past this: a decompression bomb ends the answer.
MAX_DECODED_PER_MESSAGE = 8 << 20
# zlib's automatic header detection: accepts both gzip and zlib-wrapped deflate.
_AUTO_WBITS = zlib.MAX_WBITS | 32
DECODABLE = frozenset(("gzip", "x-gzip", "deflate"))


class UndecodableBody(Exception):
    """The compressed body is corrupt or inflates beyond the per-message bound."""


def encodings(header: str) -> list[str]:
    """The codings applied, in order, without ``identity``: ``"gzip, br"`` → [gzip, br]."""
    return [c for c in (p.strip().lower() for p in header.split(",")) if c and c != "identity"]


class Decoder:
    """Streaming inflate of one gzip or deflate body, message by message."""

    __slots__ = ("_inflate",)

    def __init__(self) -> None:
        self._inflate = zlib.decompressobj(_AUTO_WBITS)

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes:
        try:
            out = self._inflate.decompress(chunk, MAX_DECODED_PER_MESSAGE)
            if self._inflate.unconsumed_tail:
                raise UndecodableBody("the compressed body inflates beyond the bound")
            if end_of_stream:
                out += self._inflate.flush()
        except zlib.error as exc:
            raise UndecodableBody(str(exc)) from exc
        return out
