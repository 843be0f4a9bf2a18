"""Synthetic ext_proc messages, as Envoy would send them, for driving a processor directly.

The gRPC-level benchmarks play Envoy's part: the same ProcessingRequest kinds in the same
order (request headers, buffered request body, response headers, FDX response body
messages), so the processor runs exactly the code it runs behind a real Envoy.
"""

from __future__ import annotations

from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PROMPT = "Say hello in as many words as you like."
PROMPT_TOKENS = 16  # what the synthetic usage event reports; only settles the counters
SSE_CHUNK_TEMPLATE = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,'
    b'"model":"gpt-4.1","choices":[{"index":0,"delta":{"content":"%s"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)


def _header_map(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
    # Envoy 1.40 fills raw_value, not value.
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def request_headers(api_key: str, request_id: str, body_size: int) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=_header_map(
                [
                    (":method", "POST"),
                    (":path", "/v1/chat/completions"),
                    (":authority", "gateway"),
                    (":scheme", "http"),
                    ("content-type", "application/json"),
                    ("content-length", str(body_size)),
                    ("authorization", f"Bearer {api_key}"),
                    ("x-request-id", request_id),
                ]
            ),
            end_of_stream=False,
        )
    )


def request_body(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def sse_response_headers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=_header_map([(":status", "200"), ("content-type", "text/event-stream")]),
            end_of_stream=False,
        )
    )


def response_body(chunk: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def token_chunk(text: str) -> bytes:
    """One chat.completion.chunk SSE event carrying ``text`` as its delta content."""
    return SSE_CHUNK_TEMPLATE % orjson.dumps(text)[1:-1]


def stream_tail(prompt_tokens: int, completion_tokens: int) -> bytes:
    """Finish event, the usage event admission asked for, and [DONE] — one last message."""
    finish = (
        b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,'
        b'"model":"gpt-4.1","choices":[{"index":0,"delta":{},"logprobs":null,'
        b'"finish_reason":"length"}]}\n\n'
    )
    usage = orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4.1",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )
    return finish + b"data: " + usage + b"\n\ndata: [DONE]\n\n"


def chat_body(prompt: str, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": "gpt-4.1",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
    )


def response(raw: bytes) -> pb.ProcessingResponse:
    return pb.ProcessingResponse.FromString(raw)


def verdict_kind(response: pb.ProcessingResponse) -> str:
    """``request_body`` (admitted: continue) or ``immediate_response`` (refused) etc."""
    return response.WhichOneof("response") or "none"


class Exchange:
    """The serialised messages of one kind of stream, built once per client and sent as
    bytes (replies read as bytes), so a client's cost per message stays far below the
    processor's: a ``max_tokens`` chat request, SSE response headers, a ``" word"`` token
    chunk and the tail (finish, usage, [DONE])."""

    def __init__(self, prompt: str = PROMPT, max_tokens: int = 256) -> None:
        self.body = chat_body(prompt, max_tokens)
        self.request_body = request_body(self.body).SerializeToString()
        self.response_headers = sse_response_headers().SerializeToString()
        self.chunk = response_body(token_chunk(" word")).SerializeToString()

    def headers(self, api_key: str, request_id: str) -> bytes:
        return request_headers(api_key, request_id, len(self.body)).SerializeToString()

    @staticmethod
    def tail(tokens: int, prompt_tokens: int = PROMPT_TOKENS) -> bytes:
        return response_body(
            stream_tail(prompt_tokens, tokens), end_of_stream=True
        ).SerializeToString()


async def open_stream(call: Any, exchange: Exchange, api_key: str, request_id: str) -> bool:
    """Request headers, body (admission), then the SSE response headers on a Process call;
    False, the call's writing done, when admission refused."""
    await call.write(exchange.headers(api_key, request_id))
    await call.read()
    await call.write(exchange.request_body)
    if verdict_kind(response(await call.read())) != "request_body":
        await call.done_writing()
        return False
    await call.write(exchange.response_headers)
    await call.read()
    return True
