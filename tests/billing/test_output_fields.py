"""Which text of a streamed chunk is output the tenant pays for."""

from __future__ import annotations

import pytest

from extproc.billing.meter import delta_text


@pytest.mark.parametrize(
    ("choice", "text"),
    [
        ({"index": 0, "delta": {"content": " word"}}, " word"),
        ({"index": 0, "delta": {"role": "assistant", "content": ""}}, ""),
        ({"index": 0, "delta": {"role": "assistant"}}, ""),
        ({"index": 0, "delta": {}, "finish_reason": "stop"}, ""),
        ({"index": 0, "delta": {"reasoning_content": "think", "content": None}}, "think"),
        ({"index": 0, "delta": {"reasoning": "hmm", "content": "ok"}}, "okhmm"),
        ({"index": 0, "delta": {"refusal": "no"}}, "no"),
        (
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {"index": 0, "function": {"name": "get_weather", "arguments": '{"ci'}},
                        {"index": 1, "function": {"arguments": 'ty":"Oslo"}'}},
                    ]
                },
            },
            'get_weather{"city":"Oslo"}',
        ),
        ({"index": 0, "text": " completion"}, " completion"),
        ({"index": 0, "delta": {"content": 42}}, ""),
        ({"index": 0, "delta": "not an object"}, ""),
        ({"index": 0, "delta": {"tool_calls": ["junk", {"function": "junk"}]}}, ""),
    ],
    ids=[
        "content", "role-and-empty-content", "role-only", "finish", "reasoning-content",
        "reasoning-and-content", "refusal", "tool-call-name-and-arguments", "completions-text",
        "non-string-content", "non-object-delta", "malformed-tool-calls",
    ],
)  # fmt: skip
def test_billable_text_of_a_chunk_choice(choice: dict, text: str) -> None:
    assert delta_text(choice) == text
