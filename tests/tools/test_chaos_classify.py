"""The chaos report's classes and figures say what the client really got (loadlab.chaos).

Since the processor ends a stream at an event no parser reads (docs/billing.md), the
simulator's malformed event reaches the client as an ``upstream_error`` event and
``[DONE]``: that is ``malformed_upstream``, explained by the injected events, and not a
budget cut-off. An unparseable event that does reach a client is the processor's failure
(``malformed``), whatever the simulator injects. What a client received is the o200k
count of its text, not its events: against v0.10.2's pieces the two differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest

from extproc.tokens.encodings import load_tokenizer
from loadlab.chaos import classify, delivered_tokens
from loadlab.chaos_scenario import ChaosScenario
from loadlab.client import TimedStream, _TimedSseProtocol

INJECTING = ChaosScenario(malformed_rate=20)
CLEAN = ChaosScenario()


def record(detail: str, error_code: str | None = None, status: int = 200) -> dict[str, Any]:
    return {
        "detail": detail,
        "error_code": error_code,
        "status": status,
        "error_body": None,
        "start_s": 1.0,
        "end_s": 2.0,
    }


def test_a_stream_ended_at_an_injected_malformed_event_is_malformed_upstream() -> None:
    assert classify(record("error_event", "upstream_error"), [], INJECTING) == "malformed_upstream"


def test_an_unreadable_stream_nothing_injected_is_malformed() -> None:
    assert classify(record("error_event", "upstream_error"), [], CLEAN) == "malformed"


@pytest.mark.parametrize("scenario", [INJECTING, CLEAN], ids=["injecting", "clean"])
def test_an_unparseable_event_that_reached_the_client_is_malformed(
    scenario: ChaosScenario,
) -> None:
    assert classify(record("bad_events"), [], scenario) == "malformed"


@pytest.mark.parametrize(
    "code", ["tpm_limit_exceeded", "timeout", "quota_unavailable", "shutdown", "429"]
)
def test_the_gateways_and_the_upstreams_other_error_events_are_cut_clean(code: str) -> None:
    assert classify(record("error_event", code), [], INJECTING) == "cut_clean"


def test_the_other_classes_are_unchanged() -> None:
    assert classify(record("done"), [], INJECTING) == "complete"
    assert classify(record("client_closed"), [], INJECTING) == "client_disconnect"
    resetting = dataclasses.replace(CLEAN, disconnect_rate=5)
    assert classify(record("reset"), [], resetting) == "reset_by_upstream"
    assert classify(record("reset"), [(1.5, 1.8)], CLEAN) == "reset_by_fault"
    assert classify(record("reset"), [], CLEAN) == "malformed"


# --- what a client received, in tokens ----------------------------------------------------

# v0.10.2 pieces, one event each, that o200k counts as 17 tokens together (``(x`` merges).
PIECES = ["Probe", "#", "7", ": ", "{", "alpha", "=", "2", "; ", "beta", "=", "3", "} ", "& ",
          "(", "x", "+", "y"]  # fmt: skip


def sse_response(pieces: list[str]) -> bytes:
    events = [
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}) + b"\n\n"
        for p in pieces
    ]
    body = b"".join(events) + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    return head + f"content-length: {len(body)}\r\n\r\n".encode() + body


def test_what_a_client_received_is_counted_in_tokens_of_its_text_not_in_events() -> None:
    stream = TimedStream("r")
    loop = asyncio.new_event_loop()
    try:
        protocol = _TimedSseProtocol(stream, loop.create_future(), validate=True)
        protocol.data_received(sse_response(PIECES))
    finally:
        loop.close()
    assert stream.text == PIECES and len(stream.arrivals_ns) == len(PIECES) == 18
    assert delivered_tokens(stream) == len(load_tokenizer("o200k_base").encode("".join(PIECES)))
    assert delivered_tokens(stream) == 17  # the meter bills 17: 18 would be a false alarm
