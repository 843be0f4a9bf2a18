"""OpenAI-style error answers.

Every refusal the gateway makes has the shape the ``openai`` SDK parses:
``{"error": {"message", "type", "code", "param"}}`` with the matching HTTP status, so clients
get ``AuthenticationError``, ``RateLimitError``, ``NotFoundError``… rather than a bare reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: tuple[tuple[str, str], ...] = field(default=())

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


def invalid_request(
    message: str, code: str = "invalid_request", param: str | None = None
) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", "invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body is larger than the gateway accepts ({limit} bytes).",
        "invalid_request_error",
        "request_too_large",
    )
