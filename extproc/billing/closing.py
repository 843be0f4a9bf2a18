"""The events that end a stream the meter cuts: an error event, or a normal length stop.

Either way the client's stream ends with ``data: [DONE]``, so any SSE client library sees a
complete stream: with an error event it reads why (the limit that cut, a timeout, an
unreadable upstream, a shutdown), with ``on_exhaustion: truncate`` it reads a last chunk
of ``finish_reason: "length"`` in its endpoint's shape (and the usage it asked for).
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.endpoints import Endpoint

DONE = b"data: [DONE]\n\n"
_MESSAGES = {
    "tpm_limit_exceeded": "Token rate limit reached: the stream was ended because the "
    "tenant's token budget is used up. Please try again later.",
    "daily_budget_exceeded": "Daily token budget reached: the stream was ended.",
    "timeout": "The upstream stopped sending: the stream was ended by the gateway.",
    "upstream_error": "The upstream sent an event stream the gateway cannot read.",
    "quota_unavailable": "The quota service is unavailable: the stream was ended by "
    "the gateway. Please retry.",
    "shutdown": "The gateway is restarting: the stream was ended before the answer "
    "was complete. Please retry.",
}


def error_event(code: str, limit_named: str) -> bytes:
    """The error event of ``code`` and ``[DONE]``; ``limit_named``: the limit that cut
    (``tokens per minute``), for a limit's code without a message of its own."""
    message = _MESSAGES.get(code) or (
        f"Rate limit reached on {limit_named}: the stream was ended. Please try again later."
    )
    error_type = "rate_limit_error" if code.endswith("_exceeded") else "api_error"
    error = {"error": {"message": message, "type": error_type, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n" + DONE


def length_stop(
    endpoint: Endpoint,
    last: dict[str, Any] | None,
    indices: list[int],
    fallback_id: str,
    requested_model: str,
    usage: tuple[int, int] | None,
) -> bytes:
    """A last chunk stopping every choice in ``indices`` for ``length`` (named like the
    upstream's ``last`` chunk), the usage chunk when ``usage`` = (prompt, completion) is
    due to the client, and ``[DONE]``."""
    last = last or {}
    final = {
        "id": last.get("id", fallback_id),
        "object": last.get("object", endpoint.chunk_object),
        "created": last.get("created", 0),
        "model": last.get("model", requested_model),
        "choices": [endpoint.length_stop(i) for i in indices or [0]],
    }
    out = b"data: " + orjson.dumps(final) + b"\n\n"
    if usage is not None:
        prompt, completion = usage
        totals = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        out += b"data: " + orjson.dumps({**final, "choices": [], "usage": totals}) + b"\n\n"
    return out + DONE
