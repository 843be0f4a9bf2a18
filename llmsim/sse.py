"""Byte templates for OpenAI ``chat.completion.chunk`` / ``text_completion`` SSE events.

At zero latency the simulator's cost is almost all in building events, so everything
constant in a stream (id, model, created) is serialised once per request and each token
event is three byte strings joined; only the token text is escaped per event.
"""

from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"
# The send-time stamp (``ext-stamp-events``): a top-level member of the chunk object, named
# as an extension so no OpenAI client or gateway takes it for a standard field.
STAMP_FIELD = b"ext_sent_ns"
_OPEN_ENDED = b',"logprobs":null,"finish_reason":null}]}\n\n'


def escape(text: str) -> bytes:
    """``text`` as the inside of a JSON string literal."""
    return orjson.dumps(text)[1:-1]


def usage_json(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> bytes:
    usage = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d' % (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )
    if cached is not None:  # ext_prefix_cache_block: as vLLM's prompt tokens details
        usage += b',"prompt_tokens_details":{"cached_tokens":%d}' % cached
    return usage + b"}"


class StreamEvents:
    """The events of one streamed answer."""

    __slots__ = ("_head", "_is_chat", "_open", "_token_head", "_usage_head")

    def __init__(self, is_chat: bool, request_id: str, created: int, model: str) -> None:
        self._is_chat = is_chat
        obj = b"chat.completion.chunk" if is_chat else b"text_completion"
        common = b'{"id":%s,"object":"%s","created":%d,"model":%s' % (
            orjson.dumps(request_id),
            obj,
            created,
            orjson.dumps(model),
        )
        self._usage_head = b"data: " + common + b',"choices":[]'
        self._head = b"data: " + common + b',"choices":[{"index":0,'
        self._token_head = self._head + (b'"delta":{"content":"' if is_chat else b'"text":"')
        self._open = (b'"}' if is_chat else b'"') + _OPEN_ENDED

    def role(self, usage: bytes | None = None) -> bytes:
        """The chat stream's first event, announcing the assistant role."""
        body = self._head + b'"delta":{"role":"assistant","content":""}'
        if usage is None:
            return body + _OPEN_ENDED
        return body + b',"logprobs":null,"finish_reason":null}],"usage":' + usage + b"}\n\n"

    def token(self, escaped_text: bytes) -> bytes:
        return self._token_head + escaped_text + self._open

    def token_with_usage(self, escaped_text: bytes, usage: bytes) -> bytes:
        """A token event carrying running usage (``continuous_usage_stats``)."""
        close = b'"}' if self._is_chat else b'"'
        return (
            self._token_head
            + escaped_text
            + close
            + b',"logprobs":null,"finish_reason":null}],"usage":'
            + usage
            + b"}\n\n"
        )

    def finish(self, reason: str, usage: bytes | None = None) -> bytes:
        body = b'"delta":{}' if self._is_chat else b'"text":""'
        tail = b',"logprobs":null,"finish_reason":"%s"}]' % reason.encode()
        if usage is not None:
            tail += b',"usage":' + usage
        return self._head + body + tail + b"}\n\n"

    def usage(self, usage: bytes) -> bytes:
        return self._usage_head + b',"usage":' + usage + b"}\n\n"

    def malformed(self) -> bytes:
        """An event whose JSON is cut off: what a broken proxy or backend might emit."""
        return self._token_head + b"\n\n"


def stamped(event: bytes, sent_ns: int) -> bytes:
    """``event`` (one ``data: {...}\\n\\n`` chunk) with ``"ext_sent_ns": sent_ns`` added last."""
    return event[:-3] + b',"%s":%d}\n\n' % (STAMP_FIELD, sent_ns)
