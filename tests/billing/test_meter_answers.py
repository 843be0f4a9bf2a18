"""The meter against answers a model server should not send, on a real redis-server: each
is billed, settled once with one ledger entry, and its bytes reach the client as they should.
(End to end through Envoy: tests/gateway/test_upstream_integrity.py.)"""

from __future__ import annotations

import asyncio
import gzip
import itertools
from typing import Any

import orjson
import pytest
import redis

from extproc.app.runtime import Runtime
from extproc.billing import answer
from extproc.billing.meter import ResponseMeter
from extproc.config import TenantSpec, parse_config
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer
from tests.billing.streams import REQUEST, config_doc
from tests.support.client_view import delivered

_ids = itertools.count()
PIECE = " hello"  # one o200k token
BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4.1"}


def event(content: str) -> bytes:
    body = {**BASE, "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


STREAM = b"".join([event(PIECE)] * 20) + b"data: [DONE]\n\n"


async def drive(
    redis_url: str,
    messages: list[bytes],
    *,
    status: int = 200,
    content_type: str = "text/event-stream",
    request: dict[str, Any] | None = None,
    now_first: bool = False,
    reason: str = "end_of_stream",
) -> tuple[bytes, dict[str, str], ResponseMeter]:
    """Feed ``messages`` as Envoy's body messages, settle; (forwarded, ledger entry, meter)."""
    config = parse_config(config_doc(redis_url))
    runtime = Runtime(config, RedisQuotaBackend.from_url(redis_url))
    tenant = TenantSpec(id=f"answers-{next(_ids)}", plan=config.plans["roomy"], key_sha256=())
    body = orjson.dumps(request or REQUEST)
    try:
        admitted = await runtime.admission.admit(tenant, "chat", "req", body)
        meter = ResponseMeter(admitted, runtime)
        meter.on_headers(status, content_type)
        out = bytearray()
        for i, message in enumerate(messages):
            last = i == len(messages) - 1
            now = meter.on_body_now(message, last) if now_first else None
            if now is not None:
                out += now
                continue
            forwarded, ended = await meter.on_body(message, last)
            out += forwarded or b""
            if ended:
                break
        await asyncio.sleep(0)  # a settlement the meter started itself runs first
        await meter.settle(reason)  # else the gRPC stream's end settles it
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        entries = await client.xrange(f"tq:{{{tenant.id}}}:usage")
        await client.aclose()
        assert len(entries) == 1, entries
        return bytes(out), entries[0][1], meter
    finally:
        await runtime.close()


def one_byte_messages(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def test_a_status_below_200_with_a_body_is_metered(redis_server: RedisServer) -> None:
    out, entry, _ = asyncio.run(drive(redis_server.url, [STREAM], status=101))
    assert out == STREAM
    assert (entry["output_tokens"], entry["reason"]) == ("20", "upstream_error")


@pytest.mark.parametrize("split", [False, True], ids=["whole", "one-byte-messages"])
def test_undeclared_gzip_is_decoded_for_the_client_and_metered(
    redis_server: RedisServer, split: bool
) -> None:
    packed = gzip.compress(STREAM)
    messages = one_byte_messages(packed) if split else [packed]
    out, entry, _ = asyncio.run(drive(redis_server.url, messages, now_first=True))
    assert out == STREAM and entry["output_tokens"] == "20"


@pytest.mark.parametrize("split", [False, True], ids=["whole", "one-byte-messages"])
def test_a_json_answer_labelled_event_stream_is_read_whole(
    redis_server: RedisServer, split: bool
) -> None:
    doc = orjson.dumps({"choices": [{"index": 0, "message": {"content": PIECE * 15}}]})
    messages = one_byte_messages(doc) if split else [doc]
    out, entry, _ = asyncio.run(drive(redis_server.url, messages, now_first=True))
    assert out == doc and entry["output_tokens"] == "15" and entry["reason"] == "completed"


def test_a_stream_starting_with_a_bom_and_blank_lines_is_still_sse(
    redis_server: RedisServer,
) -> None:
    stream = b"\xef\xbb\xbf\n" + STREAM
    out, entry, _ = asyncio.run(drive(redis_server.url, one_byte_messages(stream)))
    assert out == stream and entry["output_tokens"] == "20"


def test_what_follows_done_is_dropped_within_and_after_its_message(
    redis_server: RedisServer,
) -> None:
    messages = [STREAM + event(PIECE * 5), event(PIECE * 7)]
    out, entry, _ = asyncio.run(drive(redis_server.url, messages, reason="cancelled"))
    assert out == STREAM and delivered(out) == 20
    assert (entry["output_tokens"], entry["reason"]) == ("20", "completed")


def test_data_no_json_parser_reads_ends_the_stream_as_an_upstream_error(
    redis_server: RedisServer,
) -> None:
    broken = b'data: {"choices":[{"index":0,"delta":{"content":" hello hello"}}\n\n'
    stream = event(PIECE) * 3 + broken + STREAM
    out, entry, meter = asyncio.run(drive(redis_server.url, [stream]))
    assert out.startswith(event(PIECE) * 3) and broken not in out
    assert b'"code":"upstream_error"' in out and out.endswith(b"data: [DONE]\n\n")
    assert (entry["output_tokens"], entry["reason"]) == ("3", "upstream_error")
    assert meter.finished


def test_an_error_event_in_a_200_stream_settles_as_an_upstream_error(
    redis_server: RedisServer,
) -> None:
    stream = b'data: {"error": {"message": "queue full"}}\n\ndata: [DONE]\n\n'
    out, entry, _ = asyncio.run(drive(redis_server.url, [stream]))
    assert out == stream and entry["reason"] == "upstream_error"


def test_an_error_body_no_one_can_read_bills_no_output(redis_server: RedisServer) -> None:
    request = {**REQUEST, "stream": False}
    body = b"upstream connect error or disconnect/reset before headers"
    out, entry, _ = asyncio.run(
        drive(redis_server.url, [body], status=503, content_type="text/plain", request=request)
    )
    assert out == body and entry["output_tokens"] == "0"
    assert entry["reason"] == "upstream_error"


def test_a_bug_reading_the_answer_bills_the_reservation_and_settles_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(answer, "read_answer", broken)
    request = {**REQUEST, "stream": False}
    doc = orjson.dumps({"choices": [{"index": 0, "message": {"content": PIECE}}]})
    out, entry, meter = asyncio.run(
        drive(redis_server.url, [doc], content_type="application/json", request=request)
    )
    assert out == doc
    assert int(entry["output_tokens"]) == REQUEST["max_tokens"]  # the reservation
    assert meter.metrics.billing_errors_total == 1
