"""Fixed inputs for the SSE reassembler: line endings, fields, BOM, splits, sizes, errors."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from extproc.billing.sse import SseEvent, SseProtocolError, SseReassembler


def feed_all(chunks: list[bytes], **kwargs: int) -> list[SseEvent]:
    reassembler = SseReassembler(**kwargs)
    events: list[SseEvent] = []
    for chunk in chunks:
        events += reassembler.feed(chunk)
    return events + reassembler.finish()


def fields(events: list[SseEvent]) -> list[tuple[str | None, str | None, str | None]]:
    return [(e.data, e.event, e.id) for e in events]


def chunk_openai(content: str, index: int = 0) -> bytes:
    return (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
        b'"model":"gpt-4.1","choices":[{"index":0,"delta":{"content":"'
        + f"{content}{index}".encode()
        + b'"},"finish_reason":null}]}\n\n'
    )


@pytest.mark.parametrize(
    ("ending", "name"), [(b"\n", "LF"), (b"\r\n", "CRLF"), (b"\r", "CR")], ids=lambda v: v
)
def test_each_line_ending_style_yields_the_same_events_with_exact_raw_bytes(
    ending: bytes, name: str
) -> None:
    lines = [
        [b"data: first"],
        [b": keep-alive comment"],
        [b"event: delta", b"id: 42", b"data: line one", b"data: line two"],
        [b"data: [DONE]"],
    ]
    blocks = [ending.join(block) + ending + ending for block in lines]
    events = feed_all([b"".join(blocks)])
    assert [e.raw for e in events] == blocks
    assert fields(events) == [
        ("first", None, None),
        (None, None, None),
        ("line one\nline two", "delta", "42"),
        ("[DONE]", None, None),
    ]
    assert all(e.terminated for e in events)


def test_field_value_rules_follow_whatwg() -> None:
    stream = (
        b"data:no-space\n"
        b"data:  two spaces\n"
        b"data\n"  # field name without colon: empty value
        b"data: a:b: c\n"  # only the first colon separates name and value
        b"retry: 1000\n"
        b"unknown: ignored\n"
        b"id: bad\x00id\n"  # an id holding NUL is ignored
        b"event\n\n"
    )
    (event,) = feed_all([stream])
    assert event.data == "no-space\n two spaces\n\na:b: c"
    assert event.event == ""
    assert event.id is None
    assert event.raw == stream


def test_empty_data_field_gives_empty_string_not_none() -> None:
    events = feed_all([b"data:\n\ndata\n\nevent: ping\n\n"])
    assert fields(events) == [("", None, None), ("", None, None), (None, "ping", None)]


def test_comment_only_event_is_kept_byte_exact_without_data() -> None:
    stream = b": ping\n: another\n\ndata: x\n\n"
    events = feed_all([stream])
    assert events[0] == SseEvent(b": ping\n: another\n\n", None, None, None)
    assert events[1].data == "x"


def test_comments_between_data_lines_do_not_enter_data() -> None:
    (event,) = feed_all([b"data: a\n: note\ndata: b\n\n"])
    assert event.data == "a\nb"


def test_stray_blank_lines_become_empty_events_so_no_byte_is_lost() -> None:
    stream = b"\n\r\n\rdata: x\n\n\n"
    events = feed_all([stream])
    assert [e.raw for e in events] == [b"\n", b"\r\n", b"\r", b"data: x\n\n", b"\n"]
    assert fields(events)[3] == ("x", None, None)
    assert all(e.data is None for i, e in enumerate(events) if i != 3)


def test_mixed_line_endings_inside_one_event() -> None:
    stream = b"data: a\r\ndata: b\rdata: c\n\r\n"
    (event,) = feed_all([stream])
    assert event.data == "a\nb\nc"
    assert event.raw == stream


def test_lf_after_lone_cr_line_end_is_one_crlf_not_a_blank_line() -> None:
    # "\r\n" is a single line ending, so this is one event with two data lines.
    events = feed_all([b"data: a\r", b"\ndata: b\r\n\r\n"])
    assert fields(events) == [("a\nb", None, None)]


def test_crlf_split_between_cr_and_lf_is_not_two_line_endings() -> None:
    stream = b"data: a\r\n\r\ndata: b\r\n\r\n"
    for cut in range(1, len(stream)):
        events = feed_all([stream[:cut], stream[cut:]])
        assert [e.raw for e in events] == [b"data: a\r\n\r\n", b"data: b\r\n\r\n"], cut
        assert fields(events) == [("a", None, None), ("b", None, None)], cut


def test_event_ending_in_lone_cr_is_held_until_the_next_byte_decides() -> None:
    reassembler = SseReassembler()
    assert reassembler.feed(b"data: a\r\r") == []
    assert reassembler.pending == b"data: a\r\r"
    (event,) = reassembler.feed(b"data: b\r\r")
    assert event.raw == b"data: a\r\r"
    # The CR turned out to be half of a CRLF: the LF belongs to the held event.
    (event,) = reassembler.feed(b"\n")
    assert event.raw == b"data: b\r\r\n"
    assert reassembler.finish() == []


def test_finish_completes_an_event_held_on_a_trailing_cr() -> None:
    reassembler = SseReassembler()
    assert reassembler.feed(b"data: a\r\r") == []
    assert reassembler.finish() == [SseEvent(b"data: a\r\r", "a")]


def test_multibyte_character_split_at_every_byte_is_decoded_whole() -> None:
    stream = "data: héllo €𝄞 世界\n\n".encode()
    for cut in range(1, len(stream)):
        events = feed_all([stream[:cut], stream[cut:]])
        assert fields(events) == [("héllo €𝄞 世界", None, None)], cut
        assert events[0].raw == stream


def test_byte_by_byte_feeding_gives_the_same_events() -> None:
    stream = b"".join(chunk_openai("w", i) for i in range(5)) + b"data: [DONE]\n\n"
    events = feed_all([stream[i : i + 1] for i in range(len(stream))])
    assert events == feed_all([stream])
    assert len(events) == 6


def test_invalid_utf8_is_replaced_never_raised() -> None:
    events = feed_all([b"data: a\xff\xfeb\xe2\x82\n", b"data: \xc3\n\n"])
    assert events[0].data == "a\ufffd\ufffdb\ufffd\n\ufffd"
    assert events[0].raw == b"data: a\xff\xfeb\xe2\x82\ndata: \xc3\n\n"


def test_bom_at_stream_start_is_ignored_but_forwarded() -> None:
    stream = b"\xef\xbb\xbfdata: a\n\n"
    for cut in range(1, len(stream)):
        events = feed_all([stream[:cut], stream[cut:]])
        assert events == [SseEvent(stream, "a")], cut


def test_bom_followed_directly_by_blank_line_is_an_empty_event() -> None:
    events = feed_all([b"\xef\xbb", b"\xbf\ndata: a\n\n"])
    assert [e.raw for e in events] == [b"\xef\xbb\xbf\n", b"data: a\n\n"]


def test_bom_later_in_the_stream_is_content() -> None:
    events = feed_all([b"data: a\n\n\xef\xbb\xbfdata: b\n\n"])
    # Per spec the second line's field name is "\ufeffdata": an unknown field.
    assert fields(events) == [("a", None, None), (None, None, None)]


def test_partial_bom_alone_at_stream_end_is_returned_as_unterminated_event() -> None:
    reassembler = SseReassembler()
    assert reassembler.feed(b"\xef\xbb") == []
    assert reassembler.pending == b"\xef\xbb"
    (event,) = reassembler.finish()
    assert event.raw == b"\xef\xbb"
    assert not event.terminated


def test_unterminated_tail_is_returned_by_finish_and_marked() -> None:
    reassembler = SseReassembler()
    assert reassembler.feed(b"data: a\n\nevent: e\ndata: partial\n") == [
        SseEvent(b"data: a\n\n", "a")
    ]
    assert reassembler.pending == b"event: e\ndata: partial\n"
    (tail,) = reassembler.finish()
    assert tail == SseEvent(b"event: e\ndata: partial\n", "partial", "e", None, terminated=False)
    assert reassembler.pending == b""


def test_finish_on_clean_stream_returns_nothing() -> None:
    reassembler = SseReassembler()
    reassembler.feed(b"data: a\n\n")
    assert reassembler.finish() == []


def test_feed_after_finish_is_refused() -> None:
    reassembler = SseReassembler()
    reassembler.finish()
    with pytest.raises(RuntimeError):
        reassembler.feed(b"data: a\n\n")


def test_one_mebibyte_message_with_thousands_of_events() -> None:
    events_in = [chunk_openai("token", i) for i in range(6500)]
    stream = b"".join(events_in)
    assert len(stream) > 1024 * 1024
    events = feed_all([stream])
    assert [e.raw for e in events] == events_in
    assert events[6499].data is not None and '"content":"token6499"' in events[6499].data


def test_mebibyte_messages_cutting_events_anywhere() -> None:
    events_in = [chunk_openai("x" * (i % 97), i) for i in range(20000)]
    stream = b"".join(events_in)
    size = 1024 * 1024 - 7  # never aligned with an event boundary
    chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
    assert len(chunks) >= 4
    assert [e.raw for e in feed_all(chunks)] == events_in


def test_pending_tail_is_only_the_incomplete_event() -> None:
    reassembler = SseReassembler()
    events = reassembler.feed(chunk_openai("a") + b'data: {"par')
    assert len(events) == 1
    assert reassembler.pending == b'data: {"par'
    (event,) = reassembler.feed(b'tial": 1}\n\n')
    assert event.data == '{"partial": 1}'
    assert reassembler.pending == b""


def test_oversized_incomplete_event_raises_before_buffering_more() -> None:
    reassembler = SseReassembler(max_event_bytes=1000)
    assert reassembler.feed(b"data: " + b"a" * 900) == []
    with pytest.raises(SseProtocolError) as caught:
        reassembler.feed(b"a" * 200)
    assert caught.value.events == []
    assert reassembler.pending == b""  # memory released
    with pytest.raises(SseProtocolError):
        reassembler.feed(b"\n\n")


def test_oversized_complete_event_raises_and_hands_back_earlier_events() -> None:
    reassembler = SseReassembler(max_event_bytes=100)
    small = b"data: ok\n\n"
    with pytest.raises(SseProtocolError) as caught:
        reassembler.feed(small + b"data: " + b"b" * 200 + b"\n\n" + small)
    assert caught.value.events == [SseEvent(small, "ok")]


def test_oversized_event_with_cr_line_endings_raises() -> None:
    reassembler = SseReassembler(max_event_bytes=100)
    with pytest.raises(SseProtocolError):
        reassembler.feed(b"data: " + b"c" * 200 + b"\r\n\r\n")


def test_event_of_exactly_the_limit_is_accepted() -> None:
    event = b"data: " + b"d" * 92 + b"\n\n"
    assert len(event) == 100
    events = feed_all([event[:50], event[50:]], max_event_bytes=100)
    assert [e.raw for e in events] == [event]


def test_non_bytes_chunks_are_accepted() -> None:
    reassembler = SseReassembler()
    events = reassembler.feed(bytearray(b"data: a\n")) + reassembler.feed(memoryview(b"\n"))
    assert events == [SseEvent(b"data: a\n\n", "a")]
    assert type(events[0].raw) is bytes


def _best_cpu_time(work: Callable[[], None], repeat: int = 5) -> float:
    # CPU time of this process: a shared, busy machine delays it far less than wall time.
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_long_event_in_small_messages_costs_linear_time(ending: bytes) -> None:
    """A tail rescanned or re-joined on every message would make 8x the bytes cost ~64x."""

    def feed_event(size: int) -> None:
        reassembler = SseReassembler(max_event_bytes=8 * 1024 * 1024)
        piece = b"data: " + b"z" * 1018 + ending
        for _ in range(size // len(piece)):
            assert reassembler.feed(piece) == []
        assert len(reassembler.feed(ending)) == 1

    small = _best_cpu_time(lambda: feed_event(512 * 1024))
    large = _best_cpu_time(lambda: feed_event(4 * 1024 * 1024))
    assert large / small < 24, (small, large)


@pytest.mark.parametrize(
    "message",
    [
        b"data: x\n\n",
        b"data:x\n\n",
        b"data:\n\n",
        b"data:  two\n\n",
        b"data: x\r\n\r\n",
        b"data:\r\n\r\n",
        b"data: x\r\r\n",
        b"data: x\n\r\n",
        b"data: x\r\n\n",
        b"data: a\ndata: b\n\n",
        b"data: a\r\ndata: b\r\n\r\n",
        b"data: x\n\ndata: y\n\n",
        b"data: x\r\n\r\ndata: y\r\n\r\n",
        b"data: caf\xc3\xa9\n\n",
        b"data: x\n",
        b"dat: x\n\n",
    ],
)
def test_whole_message_events_parse_like_events_inside_a_larger_message(message: bytes) -> None:
    """Messages holding exactly one event take a shortcut; it must not change the result."""
    prefix = b"data: first\n\n"
    reassembler = SseReassembler()
    assert len(reassembler.feed(prefix)) == 1
    alone = reassembler.feed(message) + reassembler.finish()
    embedded = feed_all([prefix + message + b"data: last\n\n"])[1:-1]
    if not message.endswith((b"\n\n", b"\r\n\r\n", b"\r\r\n", b"\n\r\n")):
        embedded = feed_all([prefix + message])[1:]  # unterminated: only finish() returns it
    assert [e.raw for e in alone] == [e.raw for e in embedded]
    assert fields(alone) == fields(embedded)
    assert b"".join(e.raw for e in alone) == message
