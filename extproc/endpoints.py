"""The OpenAI endpoints the processor meters: one spec each, registered by path.

What differs between ``/v1/chat/completions`` and ``/v1/completions`` is said here once,
as data, and read by whoever needs it: how many completions a request asks for
(admission), what the chunk that ends a truncated stream looks like (billing), and the
GenAI operation its span is named after (tracing). Everything else (the fields the meter
reads, the text it counts as output) is the same for both: a client of either endpoint may
send or read the other's fields, so they are metered alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # "chat" | "completions": how callers name it
    path: str  # the request path it is served at
    operation: str  # GenAI semantic conventions' gen_ai.operation.name
    chunk_object: str  # the ``object`` of one streamed chunk
    # Every prompt of a list is a request of its own (``n`` completions each).
    prompts_are_requests: bool
    stop_fields: Mapping[str, Any]  # a choice's empty output, in the chunk that ends a stream

    def length_stop(self, index: int) -> dict[str, Any]:
        """The choice ``index`` of the chunk that ends a truncated stream."""
        return {"index": index, **self.stop_fields, "finish_reason": "length"}


CHAT = Endpoint(
    name="chat",
    path="/v1/chat/completions",
    operation="chat",
    chunk_object="chat.completion.chunk",
    prompts_are_requests=False,
    stop_fields={"delta": {}},
)
COMPLETIONS = Endpoint(
    name="completions",
    path="/v1/completions",
    operation="text_completion",
    chunk_object="text_completion",
    prompts_are_requests=True,
    stop_fields={"text": ""},
)
ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETIONS)}
METERED_PATHS: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS.values()}


def endpoint_named(endpoint: Endpoint | str) -> Endpoint:
    """An endpoint, given as itself or by its name (``"chat"``)."""
    return endpoint if isinstance(endpoint, Endpoint) else ENDPOINTS[endpoint]
