"""Tokens used by an answer read whole: a JSON completion, or an event stream that came
without ``text/event-stream``. Pure functions of the body, the tokenizer and the upstream's
own usage; the meter decides when they apply.

Rules (README, "Quota semantics"):

* The upstream's ``usage`` counts when it is there and well-formed, but the output billed is
  never below the processor's own count of the text it saw.
* With no usable ``usage``, the answer's text is counted with the model's tokenizer.
* When nothing can be read (not JSON, not SSE, not UTF-8, over the size limit) the
  caller keeps the reservation: ``None`` here means "unreadable", never "free".
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.billing.sse import MALFORMED, SseProtocolError, SseReassembler, parse_json_data
from extproc.tokens.model_tokenizer import ModelTokenizer

# Where the generated text sits in a choice of a completion, a chunk, or a message.
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


def choice_text(choice: Any) -> str:
    """All generated text of one choice: message or delta, legacy ``text``, tool calls."""
    if type(choice) is not dict:
        return ""
    parts: list[str] = []
    text = choice.get("text")  # /v1/completions
    if isinstance(text, str):
        parts.append(text)
    for holder in (choice.get("message"), choice.get("delta")):
        if not isinstance(holder, dict):
            continue
        for name in _TEXT_FIELDS:
            value = holder.get(name)
            if isinstance(value, str):
                parts.append(value)
        calls = holder.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    for name in ("name", "arguments"):
                        value = function.get(name)
                        if isinstance(value, str):
                            parts.append(value)
    return "".join(parts)


# (prompt, completion, cached prompt) tokens of an upstream's usage object.
Usage = tuple[int, int, int]


def usage_counts(usage: Any) -> Usage | None:
    """``(prompt, completion, cached)`` from a well-formed usage object, else None. Cached
    prompt tokens (``prompt_tokens_details.cached_tokens``) are 0 when absent or not within
    the prompt: a cost limit prices them lower, so a wrong figure must not lower the bill."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    for value in (prompt, completion):
        if type(value) is not int or value < 0:
            return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is not int or not 0 <= cached <= prompt:  # type: ignore[operator]
        cached = 0
    return prompt, completion, cached  # type: ignore[return-value]


def billed(prompt: int, counted_output: int, usage: Usage | None) -> tuple[int, int]:
    """``(prompt, output)`` to commit: the upstream's figures, output never below our count."""
    if usage is None:
        return prompt, counted_output
    return usage[0], max(usage[1], counted_output)


def read_answer(body: bytes, tokenizer: ModelTokenizer) -> tuple[int, Usage | None] | None:
    """``(our output count, the upstream's usage)`` of a whole answer; None if unreadable."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _read_event_stream(body, tokenizer)
    if not isinstance(doc, dict):
        return None
    choices = doc.get("choices")
    usage = usage_counts(doc.get("usage"))
    if not isinstance(choices, list):
        return (0, usage) if usage is not None else None
    counted = sum(tokenizer.count(choice_text(c)) for c in choices)
    return counted, usage


def _read_event_stream(body: bytes, tokenizer: ModelTokenizer) -> tuple[int, Usage | None] | None:
    """An SSE body under another content type: count each choice's text, keep the usage."""
    reassembler = SseReassembler()
    try:
        events = reassembler.feed(body)
        events.extend(reassembler.finish())
    except SseProtocolError:
        return None
    texts: dict[Any, list[str]] = {}
    usage: Usage | None = None
    seen_data = False
    for event in events:
        chunk = parse_json_data(event)
        if chunk is None or chunk is MALFORMED:
            continue
        seen_data = True
        usage = usage_counts(chunk.get("usage")) or usage
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                index = choice.get("index", 0) if isinstance(choice, dict) else 0
                texts.setdefault(index, []).append(choice_text(choice))
    if not seen_data:
        return None
    counted = sum(tokenizer.count("".join(parts)) for parts in texts.values())
    return counted, usage
