"""The bench client reads SSE as the spec frames it and JSON as servers write it, whatever
the pieces the bytes arrive in (in process: the protocol fed byte strings)."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadlab.client import TimedStream, _TimedSseProtocol

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunked(body: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(body), size):
        part = body[i : i + size]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


def feed(raw: bytes, piece: int) -> TimedStream:
    loop = asyncio.new_event_loop()
    try:
        result = TimedStream("t")
        protocol = _TimedSseProtocol(result, loop.create_future())
        for i in range(0, len(raw), piece):
            protocol.data_received(raw[i : i + piece])
        return result
    finally:
        loop.close()


def chunk(delta: dict | None = None, **top: object) -> dict:
    doc: dict = {"id": "x", "object": "chat.completion.chunk", **top}
    if delta is not None:
        doc["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
    return doc


EVENTS = [
    chunk({"role": "assistant", "content": ""}),  # role: no token
    chunk({"content": " Hello"}),
    chunk({"reasoning_content": "thinking"}),
    chunk({"reasoning": "more"}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
    chunk({"refusal": "no"}),
    {"choices": [{"index": 0, "text": " done", "finish_reason": None}]},  # completions
    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},  # no token
    chunk({}),  # finish: no token
    chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}),
]


def body(framing: str) -> bytes:
    out = b": a comment first\n\n"
    for i, doc in enumerate(EVENTS):
        text = json.dumps(doc)
        if framing == "crlf":
            out += f"data: {text}\r\n\r\n".encode()
        elif framing == "cr":
            out += f"data:{text}\r\r".encode()
        elif framing == "lines":  # one JSON document on two data lines, other fields
            head, _, tail = text.partition(", ")  # joined with a newline: whitespace in JSON
            out += f"event: c{i}\nid: {i}\ndata: {head},\ndata:{tail}\n\n".encode()
        else:
            out += f"data: {text}\n\n".encode()
    return out + b"data: [DONE]\n\n"


@pytest.mark.parametrize("framing", ["lf", "crlf", "cr", "lines"])
@pytest.mark.parametrize("piece", [1, 2, 7, 4096])
def test_every_token_kind_counts_once_whatever_the_framing_and_pieces(
    framing: str, piece: int
) -> None:
    result = feed(HEAD + chunked(body(framing), 13), piece)
    assert len(result.arrivals_ns) == 6, framing
    assert (result.completion_tokens, result.prompt_tokens) == (6, 3)
    assert result.saw_done and result.complete
    assert result.stamps_ns == [] and result.unreadable_events == 0


def test_a_stamp_is_kept_only_where_an_event_carries_one() -> None:
    text = b"".join(
        b"data: " + json.dumps(chunk({"content": "x"}, ext_sent_ns=1000 + i)).encode() + b"\n\n"
        for i in range(3)
    )
    result = feed(HEAD + chunked(text + b"data: [DONE]\n\n", 50), 9)
    assert result.stamps_ns == [1000, 1001, 1002] and len(result.arrivals_ns) == 3


def test_an_error_event_and_data_that_is_not_json_are_told_apart() -> None:
    text = (
        b'data: {"error": {"message": "budget", "code": "rate_limit_exceeded"}}\n\n'
        b"data: {not json\n\n"
        b"data: [DONE]\n\n"
    )
    result = feed(HEAD + chunked(text, 8), 5)
    assert result.error_code == "rate_limit_exceeded"
    assert result.unreadable_events == 1 and not result.arrivals_ns


def test_a_body_without_chunked_encoding_ends_with_the_connection() -> None:
    loop = asyncio.new_event_loop()
    try:
        result = TimedStream("t")
        protocol = _TimedSseProtocol(result, loop.create_future())
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        # The last event lacks its blank line: read as meant when the connection ends.
        protocol.data_received(
            head + b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]'
        )
        protocol.connection_lost(None)
    finally:
        loop.close()
    assert len(result.arrivals_ns) == 1 and result.saw_done and result.complete
