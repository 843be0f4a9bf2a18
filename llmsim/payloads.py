"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked field by field.

Every malformed field becomes a 400 naming it (``param``), never an exception escaping into
the server, so a gateway under test can send garbage and the simulator keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmsim.errors import ApiError
from llmsim.tokens import TokenCodec

Kind = Literal["chat", "text"]
# Chat prompt overheads per template: (per message, per name, reply priming). "openai" is
# OpenAI's published counting rule (3 per message, +1 for a name, 3 to prime the reply);
# "llama" is the Mistral/Llama [INST] template ("[INST]" 3 + " [/INST]" 4 per message, BOS
# as priming), the same figures the gateway's prompt counter uses.
CHAT_OVERHEADS: dict[str, tuple[int, int, int]] = {"openai": (3, 1, 3), "llama": (7, 1, 1)}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    ignore_eos: bool
    messages: tuple[tuple[str, str, str | None], ...]  # (role, text, name)
    prompt: tuple[str | list[int], ...]
    suffix: str = ""

    @property
    def echo_text(self) -> str:
        """What echo mode answers: the last message's text, or the (first) prompt."""
        if self.kind == "chat":
            return self.messages[-1][1] if self.messages else ""
        first = self.prompt[0] if self.prompt else ""
        return first if isinstance(first, str) else ""

    def prompt_tokens(self, codec: TokenCodec) -> int:
        if self.kind == "chat":
            per_message, per_name, priming = CHAT_OVERHEADS[codec.chat_template]
            total = priming
            for role, text, name in self.messages:
                total += per_message + codec.count(role) + codec.count(text)
                if name:
                    total += per_name + codec.count(name)
            return total
        prompt = sum(codec.count(p) if isinstance(p, str) else len(p) for p in self.prompt)
        return prompt + (codec.count(self.suffix) if self.suffix else 0)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def _optional_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean, got {type(value).__name__}", key)
    return value


def _optional_positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer, got {type(value).__name__}", key)
    if value < 1:
        raise _bad(f"'{key}' must be at least 1, got {value}", key)
    return value


def _content_text(content: object, index: int) -> str:
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad("each content part must be an object with a 'type'", param)
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad("a text content part needs a string 'text'", param)
                texts.append(part["text"])
        return "".join(texts)
    raise _bad("'content' must be a string, a list of content parts or null", param)


def _messages(body: dict[str, Any]) -> tuple[tuple[str, str, str | None], ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of message objects", "messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string", f"messages[{i}].role")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
        out.append((role, _content_text(message.get("content"), i), name))
    return tuple(out)


def _prompt(body: dict[str, Any]) -> tuple[str | list[int], ...]:
    raw = body.get("prompt")
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return tuple(raw)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
            return (list(raw),)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in raw):
            return tuple(raw)
    raise _bad("'prompt' must be a string, a list of strings or a list of token ids", "prompt")


def parse_request(kind: Kind, body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    model = body.get("model")
    if model is None:
        raise _bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {type(model).__name__}", "model")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    options = options or {}
    include_usage = _optional_bool(options, "include_usage")
    continuous = _optional_bool(options, "continuous_usage_stats")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise _bad("'n' must be a positive integer", "n")
    if n is not None and n > 1:
        raise _bad("llmsim generates one choice per request; 'n' must be 1", "n")
    max_tokens = _optional_positive_int(body, "max_tokens")
    if kind == "chat":
        max_completion = _optional_positive_int(body, "max_completion_tokens")
        if max_completion is not None:
            max_tokens = max_completion
    return GenerationRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        ignore_eos=_optional_bool(body, "ignore_eos"),
        messages=_messages(body) if kind == "chat" else (),
        prompt=_prompt(body) if kind == "text" else (),
        suffix=_optional_str(body, "suffix") if kind == "text" else "",
    )


def _optional_str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(f"'{key}' must be a string", key)
    return value
