"""Any split of a stream into body messages gives the same events and the same bytes.

The expected events come from a deliberately naive reference parser (byte by byte, line by
line, per the WHATWG algorithm), independent of the reassembler's search-based shortcuts.
"""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.billing.sse import SseEvent, SseReassembler

Parsed = tuple[bytes, str | None, str | None, str | None, bool]


def reference_parse(stream: bytes) -> list[Parsed]:
    """(raw, data, event, id, terminated) per blank-line block, read one byte at a time."""
    out: list[Parsed] = []
    i = 3 if stream.startswith(b"\xef\xbb\xbf") else 0
    block_start = 0
    data: list[str] | None = None
    event: str | None = None
    event_id: str | None = None
    seen_line = False
    while i < len(stream):
        j = i
        while j < len(stream) and stream[j] not in b"\r\n":
            j += 1
        line = stream[i:j].decode("utf-8", "replace")
        if j == len(stream):
            end = j  # last line without a line ending
        elif stream[j : j + 2] == b"\r\n":
            end = j + 2
        else:
            end = j + 1
        if line == "" and j < len(stream):
            out.append((stream[block_start:end], _join(data), event, event_id, True))
            block_start, data, event, event_id, seen_line = end, None, None, None, False
        else:
            seen_line = True
            name, _, value = line.partition(":")
            if ":" in line and value.startswith(" "):
                value = value[1:]
            if line.startswith(":"):
                pass
            elif name == "data":
                data = [*(data or []), value]
            elif name == "event":
                event = value
            elif name == "id" and "\x00" not in value:
                event_id = value
        i = end
    if block_start < len(stream):
        assert seen_line or stream[block_start:].startswith(b"\xef")
        out.append((stream[block_start:], _join(data), event, event_id, False))
    return out


def _join(data: list[str] | None) -> str | None:
    return None if data is None else "\n".join(data)


def as_tuples(events: list[SseEvent]) -> list[Parsed]:
    return [(e.raw, e.data, e.event, e.id, e.terminated) for e in events]


def feed_split(stream: bytes, cuts: list[int]) -> list[SseEvent]:
    reassembler = SseReassembler()
    events: list[SseEvent] = []
    bounds = [0, *sorted(set(cuts)), len(stream)]
    for start, end in pairwise(bounds):
        events += reassembler.feed(stream[start:end])
    return events + reassembler.finish()


def recorded_openai_stream(words: list[str], include_usage: bool = True) -> bytes:
    """The shape vLLM and OpenAI stream: role chunk, content chunks, final, usage, [DONE]."""
    base = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def event(choices: list[dict], **extra: object) -> bytes:
        body = {**base, "choices": choices, **extra}
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    out = [event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])]
    out += [event([{"index": 0, "delta": {"content": w}, "finish_reason": None}]) for w in words]
    out.append(event([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    if include_usage:
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": len(words),
            "total_tokens": 5 + len(words),
        }
        out.append(event([], usage=usage))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


RECORDED = recorded_openai_stream(["Hé", "llo", " wörld", " €", " 𝄞", " 世界", "\n\n", ' "q"'])


def test_reference_parser_agrees_on_a_recorded_stream() -> None:
    expected = reference_parse(RECORDED)
    assert len(expected) == 12
    assert as_tuples(feed_split(RECORDED, [])) == expected


def test_every_two_way_split_of_a_recorded_stream_is_byte_identical() -> None:
    whole = as_tuples(feed_split(RECORDED, []))
    for cut in range(1, len(RECORDED)):
        assert as_tuples(feed_split(RECORDED, [cut])) == whole, cut


def test_one_byte_messages_of_a_recorded_crlf_stream() -> None:
    stream = RECORDED.replace(b"\n\n", b"\r\n\r\n")
    events = feed_split(stream, list(range(1, len(stream))))
    assert as_tuples(events) == reference_parse(stream)
    assert b"".join(e.raw for e in events) == stream


COMPLEX = (
    b"\xef\xbb\xbf: hi\n\ndata: a\ndata: \xe2\x82\xac\nid: 1\n\n\nevent: e\ndata:{}\n\n"
    b"data: x\ndata: y\n\ndata: [DONE]\n\nda"
)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_every_three_way_split_of_a_stream_with_multi_line_events(ending: bytes) -> None:
    stream = COMPLEX.replace(b"\n", ending)
    expected = reference_parse(stream)
    assert sum(e[1] is not None and "\n" in e[1] for e in expected) == 2
    for first in range(1, len(stream)):
        for second in range(first, len(stream), 3):
            assert as_tuples(feed_split(stream, [first, second])) == expected, (first, second)


# Tokens chosen to hit the tricky spots: every line ending, colons and spaces, field names,
# NUL in ids, a BOM, multi-byte characters and invalid UTF-8 fragments.
_TOKENS = [
    b"\n", b"\r", b"\r\n", b"\n\n", b"\r\r", b"\r\n\r\n", b":", b": ", b" ", b"a", b"xyz",
    b"data", b"data:", b"data: ", b"event:", b"event: ", b"id:", b"id: ", b"retry: 5",
    b"\x00", b"\xef\xbb\xbf", b"\xe2\x82\xac", b"\xe2\x82", b"\xac", b"\xf0\x9d\x84\x9e",
    b"\xff", b"{\"a\":1}", b"[DONE]",
]  # fmt: skip

token_soup = st.lists(st.sampled_from(_TOKENS), max_size=60).map(b"".join)

_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
    max_size=12,
)
_line = st.one_of(
    _text.map(lambda t: f"data: {t}"),
    _text.map(lambda t: f"data:{t}"),
    _text.map(lambda t: f"event: {t}"),
    _text.map(lambda t: f"id: {t}"),
    _text.map(lambda t: f":{t}"),
    _text.map(lambda t: f"retry: {t}"),
    _text.filter(lambda t: t != ""),
).map(str.encode)
_ending = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def structured_stream(draw: st.DrawFn) -> bytes:
    """Events of field lines with random line endings, maybe a BOM and an unfinished tail."""
    out = [draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf"]))]
    for _ in range(draw(st.integers(0, 8))):
        for line in draw(st.lists(_line, max_size=4)):
            out += [line, draw(_ending)]
        out.append(draw(_ending))
    out.append(draw(st.sampled_from([b"", b"data: unfinished", b"data: half\n", b"x\r"])))
    return b"".join(out)


any_stream = st.one_of(structured_stream(), token_soup, st.just(RECORDED), st.binary(max_size=80))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_split_gives_the_input_bytes_back_and_the_reference_events(data: st.DataObject) -> None:
    stream = data.draw(any_stream)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    events = feed_split(stream, cuts)
    assert b"".join(e.raw for e in events) == stream
    assert as_tuples(events) == as_tuples(feed_split(stream, []))
    assert as_tuples(events) == reference_parse(stream)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pending_is_always_the_unreturned_suffix(data: st.DataObject) -> None:
    stream = data.draw(any_stream)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(stream))), max_size=8))))
    reassembler = SseReassembler()
    returned = b""
    bounds = [0, *cuts, len(stream)]
    for start, end in pairwise(bounds):
        returned += b"".join(e.raw for e in reassembler.feed(stream[start:end]))
        assert returned + reassembler.pending == stream[: max(end, start)]
