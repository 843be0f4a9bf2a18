"""Answers read whole, and the rule every settlement bills by (docs/billing.md)."""

from __future__ import annotations

import gzip

import orjson
import pytest

from extproc.billing.answer import billed, read_answer
from extproc.tokens.registry import TokenizerRegistry

TOKENIZER = TokenizerRegistry.from_config(
    [{"match": "gpt-4.1", "tokenizer": "o200k_base"}]
).counter_for("gpt-4.1")
PIECE = " hello"  # one o200k token


def sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def chunk(content: str, index: object = 0) -> bytes:
    return orjson.dumps({"choices": [{"index": index, "delta": {"content": content}}]})


def test_an_event_stream_with_an_unhashable_index_is_read_not_raised() -> None:
    count = read_answer(sse(*[chunk(PIECE, [0])] * 30, b"[DONE]"), TOKENIZER)
    assert count is not None and count.total == 30


def test_a_completion_with_values_orjson_refuses_is_read_as_clients_read_it() -> None:
    body = b'{"choices":[{"index":0,"message":{"content":"' + PIECE.encode() * 12 + b'"}}],"x":NaN}'
    count = read_answer(body, TOKENIZER)
    assert count is not None and count.total == 12


def test_json_lines_are_read_one_object_a_line() -> None:
    body = b"\n".join([chunk(PIECE)] * 7) + b"\n"
    count = read_answer(body, TOKENIZER)
    assert count is not None and count.total == 7


def test_a_gzip_body_is_opened_whatever_the_headers_said() -> None:
    doc = {"choices": [{"index": 0, "message": {"content": PIECE * 9}}]}
    count = read_answer(gzip.compress(orjson.dumps(doc)), TOKENIZER)
    assert count is not None and count.total == 9


def test_every_choice_and_field_of_a_completion_counts() -> None:
    message = {
        "content": PIECE * 3,
        "reasoning_content": PIECE * 2,
        "tool_calls": [{"type": "custom", "custom": {"name": "run", "input": PIECE * 4}}],
        "audio": {"transcript": PIECE * 5, "data": "UklGRg=="},
    }
    doc = {"choices": [{"index": 0, "message": message}, {"index": 1, "text": PIECE}]}
    count = read_answer(orjson.dumps(doc), TOKENIZER)
    assert count is not None and count.total == 3 + 2 + 1 + 4 + 5 + 1


def test_an_error_object_holds_no_output_and_says_so() -> None:
    count = read_answer(b'{"error": {"message": "no"}}', TOKENIZER)
    assert count is not None and count.total == 0 and count.error


def test_running_usage_in_a_stream_read_whole_only_raises_the_count() -> None:
    low = orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": PIECE}}], "usage": {"completion_tokens": 0}}
    )
    high = orjson.dumps(
        {
            "choices": [{"index": 0, "delta": {"content": PIECE}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 50},
        }
    )
    count = read_answer(sse(low, high), TOKENIZER)
    assert count is not None and count.total == 50 and count.usage == (3, 50, 0)


@pytest.mark.parametrize(
    "body",
    [b"\x00\xff garbage" * 5, b'{"object": "something else"}', b"[1, 2]", b"\x1f\x8bnot gzip"],
    ids=["binary", "no-choices-no-usage", "not-an-object", "broken-gzip"],
)
def test_what_no_client_reads_as_an_answer_is_unreadable(body: bytes) -> None:
    assert read_answer(body, TOKENIZER) is None


@pytest.mark.parametrize(
    ("authority", "usage", "expected"),
    [
        ("meter", None, (100, 200)),
        ("meter", (0, 0, 0), (100, 200)),  # a usage can't lower the meter's count
        ("meter", (120, 150, 0), (120, 200)),  # the prompt raised, the output not lowered
        ("meter", (90, 260, 0), (100, 260)),  # hidden tokens raise the output
        ("upstream", None, (100, 200)),  # no figure from the upstream: the meter's
        ("upstream", (95, 178, 0), (95, 178)),  # within the tolerance: the upstream's
        ("upstream", (0, 0, 0), (85, 170)),  # below it: (1 - 0.15) × the meter's count
        ("upstream", (130, 260, 0), (130, 260)),
    ],
)
def test_who_is_billed_what(
    authority: str, usage: tuple[int, int, int] | None, expected: tuple[int, int]
) -> None:
    assert billed(100, 200, usage, authority, 0.15) == expected  # type: ignore[arg-type]
