"""Request bodies read the way v0.10.2's Go structs read them, then its validation.

Go's ``encoding/json`` matches a body's keys to fields case-insensitively (an exact match
is preferred) and the last key for a field wins, so ``{"max_tokens": 16, "MAX_TOKENS": 900}``
asks for 900 tokens there; unknown keys are ignored; ``null`` leaves a field unset; a
number with a fraction or an exponent does not fit an integer field. A body that does not
fit is a 400 ``Failed to read and parse request body, ...`` (the text after the comma is
ours, not Go's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from llmsim.llmd.tokenizer import ChatMessage

Kind = Literal["chat", "text"]
_INT64 = (-(2**63), 2**63 - 1)
_UINT32 = (0, 2**32 - 1)


class BodyError(ValueError):
    """The body does not fit the request struct (a 400)."""


class RequestError(Exception):
    """An OpenAI-style error the real simulator answers with: status, message, param."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` "" (not given), "none", "auto", "required", any other string, or "function"."""

    mode: str = ""
    function: str | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """One text-completions prompt: text, or token ids."""

    text: str = ""
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    n: int | None
    max_tokens: int | None
    ignore_eos: bool
    messages: tuple[ChatMessage, ...] = ()
    prompts: tuple[Prompt, ...] | None = None
    tools: tuple[ToolSpec, ...] | None = None
    tool_choice: ToolChoice = ToolChoice()
    logprobs: int | None = None  # None: not asked; else the number of top alternatives
    remote_decode: bool = False

    @property
    def choices(self) -> int:
        return self.n if self.n is not None and self.n > 0 else 1

    @property
    def send_usage(self) -> bool:
        return not self.stream or self.include_usage


# --- Go-style field access ----------------------------------------------------------------


def _fields(obj: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Field name -> value, matched as encoding/json does (exact first, else any case)."""
    lowered = {n.lower(): n for n in names}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = key if key in names else lowered.get(key.lower())
        if name is not None:
            out[name] = value
    return out


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return f"number {orjson.dumps(value).decode()}"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _mismatch(value: object, where: str, go_type: str) -> BodyError:
    return BodyError(
        f"json: cannot unmarshal {_kind(value)} into Go struct field {where} of type {go_type}"
    )


def _string(f: dict[str, Any], name: str, where: str) -> str:
    value = f.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _mismatch(value, f"{where}.{name}", "string")
    return value


def _bool(f: dict[str, Any], name: str, where: str) -> bool:
    value = f.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _mismatch(value, f"{where}.{name}", "bool")
    return value


def _integer(value: object, where: str, go_type: str, bounds: tuple[int, int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not bounds[0] <= value <= bounds[1]:
        raise _mismatch(value, where, go_type)
    return value


def _optional_int(f: dict[str, Any], name: str, where: str) -> int | None:
    value = f.get(name)
    if value is None:
        return None
    return _integer(value, f"{where}.{name}", "int64", _INT64)


def _object(value: object, where: str, go_type: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _mismatch(value, where, go_type)
    return value


def _array(value: object, where: str, go_type: str) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _mismatch(value, where, go_type)
    return value


# --- chat messages ------------------------------------------------------------------------


def _content_text(value: object) -> str:
    """ChatComplContent: a string, or content blocks (text joined by "\\n", images as text)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        parts: list[str] = []
        for block in value:
            if not isinstance(block, dict):
                raise BodyError("content format not supported")
            f = _fields(block, ("type", "text", "image_url", "input_audio", "video_url"))
            kind, text, image = f.get("type"), f.get("text"), f.get("image_url")
            if not isinstance(kind, str | None) or not isinstance(text, str | None):
                raise BodyError("content format not supported")
            url = ""
            if image is not None:
                if not isinstance(image, dict):
                    raise BodyError("content format not supported")
                url_value = _fields(image, ("url",)).get("url")
                if not isinstance(url_value, str | None):
                    raise BodyError("content format not supported")
                url = url_value or ""
            if kind == "text":
                parts.append(text or "")
            elif kind == "image_url" and image is not None:
                parts.append("image: " + url)
        return "\n".join(parts)
    raise BodyError("content format not supported")


def _tool_calls(value: object, where: str) -> tuple[tuple[str, str], ...]:
    calls = _array(value, f"{where}.tool_calls", "[]api.ToolCall") or []
    out = []
    for call in calls:
        f = _fields(_object(call, f"{where}.tool_calls", "api.ToolCall") or {}, ("function",))
        fn_obj = _object(f.get("function"), f"{where}.tool_calls.function", "api.FunctionCall")
        fn = _fields(fn_obj or {}, ("name", "arguments"))
        name = fn.get("name")
        if name is not None and not isinstance(name, str):
            raise _mismatch(name, f"{where}.tool_calls.function.name", "string")
        arguments = _string(fn, "arguments", f"{where}.tool_calls.function")
        if name is not None:
            out.append((name, arguments))
    return tuple(out)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    where = "ChatCompletionsRequest.messages"
    raw = _array(value, where, "[]api.Message") or []
    out = []
    for message in raw:
        m = _object(message, where, "api.Message") or {}
        f = _fields(m, ("role", "content", "tool_calls", "tool_call_id"))
        out.append(
            ChatMessage(
                role=_string(f, "role", where),
                text=_content_text(f.get("content")),
                tool_call_id=_string(f, "tool_call_id", where),
                tool_calls=_tool_calls(f.get("tool_calls"), where),
            )
        )
    return tuple(out)


def _tools(value: object) -> tuple[ToolSpec, ...] | None:
    where = "ChatCompletionsRequest.tools"
    raw = _array(value, where, "[]api.Tool")
    if raw is None:
        return None
    out = []
    for tool in raw:
        f = _fields(_object(tool, where, "api.Tool") or {}, ("function", "type"))
        _string(f, "type", where)
        fn_where = f"{where}.function"
        fn_obj = _object(f.get("function"), fn_where, "api.function")
        fn = _fields(fn_obj or {}, ("name", "parameters", "description"))
        params = _object(fn.get("parameters"), f"{fn_where}.parameters", "map[string]interface {}")
        out.append(
            ToolSpec(
                name=_string(fn, "name", fn_where),
                description=_string(fn, "description", fn_where),
                parameters=params,
            )
        )
    return tuple(out)


def _tool_choice(f: dict[str, Any]) -> ToolChoice:
    if "tool_choice" not in f:
        return ToolChoice()
    value = f["tool_choice"]
    if isinstance(value, str):
        return ToolChoice(mode=value)
    kind = value.get("type") if isinstance(value, dict) else None
    if value is not None and not isinstance(value, dict):
        raise BodyError("failed to detect type for ToolChoice")
    if kind == "function":
        function = _fields(value, ("function",)).get("function")
        name = function.get("name") if isinstance(function, dict) else None
        return ToolChoice(mode="function", function=name if isinstance(name, str) else "")
    if kind in ("custom", "allowed_tools"):
        return ToolChoice(mode=kind)
    # null comes here too: Go hands it to the custom decoder, which finds no type.
    raise BodyError(f"unknown ToolChoice type: {kind if isinstance(kind, str) else ''}")


# --- text prompts -------------------------------------------------------------------------


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    low, high = _UINT32
    if all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value):
        return tuple(value)
    return None


def _prompts(value: object) -> tuple[Prompt, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (Prompt(text=value),)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return tuple(Prompt(text=v) for v in value)
        ids = _token_ids(value)
        if ids is not None:
            return (Prompt(ids=ids),)
        if all(isinstance(v, list) for v in value):
            lists = [_token_ids(v) for v in value]
            if all(ids is not None for ids in lists):
                return tuple(Prompt(ids=ids) for ids in lists)
    raise BodyError(
        "prompt must be a string, an array of strings, an array of token ids, "
        "or an array of arrays of token ids"
    )


# --- the whole body -----------------------------------------------------------------------

_COMMON = (
    "model",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "ignore_eos",
    "kv_transfer_params",
)
_CHAT = (
    *_COMMON,
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "logprobs",
    "top_logprobs",
)
_TEXT = (*_COMMON, "prompt", "logprobs")


def parse_body(kind: Kind, raw: bytes) -> ParsedRequest:
    """The request, or BodyError where v0.10.2 fails to unmarshal the body."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(str(exc)) from exc
    where = "ChatCompletionsRequest" if kind == "chat" else "TextCompletionsParsedRequest"
    if body is None:
        body = {}  # a JSON null leaves every field at its zero value
    if not isinstance(body, dict):
        raise BodyError(f"json: cannot unmarshal {_kind(body)} into Go value of type {where}")
    f = _fields(body, _CHAT if kind == "chat" else _TEXT)
    options = _object(f.get("stream_options"), f"{where}.stream_options", "api.StreamOptions")
    include_usage = _bool(_fields(options or {}, ("include_usage",)), "include_usage", where)
    n = f.get("n")
    if n is not None:
        n = _integer(n, f"{where}.n", "int", _INT64)
    kv = _object(f.get("kv_transfer_params"), f"{where}.kv_transfer_params", "api.KVTransferParams")
    remote_decode = _bool(_fields(kv or {}, ("do_remote_decode",)), "do_remote_decode", where)
    max_tokens = _optional_int(f, "max_tokens", where)
    common: dict[str, Any] = {
        "kind": kind,
        "model": _string(f, "model", where),
        "stream": _bool(f, "stream", where),
        "include_usage": include_usage,
        "n": n,
        "ignore_eos": _bool(f, "ignore_eos", where),
        "remote_decode": remote_decode,
    }
    if kind == "chat":
        completion = _optional_int(f, "max_completion_tokens", where)
        top = f.get("top_logprobs")
        top_n = None if top is None else _integer(top, f"{where}.top_logprobs", "int", _INT64)
        wants = _bool(f, "logprobs", where)
        return ParsedRequest(
            **common,
            max_tokens=completion if completion is not None else max_tokens,
            messages=_messages(f.get("messages")),
            tools=_tools(f.get("tools")),
            tool_choice=_tool_choice(f),
            logprobs=(top_n if top_n is not None else 1) if wants else None,
        )
    logprobs = f.get("logprobs")
    return ParsedRequest(
        **common,
        max_tokens=max_tokens,
        prompts=_prompts(f.get("prompt")),
        logprobs=None
        if logprobs is None
        else _integer(logprobs, f"{where}.logprobs", "int", _INT64),
    )


def validate(req: ParsedRequest) -> None:
    """v0.10.2's checks after the model is known (tools are checked before, by ``tools``)."""
    if req.kind == "text":
        if not req.prompts:
            raise RequestError(400, "prompt array must contain at least one prompt")
        for prompt in req.prompts:
            if prompt.ids is not None and not prompt.ids:
                raise RequestError(400, "prompt must not contain an empty token-id array")
            if prompt.ids is None and not prompt.text:
                raise RequestError(400, "prompt must not contain an empty string")
    if req.n is not None and req.n <= 0:
        raise RequestError(400, "n must be at least 1")
    if req.max_tokens is not None and req.max_tokens <= 0:
        raise RequestError(400, "Max completion tokens and max tokens should be positive")
    if req.remote_decode and req.stream:
        raise RequestError(400, "Prefill does not support streaming")
    if req.ignore_eos and req.max_tokens is None:
        raise RequestError(
            400, "Ignore_eos is true but max_completion_tokens (or max_tokens) is not set"
        )
