"""A metered field spelt otherwise cannot reach the upstream: what Go reads is what was metered.

Go's ``encoding/json`` (llm-d-inference-sim v0.10.2 and many Go servers and proxies) reads a
key as a field ignoring case, and the last key for a field wins; its v2 ``nocase`` matching
ignores ``_`` and ``-`` too. ``tests.support.go_json.GoView`` reads a body that way, written
from those rules (not from the processor's code); the tests hold the forwarded body to it.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission.errors import ApiError
from extproc.admission.field_names import fold
from extproc.admission.request import ModelRequest, parse_model_request
from extproc.config import Config, parse_config
from extproc.endpoints import Endpoint
from tests.support.go_json import GO_ASCII_RUNES, GoView

CONFIG: Config = parse_config(
    {
        "models": {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}},
        "plans": {"p": {"limits": {"*": {"rpm": 10}}}},
        "tenants": {"t": {"plan": "p", "key_sha256": ["0" * 64]}},
    }
)
HI = [{"role": "user", "content": "hi"}]


def parse(body: dict[str, Any] | bytes, endpoint: Endpoint = "chat") -> ModelRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_model_request(endpoint, raw, CONFIG)


def refusal(body: dict[str, Any] | bytes, endpoint: Endpoint = "chat") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, endpoint)
    return info.value


# --- how Go reads field names -------------------------------------------------------------


def test_go_folds_exactly_four_non_ascii_runes_to_ascii_letters_and_so_does_the_gateway() -> None:
    assert GO_ASCII_RUNES == {"\u0130": "I", "\u0131": "I", "\u017f": "S", "\u212a": "K"}
    for rune, letter in GO_ASCII_RUNES.items():
        assert fold(rune) == letter, unicodedata.name(rune)
    assert fold("max_tok\u00e9ns") is None  # any other non-ASCII rune: no ASCII name
    assert fold("max_to\u212aen\u017f") == fold("max_tokens") == "MAXTOKENS"


# --- every variant of every metered field --------------------------------------------------


def variants(field: str) -> list[str]:
    """Spellings a case-insensitive (or v2 nocase) parser reads as ``field``."""
    out = {field.upper(), field.title(), field[:1].upper() + field[1:]}
    out.add(field.replace("s", "\u017f").replace("k", "\u212a").replace("i", "\u0131"))
    head, *rest = field.split("_")
    out.add(head + "".join(r.title() for r in rest))  # camelCase
    out.add(field.replace("_", "-"))
    out.add(field.replace("_", ""))
    out.add(field + "_")
    out.discard(field)
    return sorted(out)


def at_top(key: str, value: Any = 1) -> dict[str, Any]:
    return {"model": "gpt-4.1", "messages": HI, key: value}


def in_stream_options(key: str) -> dict[str, Any]:
    return {"model": "gpt-4.1", "messages": HI, "stream": True, "stream_options": {key: True}}


def in_message(key: str) -> dict[str, Any]:
    return {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi", key: "x"}]}


def in_part(key: str) -> dict[str, Any]:
    part = {"type": "text", "text": "hi", key: "x"}
    return {"model": "gpt-4.1", "messages": [{"role": "user", "content": [part]}]}


def in_tool_call(key: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, key: 1}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"model": "gpt-4.1", "messages": [*HI, message]}


def in_call(key: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", key: 1}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"model": "gpt-4.1", "messages": [*HI, message]}


def in_function_call(key: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": None, "function_call": {"name": "f", key: "x"}}
    return {"model": "gpt-4.1", "messages": [*HI, message]}


def in_tool(key: str) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}, key: {"name": "g"}}
    return {"model": "gpt-4.1", "messages": HI, "tools": [tool]}


TOP_FIELDS = (
    "model", "messages", "prompt", "suffix", "stream", "stream_options", "n", "max_tokens",
    "max_completion_tokens", "tools", "functions",
)  # fmt: skip
PLACES: list[tuple[str, Callable[[str], dict[str, Any]], tuple[str, ...], str]] = [
    ("top", at_top, TOP_FIELDS, ""),
    ("stream_options", in_stream_options, ("include_usage", "continuous_usage_stats"),
     "stream_options."),
    ("message", in_message,
     ("role", "content", "name", "tool_calls", "function_call", "tool_call_id", "refusal"),
     "messages[0]."),
    ("part", in_part, ("type", "text", "refusal", "image_url", "input_audio", "file"),
     "messages[0].content[0]."),
    ("tool_call", in_tool_call, ("id", "type", "function"), "messages[1].tool_calls[0]."),
    ("call", in_call, ("name", "arguments"), "messages[1].tool_calls[0].function."),
    ("function_call", in_function_call, ("name", "arguments"), "messages[1].function_call."),
    ("tool", in_tool, ("type", "function"), "tools[0]."),
]  # fmt: skip
CASES = [
    pytest.param(make, field, key, where, id=f"{place}-{key}")
    for place, make, fields, where in PLACES
    for field in fields
    for key in variants(field)
]


@pytest.mark.parametrize(("make", "field", "key", "where"), CASES)
def test_a_metered_field_spelt_otherwise_is_refused_naming_the_key(
    make: Callable[[str], dict[str, Any]], field: str, key: str, where: str
) -> None:
    error = refusal(make(key))
    assert (error.status, error.type, error.code) == (400, "invalid_request_error",
                                                      "unknown_parameter")  # fmt: skip
    assert error.param == where + key
    assert f"'{where}{key}'" in error.message and f"'{where}{field}'" in error.message


def test_the_smuggled_max_tokens_of_llm_d_is_refused_on_both_endpoints() -> None:
    chat = {"model": "gpt-4.1", "messages": HI, "max_tokens": 16, "MAX_TOKENS": 1000}
    text = {"model": "gpt-4.1", "prompt": "hi", "max_tokens": 16, "MAX_TOKENS": 1000}
    assert refusal(chat).param == refusal(text, "completions").param == "MAX_TOKENS"
    assert refusal({**at_top("N", 8), "n": 1}).param == "N"
    assert refusal({**at_top("Stream", True), "stream": False}).param == "Stream"
    assert refusal(at_top("Model", "other-model")).param == "Model"


def test_fields_the_meter_does_not_read_pass_in_any_spelling() -> None:
    body = at_top("LOGPROBS", True)
    body.update({"Ignore_Eos": True, "TEMPERATURE": 0.5, "Top_P": 1, "USER": "u", "seed": 1})
    request = parse(body)
    assert orjson.loads(request.new_body)["LOGPROBS"] is True


def test_free_form_objects_are_not_looked_into() -> None:
    schema = {
        "type": "object",
        "properties": {"Content": {"type": "string"}, "MAX_TOKENS": {"type": "integer"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "Name": "x"}}
    body = {
        "model": "gpt-4.1",
        "messages": HI,
        "tools": [tool],
        "functions": [{"name": "g", "Parameters": {}}],
        "metadata": {"Model": "x", "MAX_TOKENS": "1"},
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    request = parse(body)
    assert request.new_body == orjson.dumps({**body, "max_tokens": request.max_tokens})


def test_a_duplicate_key_reaches_the_upstream_once_with_the_value_metered() -> None:
    raw = (
        b'{"model": "gpt-4.1", "max_tokens": 2000, "stream": false, "n": 3,'
        b' "messages": [{"role": "user", "content": "a long one"}],'
        b' "stream_options": {"include_usage": false, "include_usage": false},'
        b' "max_tokens": 16, "stream": true, "n": 1,'
        b' "messages": [{"role": "user", "content": "hi", "content": "ho"}]}'
    )
    request = parse(raw)
    sent = request.new_body
    for key in (b'"max_tokens"', b'"stream"', b'"n"', b'"messages"', b'"include_usage"'):
        assert sent.count(key) == 1, key
    go = GoView(sent)
    assert go.field(go.doc, "max_tokens") == request.max_tokens == 16
    assert go.field(go.doc, "stream") is request.stream is True
    assert go.field(go.doc, "n") == request.choices == 1
    (message,) = go.field(go.doc, "messages")
    assert go.field(message, "content") == "ho"
    assert go.field(go.field(go.doc, "stream_options"), "include_usage") is True  # forced


# --- property: whatever the keys, a Go reader of the forwarded body sees what was metered --

SCALARS = {
    "max_tokens": st.integers(1, 5000),
    "max_completion_tokens": st.integers(1, 5000),
    "n": st.integers(1, 4),
    "stream": st.booleans(),
    "model": st.sampled_from(["gpt-4.1", "other"]),
}


def spelling(field: str) -> st.SearchStrategy[str]:
    return st.sampled_from([field, field, *variants(field)])


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A chat body as raw JSON with any spelling and any repetition of its metered keys;
    and whether a key that survives the parse is a variant (not the exact spelling)."""
    pairs: list[tuple[str, Any]] = [("model", "gpt-4.1"), ("messages", HI)]
    for _ in range(draw(st.integers(0, 6))):
        field = draw(st.sampled_from(sorted(SCALARS)))
        pairs.append((draw(spelling(field)), draw(SCALARS[field])))
    message: list[tuple[str, Any]] = [("role", "user"), ("content", "hi")]
    for _ in range(draw(st.integers(0, 2))):
        message.append((draw(spelling("content")), draw(st.sampled_from(["x", "a b c" * 50]))))
    pairs.append(("messages", [message]))
    options: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(0, 2))):
        options.append((draw(spelling("include_usage")), draw(st.booleans())))
    if options:
        pairs.append(("stream_options", options))
    pairs = draw(st.permutations(pairs))
    exact = {*SCALARS, "messages", "stream_options", "role", "content", "include_usage"}

    def render(value: Any) -> str:
        if isinstance(value, list) and value and isinstance(value[0], tuple):
            return "{" + ", ".join(f"{json.dumps(k)}: {render(v)}" for k, v in value) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(render(v) for v in value) + "]"
        return json.dumps(value)

    # The keys that survive the parse (the last of each exact name) are the ones forwarded.
    top = dict(pairs)
    keys = list(top)
    if top["messages"] is not HI:
        keys += list(dict(message))
    keys += list(dict(top.get("stream_options", [])))
    return render(pairs).encode(), any(k not in exact for k in keys)


@settings(max_examples=300, deadline=None)
@given(bodies(), st.booleans())
def test_a_go_reader_of_the_forwarded_body_reads_what_was_metered(
    drawn: tuple[bytes, bool], nocase_v2: bool
) -> None:
    raw, has_variant = drawn
    try:
        request = parse(raw)
    except ApiError as error:
        assert error.code in ("unknown_parameter", "model_not_found", "invalid_value"), error
        if error.code == "unknown_parameter":
            assert has_variant
        return
    assert not has_variant
    go = GoView(request.new_body, nocase_v2)
    assert go.field(go.doc, "model") == "gpt-4.1"
    assert bool(go.field(go.doc, "stream")) is request.stream
    assert (go.field(go.doc, "n") or 1) == request.choices
    limits = [go.field(go.doc, f) for f in ("max_tokens", "max_completion_tokens")]
    assert {v for v in limits if v is not None} == {request.max_tokens}
    (message,) = go.field(go.doc, "messages")
    assert go.field(message, "content") == request.body["messages"][0]["content"]
    if request.stream:
        options = go.field(go.doc, "stream_options")
        assert go.field(options, "include_usage") is True
