"""An answer read whole (a JSON completion, or an event stream that came without
``text/event-stream`` or is not SSE), and the rule every settlement bills by. Pure functions
of the body, the tokenizer and the upstream's own usage; the meter decides when they apply.

Reading (docs/billing.md): output is what ``extproc.billing.output`` counts, whatever the
shape: one JSON document (read as clients read JSON), else SSE events, else JSON lines; a
body that starts with the gzip magic is opened first (clients do, whatever the headers say).
``None`` means "unreadable" (no shape a client reads as an answer, over the size limit):
the caller keeps the reservation, never "free".
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Literal

from extproc.billing.output import OutputCount, Usage, usage_counts
from extproc.billing.sse import (
    DEFAULT_MAX_JSON_BODY_BYTES,
    MALFORMED,
    BadJson,
    SseProtocolError,
    SseReassembler,
    client_json,
    parse_json_data,
)
from extproc.tokens.model_tokenizer import ModelTokenizer

__all__ = ["Authority", "Usage", "billed", "read_answer", "usage_counts"]

Authority = Literal["meter", "upstream"]
GZIP_MAGIC = b"\x1f\x8b"


def billed(
    prompt: int,
    output: int,
    usage: Usage | None,
    authority: Authority = "meter",
    tolerance: float = 0.0,
) -> tuple[int, int]:
    """``(prompt, output)`` to commit from the processor's own counts and the upstream's
    usage (None: it reported none, and the processor's counts are billed).

    ``meter``: the processor's counts are exact (the model's own tokenizer): the upstream's
    figure may raise the bill (hidden tokens, a chat template), never lower it.
    ``upstream``: the processor's tokenizer is an approximation: the upstream's figure is
    billed, but never below ``(1 - tolerance)`` × the processor's count, the least the
    delivered text can have cost whatever tokenizer counted it."""
    if usage is None:
        return prompt, output
    if authority == "upstream":
        prompt, output = floor_of(prompt, tolerance), floor_of(output, tolerance)
    return max(usage[0], prompt), max(usage[1], output)


def floor_of(count: int, tolerance: float) -> int:
    """``ceil(count × (1 - tolerance))``, rounded to micro-tokens first (0.85 × 20 is 17)."""
    return math.ceil(round(count * (1 - tolerance), 6))


def read_answer(body: bytes, tokenizer: ModelTokenizer) -> OutputCount | None:
    """Our count and the upstream's usage of a whole answer; None if unreadable."""
    if body.startswith(GZIP_MAGIC):
        opened = _gunzip(body)
        if opened is None:
            return None
        body = opened
    try:
        doc = client_json(body)
    except BadJson:
        return _read_lines(body, tokenizer)
    if not isinstance(doc, dict):
        return None
    unknown = not isinstance(doc.get("choices"), list | dict) and "error" not in doc
    if unknown and usage_counts(doc.get("usage")) is None:
        return None  # no choices, no error, no usage: nothing says what it holds
    count = OutputCount(tokenizer)
    count.feed_answer(doc)
    return count


def _gunzip(body: bytes) -> bytes | None:
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)
    try:
        out = inflate.decompress(body, DEFAULT_MAX_JSON_BODY_BYTES)
    except zlib.error:
        return None
    return None if inflate.unconsumed_tail else out


def _read_lines(body: bytes, tokenizer: ModelTokenizer) -> OutputCount | None:
    """SSE events (any content type), else one JSON object per line (NDJSON)."""
    reassembler = SseReassembler()
    try:
        events = reassembler.feed(body)
        events.extend(reassembler.finish())
    except SseProtocolError:
        return None
    count = OutputCount(tokenizer)
    seen = False
    for event in events:
        chunk = parse_json_data(event)
        if chunk is None:
            continue
        seen = True
        if chunk is MALFORMED:
            # Forwarded as it came: a client may show what no JSON parser reads.
            count.feed_text(("unreadable",), event.data or "")
        else:
            count.feed(chunk)
    if seen:
        return count
    for line in body.splitlines():
        if not line.strip():
            continue
        try:
            doc: Any = client_json(line)
        except BadJson:
            return None
        if not isinstance(doc, dict):
            return None
        count.feed(doc)
        seen = True
    return count if seen else None
