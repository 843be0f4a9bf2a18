"""The request body: model, stream flags and the output budget, rewritten when needed.

Rewrites (the only ones; everything else reaches the model byte-for-byte):

* ``max_tokens`` / ``max_completion_tokens`` set to ``min(client value, server max)``, or to the
  model's default when the client sent none, so the upstream cannot generate more than the
  gateway reserved.
* ``stream_options.include_usage = true`` on streamed requests, so settlement gets the
  upstream's own usage; the billing layer removes that chunk for clients that didn't ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.admission.errors import invalid_request, model_not_found, too_large
from extproc.config import Config, ModelSpec
from extproc.tokens.errors import MalformedRequest
from extproc.tokens.text import decode_utf8

Endpoint = Literal["chat", "completions"]
METERED_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}
MAX_CHOICES = 16


@dataclass(frozen=True, slots=True)
class ModelRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    requested_model: str
    model: ModelSpec
    stream: bool
    client_wants_usage: bool  # the client itself asked for the usage chunk
    max_tokens: int  # effective output budget per choice
    choices: int  # `n`: every choice generates up to max_tokens
    new_body: bytes | None  # the rewritten body, None when unchanged


def _positive_int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_request(
            f"Invalid value for '{field}': expected an integer >= 1.", "invalid_value", field
        )
    return value


def parse_model_request(endpoint: Endpoint, raw: bytes, config: Config) -> ModelRequest:
    if len(raw) > config.max_body_bytes:
        raise too_large(config.max_body_bytes)
    try:
        # Decoded first so a body that is not UTF-8 is named as such, with the bad byte.
        body = orjson.loads(decode_utf8(raw))
    except MalformedRequest as exc:
        raise invalid_request(str(exc), "invalid_encoding") from exc
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", "invalid_json")

    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise invalid_request("You must provide a model parameter.", "missing_model", "model")
    model = config.resolve_model(requested)
    if model is None:
        raise model_not_found(requested)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request(
            "Invalid value for 'stream': expected a boolean.", "invalid_value", "stream"
        )
    choices = _positive_int(body, "n") or 1
    if choices > MAX_CHOICES:
        raise invalid_request(f"'n' must be at most {MAX_CHOICES}.", "invalid_value", "n")

    rewritten = False
    limit_fields = (
        ("max_tokens", "max_completion_tokens") if endpoint == "chat" else ("max_tokens",)
    )
    asked = [v for v in (_positive_int(body, f) for f in limit_fields) if v is not None]
    if asked:
        effective = min(min(asked), model.max_tokens)
        for field in limit_fields:
            if field in body and body[field] is not None and body[field] != effective:
                body[field] = effective
                rewritten = True
    else:
        effective = model.default_max_tokens
        body["max_tokens"] = effective
        rewritten = True

    client_wants_usage = False
    if stream:
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise invalid_request(
                "Invalid value for 'stream_options': expected an object.",
                "invalid_value",
                "stream_options",
            )
        client_wants_usage = options.get("include_usage") is True
        if not client_wants_usage:
            body["stream_options"] = {**options, "include_usage": True}
            rewritten = True

    return ModelRequest(
        endpoint=endpoint,
        body=body,
        requested_model=requested,
        model=model,
        stream=stream,
        client_wants_usage=client_wants_usage,
        max_tokens=effective,
        choices=choices,
        new_body=orjson.dumps(body) if rewritten else None,
    )
