"""OpenAI-style error bodies and the real simulator's six injectable failures.

Clients (the openai SDK, the gateway) decide retry and billing from status and ``type``,
so both follow the real simulator exactly: ``type`` is derived from the status code the way
the openai SDK names its exception classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "InternalServerError" if status >= 500 else "APIConnectionError"


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error to answer with; raised anywhere in request handling."""

    status: int
    message: str
    param: str | None = None

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            body=orjson.dumps(self.body()),
            status=self.status,
            content_type="application/json",
            headers=headers,
        )


def injected_failure(kind: str, model: str) -> ApiError:
    """The failure the real simulator returns for ``kind`` (one of ``FAILURE_TYPES``)."""
    if kind == "rate_limit":
        return ApiError(
            429,
            f"Rate limit reached for {model} in organization org-xxx on requests per min (RPM): "
            "Limit 3, Used 3, Requested 1.",
        )
    if kind == "invalid_api_key":
        return ApiError(401, "Incorrect API key provided.")
    if kind == "context_length":
        return ApiError(
            400,
            "This model's maximum context length is 4096 tokens. However, your messages "
            "resulted in 4500 tokens.",
            "messages",
        )
    if kind == "server_error":
        return ApiError(503, "The server is overloaded or not ready yet.")
    if kind == "invalid_request":
        return ApiError(400, "Invalid request: missing required parameter 'model'.", "model")
    if kind == "model_not_found":
        return ApiError(404, f"The model '{model}-nonexistent' does not exist", "model")
    raise ValueError(f"unknown failure type {kind!r}")
