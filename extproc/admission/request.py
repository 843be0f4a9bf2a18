"""The request body: model, stream flags and the output budget, rewritten when needed.

The body that reaches the upstream is always re-serialised from the parsed object, so it
holds each key once and the upstream reads exactly what was charged (a duplicate ``"model"``
or ``"max_tokens"`` key cannot make it serve another model or a longer answer). A key that a
case-insensitive parser (Go's) would read as a field the meter reads, spelt otherwise
(``"MAX_TOKENS"``), is a 400 (``extproc.admission.field_names``). Rewrites:

* ``model`` set to the quota model's upstream name, so a look-alike or alias is served as
  the model it was charged to.
* ``max_tokens`` / ``max_completion_tokens`` set to ``min(client value, server max)``, or to the
  model's default when the client sent none, so the upstream cannot generate more than the
  gateway reserved. Both fields on both endpoints: a /v1/completions server may read
  ``max_completion_tokens`` too.
* ``stream_options.include_usage = true`` on streamed requests, so settlement gets the
  upstream's own usage; the billing layer removes that chunk for clients that didn't ask.
  For models with ``continuous_usage``, ``stream_options.continuous_usage_stats = true`` too.
  A client's own ``continuous_usage_stats`` is passed through: a running usage can only
  raise the meter's count (``extproc.billing.output``), so it changes nothing the client
  could gain from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from extproc.admission.errors import invalid_request, model_not_found, too_large
from extproc.admission.field_names import check_field_names
from extproc.config import Config, ModelSpec
from extproc.endpoints import METERED_PATHS, Endpoint, endpoint_named
from extproc.tokens.errors import MalformedRequest
from extproc.tokens.text import decode_utf8

__all__ = ["METERED_PATHS", "Endpoint", "ModelRequest", "parse_model_request"]
MAX_CHOICES = 16
# Completions served by one request: ``n`` per prompt, every prompt of a /v1/completions list.
MAX_COMPLETIONS = 128
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True, slots=True)
class ModelRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    requested_model: str
    model: ModelSpec
    stream: bool
    client_wants_usage: bool  # the client itself asked for the usage chunk
    max_tokens: int  # effective output budget per choice
    choices: int  # completions generated: ``n`` × prompts, each up to max_tokens
    new_body: bytes  # the body forwarded to the upstream


def _positive_int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_request(
            f"Invalid value for '{field}': expected an integer >= 1.", "invalid_value", field
        )
    return value


def parse_model_request(endpoint: Endpoint | str, raw: bytes, config: Config) -> ModelRequest:
    """The parsed, validated and rewritten body of a request to ``endpoint`` (or the one of
    that name); ``new_body`` is its re-serialised form."""
    return serialise(parse_unserialised(endpoint, raw, config))


def serialise(request: ModelRequest) -> ModelRequest:
    return replace(request, new_body=orjson.dumps(request.body))


def parse_unserialised(endpoint: Endpoint | str, raw: bytes, config: Config) -> ModelRequest:
    """``parse_model_request`` but for the re-serialising (``new_body`` empty until
    ``serialise``). Parsing and serialising each hold the GIL a few ms per MiB of mixed
    scripts: admission lets the event loop run between the two for a big body."""
    endpoint = endpoint_named(endpoint)
    if len(raw) > config.max_body_bytes:
        raise too_large(config.max_body_bytes)
    try:
        # orjson reads the bytes as they came (and validates UTF-8 itself): decoding them to a
        # str first cost a decode and orjson's re-encode, ~2.5 ms per MiB under the GIL.
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = _parse_refused(raw)
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", "invalid_json")
    check_field_names(body)

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
    n = _positive_int(body, "n") or 1
    if n > MAX_CHOICES:
        raise invalid_request(f"'n' must be at most {MAX_CHOICES}.", "invalid_value", "n")
    choices = n * _prompt_count(body) if endpoint.prompts_are_requests else n
    if choices > MAX_COMPLETIONS:
        raise invalid_request(
            f"The request asks for {choices} completions ('n' × prompts); "
            f"at most {MAX_COMPLETIONS}.",
            "invalid_value",
            "prompt",
        )
    body["model"] = model.served_name

    # Both fields on both endpoints: a server may honour either, so both carry the clamp.
    asked = [v for v in (_positive_int(body, f) for f in _LIMIT_FIELDS) if v is not None]
    if asked:
        effective = min(min(asked), model.max_tokens)
        for field in _LIMIT_FIELDS:
            if field in body and body[field] is not None:
                body[field] = effective
    else:
        effective = model.default_max_tokens
        body["max_tokens"] = effective

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
        forced = {"include_usage": True}
        if model.continuous_usage:
            forced["continuous_usage_stats"] = True
        body["stream_options"] = {**options, **forced}

    return ModelRequest(
        endpoint=endpoint,
        body=body,
        requested_model=requested,
        model=model,
        stream=stream,
        client_wants_usage=client_wants_usage,
        max_tokens=effective,
        choices=choices,
        new_body=b"",
    )


def _parse_refused(raw: bytes) -> Any:
    """The error for a body orjson refused, as it was named when bodies were decoded first:
    a body that is not UTF-8 is named as such with the bad byte, other errors as JSON ones
    (positions in characters). Both parsers accept exactly the valid UTF-8 (tested)."""
    try:
        return orjson.loads(decode_utf8(raw))
    except MalformedRequest as exc:
        raise invalid_request(str(exc), "invalid_encoding") from exc
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}", "invalid_json") from exc


def _prompt_count(body: dict[str, Any]) -> int:
    """Prompts in a /v1/completions request: a list of strings or of token-id lists is many."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1
