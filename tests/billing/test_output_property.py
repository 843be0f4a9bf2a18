"""Whatever events an upstream sends, however they are split, the bill covers what a client
parsing the same bytes can read.

Generated answers: any number of choices, output in any field a client reads (content as a
string or parts, reasoning, refusal, tool calls and custom tools, the legacy function_call,
audio transcripts, completions text), values the processor's strict parser refuses (NaN,
lone surrogates), running usage that goes up, down or is absent, closing usage chunks that
lie. The meter runs against a real redis-server, fed through the transport's fast path or
the general one, split anywhere; what it forwarded is read by ``tests.support.client_view``
(an independent tolerant client) and counted with tiktoken.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.app.runtime import Runtime
from extproc.billing.meter import ResponseMeter
from extproc.config import TenantSpec, parse_config
from extproc.quota.redis.backend import RedisQuotaBackend
from loadlab.redis_server import RedisServer
from tests.billing.streams import REQUEST, config_doc
from tests.support.client_view import delivered

_ids = itertools.count()
BASE = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4.1"}

_text = st.lists(
    st.sampled_from(["a", "b", " ", "the", " word", "é", "世", "😀", "\n", '"', "7"]),
    min_size=1,
    max_size=6,
).map("".join)
# Lone high surrogates: orjson refuses their escapes, Python's json (and a client) reads them.
_odd_text = st.one_of(_text, _text.map(lambda t: t + "\ud800"))


@st.composite
def delta_of(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(where, body): a choice's output in one field; where is 'delta' or 'choice' (text)."""
    text = draw(_odd_text)
    kind = draw(
        st.sampled_from(
            [
                "content", "parts", "reasoning_content", "reasoning", "refusal", "tool",
                "custom", "function_call", "audio", "text",
            ]
        )
    )  # fmt: skip
    slot = draw(st.integers(0, 1))
    if kind == "content":
        return "delta", {"content": text}
    if kind == "parts":
        part = draw(st.sampled_from(["text", "refusal"]))
        return "delta", {"content": [{"type": part, part: text}, text]}
    if kind in ("reasoning_content", "reasoning", "refusal"):
        return "delta", {kind: text}
    if kind == "tool":
        body = {"arguments": text} if draw(st.booleans()) else {"name": text, "arguments": text}
        return "delta", {"tool_calls": [{"index": slot, "function": body}]}
    if kind == "custom":
        return "delta", {
            "tool_calls": [{"index": slot, "type": "custom", "custom": {"input": text}}]
        }
    if kind == "function_call":
        return "delta", {"function_call": {"arguments": text}}
    if kind == "audio":
        return "delta", {"audio": {"transcript": text, "data": "UklGRg=="}}
    return "choice", {"text": text}


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 3))
    events: list[bytes] = []
    running = dict.fromkeys(range(n), 0)
    for _ in range(draw(st.integers(0, 25))):
        i = draw(st.integers(0, n - 1))
        where, body = draw(delta_of())
        choice: dict[str, Any] = {"index": i}
        if where == "delta":
            choice["delta"] = body
            if draw(st.booleans()):
                choice["delta"]["role"] = "assistant"
        else:
            choice.update(body)
        event: dict[str, Any] = {**BASE, "choices": [choice]}
        how = draw(st.sampled_from(["absent", "absent", "up", "down"]))
        if how != "absent":  # a running usage, per choice, honest or not
            running[i] = max(0, running[i] + draw(st.integers(-5, 8)) * (1 if how == "up" else -1))
            event["usage"] = {"prompt_tokens": 9, "completion_tokens": running[i]}
        if draw(st.integers(0, 9)) == 0:
            event["x"] = float("nan")  # orjson refuses the whole event
        events.append(b"data: " + json.dumps(event).encode() + b"\n\n")
    if draw(st.booleans()):  # a closing usage that may say anything
        report = {
            "prompt_tokens": draw(st.integers(0, 20)),
            "completion_tokens": draw(st.integers(0, 40)),
        }
        events.append(
            b"data: " + json.dumps({**BASE, "choices": [], "usage": report}).encode() + b"\n\n"
        )
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


async def bill(
    redis_url: str, plan: str, stream: bytes, cuts: list[int], now_first: bool
) -> tuple[bytes, int, int]:
    """(bytes forwarded, output billed in the ledger, output the meter delivered)."""
    config = parse_config(config_doc(redis_url))
    backend = RedisQuotaBackend.from_url(redis_url)
    runtime = Runtime(config, backend)
    tenant = TenantSpec(id=f"prop-{next(_ids)}", plan=config.plans[plan], key_sha256=())
    request = {**REQUEST, "n": 3, "max_tokens": 400}
    try:
        admitted = await runtime.admission.admit(tenant, "chat", "req", orjson.dumps(request))
        meter = ResponseMeter(admitted, runtime)
        meter.on_headers(200, "text/event-stream")
        bounds = [0, *sorted(set(cuts)), len(stream)]
        out = bytearray()
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            last = i == len(bounds) - 2
            message = stream[start:end]
            now = meter.on_body_now(message, last) if now_first else None
            if now is not None:
                out += now
                continue
            forwarded, ended = await meter.on_body(message, last)
            out += forwarded or b""
            if ended:
                break
        await meter.settle("end_of_stream")
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        entries = await client.xrange(f"tq:{{{tenant.id}}}:usage")
        await client.aclose()
        assert len(entries) == 1
        return bytes(out), int(entries[0][1]["output_tokens"]), meter.delivered
    finally:
        await runtime.close()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_bill_covers_what_a_client_reads_in_any_answer_however_split(
    redis_server: RedisServer, data: st.DataObject
) -> None:
    stream = data.draw(answers())
    cuts = data.draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=12))
    plan = data.draw(st.sampled_from(["roomy", "tight"]))
    now_first = data.draw(st.booleans())
    out, billed, meter_delivered = asyncio.run(
        bill(redis_server.url, plan, stream, cuts, now_first)
    )
    readable = delivered(out)
    # The meter's count of what it forwarded never falls below what the client can read
    # (it keeps the highest running count: a later BPE merge is not refunded), and the
    # bill never below the meter's count (a meter-authority model).
    assert billed >= meter_delivered >= readable
