"""Prompt accounting for chat and completions bodies, and clear errors for bad shapes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.prompt import CHAT_OVERHEAD, Limits, MalformedRequest, count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry

# The example from the OpenAI cookbook "How to count tokens with tiktoken", whose published
# results are 129 prompt tokens for gpt-3.5-turbo / gpt-4 and 124 for gpt-4o / gpt-4o-mini
# (the counts the API itself reported for these messages).
COOKBOOK_MESSAGES: list[dict[str, str]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that "
        "translates corporate jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have "
        "more bandwidth to touch base on opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean "
        "for the client deliverable.",
    },
]


@pytest.fixture
def gpt4o(registry: TokenizerRegistry) -> ModelTokenizer:
    return registry.counter_for("gpt-4o")


@pytest.mark.parametrize(
    ("model", "expected"),
    [("gpt-4", 129), ("gpt-3.5-turbo", 129), ("gpt-4o", 124), ("gpt-4o-mini", 124)],
)
def test_chat_count_matches_the_openai_cookbook_published_figures(
    registry: TokenizerRegistry, model: str, expected: int
) -> None:
    body = {"model": model, "messages": COOKBOOK_MESSAGES}
    assert count_prompt_tokens(body, registry.counter_for(model)) == expected


def test_chat_formula_per_message_name_and_priming(gpt4o: ModelTokenizer) -> None:
    one = {"messages": [{"role": "user", "content": "Hello, world!"}]}
    # 3 per message + "user" (1) + "Hello, world!" (4) + 3 reply priming
    assert count_prompt_tokens(one, gpt4o) == 3 + 1 + 4 + 3
    named = {"messages": [{"role": "user", "name": "bob", "content": "Hello, world!"}]}
    assert count_prompt_tokens(named, gpt4o) == 11 + gpt4o.count("bob") + 1


@pytest.mark.parametrize(("model", "family"), [("mixtral-8x7b", "llama"), ("x-model", "generic")])
def test_each_family_applies_its_own_overhead(
    registry: TokenizerRegistry, model: str, family: str
) -> None:
    tok = registry.counter_for(model)
    assert tok.family == family
    overhead = CHAT_OVERHEAD[family]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = (
        overhead.reply_priming
        + 2 * overhead.per_message
        + sum(tok.count(m["role"]) + tok.count(m["content"]) for m in messages)
    )
    assert count_prompt_tokens({"messages": messages}, tok) == expected


def test_text_parts_images_and_a_configurable_image_cost(gpt4o: ModelTokenizer) -> None:
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    text_only = 3 + 1 + gpt4o.count("What is in this picture?") + 3
    assert count_prompt_tokens(body, gpt4o) == text_only + 2 * 765
    assert count_prompt_tokens(body, gpt4o, image_tokens=100) == text_only + 200


def test_tool_calls_tool_results_and_tool_definitions_are_counted(
    gpt4o: ModelTokenizer,
) -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    base: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
        ]
    }
    without_tools = count_prompt_tokens(base, gpt4o)
    expected = (
        3
        + 3 * 3
        + sum(gpt4o.count(r) for r in ("user", "assistant", "tool"))
        + gpt4o.count("Weather in Paris?")
        + gpt4o.count("18C and sunny")
        + 3
        + gpt4o.count("get_weather")
        + gpt4o.count(arguments)
        + gpt4o.count("call_1")
        + gpt4o.count("call_1")
    )
    assert without_tools == expected
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    with_tools = count_prompt_tokens({**base, "tools": tools}, gpt4o)
    rendered = (
        '{"name":"get_weather","description":"Current weather for a city",'
        '"parameters":{"type":"object","properties":{"city":{"type":"string"}}}}'
    )
    assert with_tools == without_tools + 12 + 7 + gpt4o.count(rendered)
    legacy = count_prompt_tokens({**base, "functions": [tools[0]["function"]]}, gpt4o)
    assert legacy == with_tools


def test_completions_prompt_forms(gpt4o: ModelTokenizer) -> None:
    assert count_prompt_tokens({"prompt": "Hello, world!"}, gpt4o) == 4
    assert count_prompt_tokens({"prompt": ["Hello, world!", "你好世界"]}, gpt4o) == 4 + 2
    assert count_prompt_tokens({"prompt": [9906, 11, 1917, 0]}, gpt4o) == 4
    assert count_prompt_tokens({"prompt": [[1, 2, 3], [4, 5]]}, gpt4o) == 5
    assert count_prompt_tokens({"prompt": []}, gpt4o) == 0
    assert count_prompt_tokens({"prompt": "Hello", "suffix": ", world!"}, gpt4o) == 1 + 3


def test_client_declared_usage_fields_are_ignored(gpt4o: ModelTokenizer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hello, world!"}],
        "usage": {"prompt_tokens": 1},
        "prompt_tokens": 1,
    }
    assert count_prompt_tokens(body, gpt4o) == 11


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "request body must be a JSON object"),
        ({"model": "gpt-4o"}, "'messages' (chat) or 'prompt' (completions) is required"),
        ({"messages": "hi"}, "messages must be an array, got string"),
        ({"messages": []}, "messages must contain at least one message"),
        ({"messages": [1]}, "messages[0] must be an object, got number"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role must be one of"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "user", "content": "c"},
                    {"role": "user", "content": 5},
                ]
            },
            "messages[3].content must be a string or an array of content parts",
        ),
        (
            {"messages": [{"role": "user"}]},
            "messages[0].content must be a string or an array of content parts",
        ),
        (
            {"messages": [{"role": "user", "content": [["nested"]]}]},
            "messages[0].content[0] must be an object, got array",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type must be one of text, image_url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text must be a string, got number",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].image_url must be an object",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "name": 7}]},
            "messages[0].name must be a string, got number",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]},
            "messages[0].tool_calls must be an array",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments must be a string, got object",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function must be an object",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}},
            "tools must be an array, got object",
        ),
        ({"prompt": 5}, "prompt must be a string, an array of strings"),
        ({"prompt": ["a", 5]}, "prompt[1] must be a string, got number"),
        ({"prompt": [1, "a"]}, "prompt[1] must be an integer token id"),
        ({"prompt": [1, -2]}, "prompt[1] must be an integer token id"),
        ({"prompt": [[1], [True]]}, "prompt[1][0] must be an integer token id"),
        ({"prompt": [None]}, "prompt[0] must be a string, an integer token id"),
    ],
)
def test_malformed_bodies_raise_errors_naming_the_bad_field(
    gpt4o: ModelTokenizer, body: Any, message: str
) -> None:
    with pytest.raises(MalformedRequest) as caught:
        count_prompt_tokens(body, gpt4o)
    assert message in caught.value.message
    error = caught.value.to_openai_error()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == caught.value.message
    assert caught.value.status == 400


def test_lone_surrogates_in_content_are_counted_not_crashed_on(
    registry: TokenizerRegistry,
) -> None:
    for model in ("gpt-4o", "mixtral-8x7b", "unknown"):
        tok = registry.counter_for(model)
        dirty = {"messages": [{"role": "user", "content": "bad \ud800 text \udfff"}]}
        clean = {"messages": [{"role": "user", "content": "bad \ufffd text \ufffd"}]}
        assert count_prompt_tokens(dirty, tok) >= count_prompt_tokens(clean, tok) > 0


def test_ten_thousand_tiny_messages_are_counted_exactly(gpt4o: ModelTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}] * 10_000}
    assert count_prompt_tokens(body, gpt4o) == 3 + 10_000 * (3 + 1 + 1)


def test_one_megabyte_prompt_is_counted_like_the_tokenizer_counts_it(
    gpt4o: ModelTokenizer,
) -> None:
    text = ("Token quotas need real counts, 12345 times over! 你好 ") * 19_000
    assert len(text.encode()) > 1_000_000
    assert count_prompt_tokens({"prompt": text}, gpt4o) == gpt4o.count(text)
    chat = {"messages": [{"role": "user", "content": text}]}
    assert count_prompt_tokens(chat, gpt4o) == 3 + 1 + gpt4o.count(text) + 3


def test_limits_bound_messages_parts_and_tool_calls(gpt4o: ModelTokenizer) -> None:
    limits = Limits(max_messages=5, max_content_parts=10, max_tool_calls=2, max_prompts=3)
    with pytest.raises(MalformedRequest, match="at most 5"):
        count_prompt_tokens(
            {"messages": [{"role": "user", "content": "x"}] * 6}, gpt4o, limits=limits
        )
    parts = [{"type": "text", "text": "x"}] * 4
    with pytest.raises(MalformedRequest, match="more than 10 content parts"):
        count_prompt_tokens(
            {"messages": [{"role": "user", "content": parts}] * 3}, gpt4o, limits=limits
        )
    call = {"id": "c", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(MalformedRequest, match="more than 2 tool calls"):
        count_prompt_tokens(
            {"messages": [{"role": "assistant", "tool_calls": [call, call, call]}]},
            gpt4o,
            limits=limits,
        )
    with pytest.raises(MalformedRequest, match="at most 3"):
        count_prompt_tokens({"prompt": ["a"] * 4}, gpt4o, limits=limits)


def test_deeply_nested_tool_schema_is_an_error_not_a_recursion_crash(
    gpt4o: ModelTokenizer,
) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5_000):
        schema = {"type": "object", "properties": {"x": schema}}
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    with pytest.raises(MalformedRequest, match=r"tools\[0\].function cannot be rendered"):
        count_prompt_tokens(body, gpt4o)


def test_deeply_nested_content_arrays_are_rejected_at_the_first_level(
    gpt4o: ModelTokenizer,
) -> None:
    nested: list[Any] = ["x"]
    for _ in range(10_000):
        nested = [nested]
    with pytest.raises(MalformedRequest, match=r"messages\[0\].content\[0\] must be an object"):
        count_prompt_tokens({"messages": [{"role": "user", "content": nested}]}, gpt4o)


def test_counting_does_not_modify_the_body(gpt4o: ModelTokenizer) -> None:
    body = {"messages": copy.deepcopy(COOKBOOK_MESSAGES), "tools": []}
    snapshot = copy.deepcopy(body)
    count_prompt_tokens(body, gpt4o)
    assert body == snapshot
