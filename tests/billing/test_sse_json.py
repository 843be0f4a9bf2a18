"""JSON payloads of events, and usage read from non-streamed bodies."""

from __future__ import annotations

import pytest

from extproc.billing.sse import (
    MALFORMED,
    JsonBodyCollector,
    SseEvent,
    SseReassembler,
    parse_json_data,
)


def event(data: str | None) -> SseEvent:
    return SseEvent(b"", data)


def test_chunk_object_is_parsed() -> None:
    chunk = '{"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}'
    assert parse_json_data(event(chunk)) == {
        "choices": [{"index": 0, "delta": {"content": "hi"}}],
        "usage": None,
    }


@pytest.mark.parametrize("data", [None, "[DONE]", " [DONE] "])
def test_done_and_missing_data_carry_no_payload(data: str | None) -> None:
    assert parse_json_data(event(data)) is None


@pytest.mark.parametrize(
    "data", ['{"choices": [', "not json", "", "[1, 2]", "42", '"text"', "{'single': 1}"]
)
def test_data_that_is_not_a_json_object_is_flagged_malformed(data: str) -> None:
    assert parse_json_data(event(data)) is MALFORMED


def test_injected_malformed_event_between_good_ones_does_not_stop_parsing() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[{"delta":\n\n'
        b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    reassembler = SseReassembler()
    events = reassembler.feed(stream[:30]) + reassembler.feed(stream[30:]) + reassembler.finish()
    parsed = [parse_json_data(e) for e in events]
    assert parsed[1] is MALFORMED
    assert parsed[3] is None
    assert [p["choices"][0]["delta"]["content"] for p in (parsed[0], parsed[2])] == ["a", "b"]


def test_multi_line_data_is_parsed_as_one_json_document() -> None:
    reassembler = SseReassembler()
    (ev,) = reassembler.feed(b'data: {"a":\ndata: 1}\n\n')
    assert parse_json_data(ev) == {"a": 1}


BODY = (
    b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"h\xc3\xa9llo"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}'
)


def test_usage_is_read_from_a_body_split_anywhere() -> None:
    for cut in range(0, len(BODY) + 1, 7):
        collector = JsonBodyCollector()
        collector.feed(BODY[:cut])
        collector.feed(BODY[cut:])
        assert collector.finish() == {
            "prompt_tokens": 9,
            "completion_tokens": 2,
            "total_tokens": 11,
        }
        assert collector.size == len(BODY)
        assert not collector.malformed and not collector.overflowed


def test_body_without_usage_gives_none() -> None:
    collector = JsonBodyCollector()
    collector.feed(b'{"choices":[],"usage":null}')
    assert collector.finish() is None
    assert not collector.malformed


@pytest.mark.parametrize("body", [b'{"usage": {"prompt', b"<html>502</html>", b"[]", b""])
def test_malformed_body_gives_none_and_is_flagged(body: bytes) -> None:
    collector = JsonBodyCollector()
    collector.feed(body)
    assert collector.finish() is None
    assert collector.malformed


def test_body_over_the_limit_is_flagged_and_not_kept() -> None:
    collector = JsonBodyCollector(limit_bytes=100)
    collector.feed(BODY[:90])
    collector.feed(BODY[90:])
    assert collector.overflowed
    assert collector.size == len(BODY)
    assert collector.finish() is None
    assert not collector.malformed
