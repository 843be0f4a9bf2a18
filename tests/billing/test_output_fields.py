"""Which text of a choice is output the tenant pays for, and in which stream it counts."""

from __future__ import annotations

import pytest

from extproc.billing.output import pieces

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
