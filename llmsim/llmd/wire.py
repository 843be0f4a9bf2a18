"""v0.10.2's response bodies and SSE chunks, field for field in its structs' order.

A chunk is ``{"id", "model", "object", "created", "usage": null, "choices": [...]}``; a chat
choice is ``{"index", "finish_reason", "delta", "logprobs"?}`` where the delta holds only
what is set (``{"role": "assistant"}``, ``{"content": ...}``, ``{"tool_calls": [...]}`` or
``{}``). Usage always carries ``prompt_tokens_details: {"cached_tokens": 0}``. Logprobs are
the real simulator's synthetic ones: ``-1 - 0.1 × (position mod 3)`` for the token and
``0.5`` less per alternative, the alternatives named ``<token>_<k>``; in a stream every
chunk's position is ``created mod 1000``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsim.llmd import gojson
from llmsim.llmd.tools import ToolCall

DONE = b"data: [DONE]\n\n"
CHAT_ID_PREFIX = "chatcmpl-"
TEXT_ID_PREFIX = "cmpl-"
# What a prefill pod (do_remote_decode) answers with; placeholders, as in the real one.
PREFILL_KV_PARAMS = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "DUMMY_ID",
    "remote_block_ids": ["DUMMY_ID"],
    "remote_host": "DUMMY",
    "remote_port": 1234,
    "tp_size": 1,
}

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "InternalServerError" if status >= 500 else "APIConnectionError"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error: dict[str, Any] = {"message": message, "type": error_type(status), "param": param}
    if status:
        error["code"] = status  # an int, left out when 0
    return gojson.dumps({"error": error})


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


def _logprob(position: int, alternative: int) -> float:
    main = -1.0 - (position % 3) * 0.1
    return main if alternative == 0 else main - alternative * 0.5


def _token_bytes(token: str) -> list[int] | None:
    return list(token.encode()) or None


def chat_logprob_entry(token: str, position: int, top: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "token": token,
        "logprob": _logprob(position, 0),
        "bytes": _token_bytes(token),
    }
    if top > 0:
        alternatives = [token] + [f"{token}_{k}" for k in range(1, top)]
        entry["top_logprobs"] = [
            {"token": alt, "logprob": _logprob(position, k), "bytes": _token_bytes(alt)}
            for k, alt in enumerate(alternatives)
        ]
    return entry


def text_logprobs(tokens: list[str], top: int, position: int | None = None) -> dict[str, Any]:
    """``logprobs`` of a text choice; ``position`` set: one streamed token at that position."""
    count = max(top, 1)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(0 if position is not None else offset)
        offset += len(token.encode())
    positions = [position] * len(tokens) if position is not None else list(range(len(tokens)))
    tops = []
    for token, pos in zip(tokens, positions, strict=True):
        alts = {token: _logprob(pos, 0)} | {
            f"{token}_{k}": _logprob(pos, k) for k in range(1, count)
        }
        tops.append(dict(sorted(alts.items())))  # a Go map: keys sorted
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(p, 0) for p in positions],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def tool_call_dict(call: ToolCall, name: bool, arguments: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": call.name if name else None}
    if arguments:
        function["arguments"] = arguments
    return {"function": function, "id": call.id, "type": "function", "index": call.index}


class Chunks:
    """The chunks of one streamed answer; id, model and creation time are fixed per stream."""

    def __init__(self, chat: bool, response_id: str, model: str, created: int) -> None:
        self.chat = chat
        self.created = created
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = gojson.dumps({"id": response_id, "model": model, "object": obj, "created": created})
        self._head = head[:-1]  # the object left open for the rest
        self._choice_head = self._head + b',"usage":null,"choices":['

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return sse(self._choice_head + gojson.dumps(choice) + b"]}")

    def role(self, index: int) -> bytes:
        return self._chunk({"index": index, "finish_reason": None, "delta": {"role": "assistant"}})

    def content(self, index: int, text: str, logprobs_top: int | None) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": index, "finish_reason": None}
            choice["delta"] = {"content": text} if text else {}
            if logprobs_top is not None and text:
                entry = chat_logprob_entry(text, self.created % 1000, logprobs_top)
                choice["logprobs"] = {"content": [entry]}
            return self._chunk(choice)
        choice = {"index": index, "finish_reason": None, "text": text}
        if logprobs_top is not None and text and logprobs_top > 0:
            choice["logprobs"] = text_logprobs([text], logprobs_top, self.created % 1000)
        return self._chunk(choice)

    def tool(
        self, index: int, call: ToolCall, first: bool, piece: str, finish: str | None
    ) -> bytes:
        delta = {"tool_calls": [tool_call_dict(call, first, piece)]}
        return self._chunk({"index": index, "finish_reason": finish, "delta": delta})

    def finish(self, index: int, reason: str) -> bytes:
        if self.chat:
            return self._chunk({"index": index, "finish_reason": reason, "delta": {}})
        return self._chunk({"index": index, "finish_reason": reason, "text": ""})

    def usage(self, usage: Usage) -> bytes:
        return sse(self._head + b',"usage":' + gojson.dumps(usage.as_dict()) + b',"choices":[]}')


@dataclass(frozen=True, slots=True)
class FinalChoice:
    """One choice of a non-streamed answer."""

    tokens: list[str]
    finish_reason: str
    tool_calls: list[ToolCall] | None
    logprobs_top: int | None


def completion(
    chat: bool,
    response_id: str,
    model: str,
    created: int,
    usage: Usage,
    choices: list[FinalChoice],
    remote_decode: bool = False,
) -> bytes:
    body: dict[str, Any] = {
        "id": response_id,
        "model": model,
        "object": "chat.completion" if chat else "text_completion",
    }
    if remote_decode:
        body["kv_transfer_params"] = PREFILL_KV_PARAMS
    body["created"] = created
    body["usage"] = usage.as_dict()
    out = []
    for index, c in enumerate(choices):
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
        if chat:
            message: dict[str, Any] = {"role": "assistant"}
            if c.tool_calls:
                message["tool_calls"] = [tool_call_dict(t, True, t.arguments) for t in c.tool_calls]
            elif c.tokens:
                message["content"] = "".join(c.tokens)
            choice["message"] = message
            if c.logprobs_top is not None and not c.tool_calls and c.tokens:
                entries = [
                    chat_logprob_entry(tok, i, c.logprobs_top) for i, tok in enumerate(c.tokens)
                ]
                choice["logprobs"] = {"content": entries}
        else:
            choice["text"] = "".join(c.tokens)
            if c.logprobs_top is not None and c.logprobs_top > 0 and c.tokens:
                choice["logprobs"] = text_logprobs(c.tokens, c.logprobs_top)
        out.append(choice)
    body["choices"] = out
    return gojson.dumps(body)
