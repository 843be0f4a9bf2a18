"""The fields the meter reads are spelt exactly: a key that another parser reads as one is a 400.

Go's ``encoding/json`` (llm-d-inference-sim, many Go model servers and proxies) matches a
key to a struct field ignoring case, an exact match preferred, and the last key for a field
wins: next to ``"max_tokens": 16``, ``"MAX_TOKENS": 1000`` asks a Go upstream for 1,000
tokens while the meter reserved 16. Its case folding maps four non-ASCII letters to ASCII
ones (``ſ`` to S, the Kelvin sign to K, ``ı`` and ``İ`` to I), and ``encoding/json/v2``'s
``nocase`` matching ignores ``_`` and ``-`` as well (``maxTokens``). So in every object the
meter reads, a key that folds that way to one of the fields it reads there, without being
that field's exact spelling, is refused before anything is charged or forwarded.

Keys the meter does not read are left alone, in any spelling: whichever one the upstream
honours (``LOGPROBS``, ``Ignore_Eos``), the meter's count never depended on it. Free-form
objects (a tool's JSON schema, ``metadata``) are not looked into. Duplicate keys need no
rule: the body is parsed once (orjson keeps the last) and forwarded re-serialised from
that parse, each key once (``extproc.admission.request``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from extproc.admission.errors import invalid_request

# Go's fold of these runes is an ASCII letter; any other non-ASCII rune stays non-ASCII.
_TO_ASCII: Final = str.maketrans(
    {"\u017f": "S", "\u212a": "K", "\u0131": "I", "\u0130": "I", "_": None, "-": None}
)


def fold(key: str) -> str | None:
    """The key as a field name folds for matching (case, Go's four runes, ``_`` and ``-``);
    None when it cannot match an ASCII field name."""
    folded = key.translate(_TO_ASCII)
    return folded.upper() if folded.isascii() else None


@dataclass(frozen=True, slots=True)
class Shape:
    """The fields the meter reads (or writes) in one kind of object."""

    fields: frozenset[str]
    folded: dict[str, str]  # fold(field) -> field

    @classmethod
    def of(cls, fields: Iterable[str]) -> Shape:
        names = frozenset(fields)
        return cls(names, {fold(n) or n: n for n in names})


TOP: Final = Shape.of(
    (
        "model", "messages", "prompt", "suffix", "stream", "stream_options", "n",
        "max_tokens", "max_completion_tokens", "tools", "functions",
    )
)  # fmt: skip
STREAM_OPTIONS: Final = Shape.of(("include_usage", "continuous_usage_stats"))
MESSAGE: Final = Shape.of(
    ("role", "content", "name", "tool_calls", "function_call", "tool_call_id", "refusal")
)
PART: Final = Shape.of(("type", "text", "refusal", "image_url", "input_audio", "file"))
TOOL_CALL: Final = Shape.of(("id", "type", "function"))
CALL: Final = Shape.of(("name", "arguments"))
# A tool definition's ``function`` (and a legacy ``functions`` item) is counted as its whole
# JSON, every key included: no spelling escapes it.
TOOL: Final = Shape.of(("type", "function"))


def check_field_names(body: dict[str, Any]) -> None:
    """Raises a 400 ``unknown_parameter`` naming the first key another parser would read
    as a field the meter reads under its exact name (``messages[2].CONTENT``)."""
    _check(body, TOP, "")
    options = body.get("stream_options")
    if type(options) is dict:
        _check(options, STREAM_OPTIONS, "stream_options.")
    messages = body.get("messages")
    if type(messages) is list:
        fields = MESSAGE.fields
        for i, message in enumerate(messages):
            # Per message the usual case costs a subset test and a length: the path of a
            # key is only spelt out once there is one to refuse.
            if type(message) is not dict:
                continue
            if not message.keys() <= fields:
                _check(message, MESSAGE, f"messages[{i}].")
            if len(message) > 2 or type(message.get("content")) is list:
                _check_message_parts(message, f"messages[{i}].")
    tools = body.get("tools")
    if type(tools) is list:
        for i, tool in enumerate(tools):
            if type(tool) is dict and not tool.keys() <= TOOL.fields:
                _check(tool, TOOL, f"tools[{i}].")


def _check_message_parts(message: dict[str, Any], where: str) -> None:
    content = message.get("content")
    if type(content) is list:
        fields = PART.fields
        for j, part in enumerate(content):
            if type(part) is dict and not part.keys() <= fields:
                _check(part, PART, f"{where}content[{j}].")
    calls = message.get("tool_calls")
    if type(calls) is list:
        for k, call in enumerate(calls):
            if type(call) is not dict:
                continue
            if not call.keys() <= TOOL_CALL.fields:
                _check(call, TOOL_CALL, f"{where}tool_calls[{k}].")
            function = call.get("function")
            if type(function) is dict and not function.keys() <= CALL.fields:
                _check(function, CALL, f"{where}tool_calls[{k}].function.")
    legacy = message.get("function_call")
    if type(legacy) is dict:
        _check(legacy, CALL, f"{where}function_call.")


def _check(obj: dict[str, Any], shape: Shape, where: str) -> None:
    if obj.keys() <= shape.fields:
        return  # the usual case, a subset test in C: every key is a field, spelt exactly
    for key in obj:
        if key in shape.fields:
            continue
        field = shape.folded.get(fold(key) or "")
        if field is not None:
            raise invalid_request(
                f"Unrecognized request argument supplied: '{where}{key}'. Field names are "
                f"case-sensitive: the gateway meters '{where}{field}'.",
                "unknown_parameter",
                f"{where}{key}",
            )
