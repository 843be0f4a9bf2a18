"""Which text of a choice is output the tenant pays for, and in which stream it counts."""

from __future__ import annotations

import pytest

from extproc.billing.output import USAGE_ONLY, OutputCount, pieces
from extproc.tokens.registry import TokenizerRegistry

CALL = {"index": 0, "function": {"name": "get_weather", "arguments": '{"ci'}}


@pytest.mark.parametrize(
    ("choice", "found"),
    [
        ({"index": 0, "delta": {"content": " word"}}, [((), " word")]),
        ({"index": 0, "delta": {"role": "assistant", "content": ""}}, []),
        ({"index": 0, "delta": {"role": "assistant"}}, []),
        ({"index": 0, "delta": {}, "finish_reason": "stop"}, []),
        (
            {"index": 0, "delta": {"reasoning_content": "think", "content": None}},
            [(("reasoning_content",), "think")],
        ),
        (
            {"index": 0, "delta": {"reasoning": "hmm", "content": "ok"}},
            [((), "ok"), (("reasoning",), "hmm")],
        ),
        ({"index": 0, "delta": {"refusal": "no"}}, [(("refusal",), "no")]),
        (
            {
                "index": 0,
                "delta": {
                    "tool_calls": [CALL, {"index": 1, "function": {"arguments": 'ty":"Oslo"}'}}]
                },
            },
            [
                (("tool", "0", "name"), "get_weather"),
                (("tool", "0", "arguments"), '{"ci'),
                (("tool", "1", "arguments"), 'ty":"Oslo"}'),
            ],
        ),
        (
            {"index": 0, "delta": {"tool_calls": [{"index": 2, "custom": {"input": "ls -l"}}]}},
            [(("tool", "2", "input"), "ls -l")],
        ),
        (
            {"index": 0, "delta": {"function_call": {"name": "f", "arguments": "{}"}}},
            [(("function_call", "name"), "f"), (("function_call", "arguments"), "{}")],
        ),
        (
            {"index": 0, "delta": {"audio": {"id": "a1", "data": "UklG", "transcript": "hi"}}},
            [(("audio",), "hi")],
        ),
        (
            {
                "index": 0,
                "delta": {
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "refusal", "refusal": "b"},
                        "c",
                    ]
                },
            },
            [((), "a"), (("refusal",), "b"), ((), "c")],
        ),
        ({"index": 0, "message": {"role": "assistant", "content": "whole"}}, [((), "whole")]),
        ({"index": 0, "text": " completion"}, [((), " completion")]),
        ({"index": 0, "delta": {"content": 42}}, []),
        ({"index": 0, "delta": "not an object"}, []),
        ({"index": 0, "delta": {"tool_calls": ["junk", {"function": "junk"}]}}, []),
    ],
    ids=[
        "content", "role-and-empty-content", "role-only", "finish", "reasoning-content",
        "reasoning-and-content", "refusal", "tool-call-name-and-arguments", "custom-tool-input",
        "legacy-function-call", "audio-transcript-not-its-data", "content-parts", "message",
        "completions-text", "non-string-content", "non-object-delta", "malformed-tool-calls",
    ],
)  # fmt: skip
def test_billable_text_of_a_choice(choice: dict, found: list) -> None:
    assert pieces(choice) == found


def count() -> OutputCount:
    tokenizer = TokenizerRegistry.from_config(
        [{"match": "gpt-4.1", "tokenizer": "o200k_base"}]
    ).counter_for("gpt-4.1")
    return OutputCount(tokenizer)


def chunk(index: int, text: str, running: int | None = None) -> dict:
    event: dict = {"choices": [{"index": index, "delta": {"content": text}}]}
    if running is not None:
        event["usage"] = {"prompt_tokens": 5, "completion_tokens": running}
    return event


def test_running_usage_per_choice_is_summed_and_only_raises() -> None:
    out = count()
    assert out.feed(chunk(0, " hello", 40)) == 40
    assert out.feed(chunk(1, " hello", 30)) == 30  # another choice's own count: added
    assert out.feed(chunk(0, " hello", 0)) == 0  # a lower figure lowers nothing
    assert out.total == 70 and out.usage == (5, 70, 0)
    assert out.feed(chunk(0, " hello" * 80)) == 83 - 70  # the text passes the running sum


def test_a_usage_only_event_is_reported_as_such_unless_it_carries_an_error() -> None:
    out = count()
    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    assert out.feed({"choices": [], "usage": usage}) == USAGE_ONLY
    assert out.feed({"error": {"message": "x"}, "usage": usage}) == 0 and out.error
