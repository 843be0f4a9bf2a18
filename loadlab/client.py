"""A raw HTTP/1.1 streaming client that notes when each SSE token event arrives.

With the simulator's ``ext-stamp-events`` on, each token event carries its send time
(``ext_sent_ns``, ``time.time_ns()`` at the write); the client keeps it next to the event's
arrival (``time.time_ns()`` in ``data_received``), so a chunk's one-way latency is exact on
the one host clock, whatever hops lie between.

Raw sockets rather than aiohttp: the send time is taken right before the request's single
``write`` (no client-side serialisation after it), each arrival in ``data_received`` itself
(no extra hop through a reader task), and the per-event cost stays a few microseconds so
200 concurrent streams don't make the client the thing being measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import orjson

# A token event of a chat stream; the role event ("delta":{"role"...) and the finish event
# ("delta":{}) don't match, and neither do usage, error or [DONE] events.
TOKEN_EVENT_MARK = b'"delta":{"content":"'
TEXT_EVENT_MARK = b'"text":"'
STAMP_MARK = b'"ext_sent_ns":'
USAGE_MARK = b'"completion_tokens":'
PROMPT_MARK = b'"prompt_tokens":'
ERROR_MARK = b'{"error":'


def _int_after(event: bytes, mark: bytes) -> int | None:
    """The integer right after ``mark`` in ``event`` (None without the mark)."""
    at = event.find(mark)
    if at < 0:
        return None
    start = at + len(mark)
    end = start
    while end < len(event) and 48 <= event[end] <= 57:
        end += 1
    return int(event[start:end]) if end > start else None


@dataclass
class TimedStream:
    request_id: str
    sent_at: float = 0.0  # wall clock, s: the request's write
    sent_ns: int = 0  # the same, time.time_ns()
    status: int = 0
    arrivals: list[float] = field(default_factory=list)  # wall clock, s, per token event
    complete: bool = False  # the response ended with its terminating chunk
    saw_done: bool = False
    timed_out: bool = False  # given up after ``timeout_s`` (``complete`` stays False)
    arrivals_ns: list[int] = field(default_factory=list)  # time.time_ns(), per token event
    stamps_ns: list[int] = field(default_factory=list)  # the events' ext_sent_ns, if stamped
    completion_tokens: int | None = None  # from the stream's last usage event
    prompt_tokens: int | None = None  # the same
    error_code: str | None = None  # an error event's code (e.g. a cut-off's)
    body: bytes = b""  # a non-streamed (error) response body, up to 4 KiB
    retry_after_s: float | None = None  # a refusal's Retry-After
    bad_events: int = 0  # events neither ``data: <JSON>`` nor ``data: [DONE]`` (validate only)
    client_closed: bool = False  # the client hung up itself after ``close_after`` events
    text: list[str] = field(default_factory=list)  # the token events' text (validate only)


def chat_request(
    path: str, payload: dict, request_id: str, api_key: str | None = None, host: str = "bench"
) -> bytes:
    body = orjson.dumps(payload)
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        f"X-Request-Id: {request_id}",
        "Connection: close",
    ]
    if api_key is not None:
        head.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _well_formed(event: bytes) -> bool:
    """One SSE event as OpenAI sends them: ``data: [DONE]`` or ``data: `` + a JSON object."""
    if not event.startswith(b"data: "):
        return False
    payload = event[6:]
    if payload == b"[DONE]":
        return True
    try:
        return isinstance(orjson.loads(payload), dict)
    except orjson.JSONDecodeError:
        return False


def _event_text(event: bytes) -> str:
    """The generated text of one well-formed token event (content, or a completion's text)."""
    chunk = orjson.loads(event[6:])
    return "".join(
        str((c.get("delta") or {}).get("content") or c.get("text") or "")
        for c in chunk.get("choices") or []
        if isinstance(c, dict)
    )


class _TimedSseProtocol(asyncio.Protocol):
    """Status line, headers, chunked transfer decoding, SSE event split — incrementally."""

    def __init__(
        self,
        result: TimedStream,
        done: asyncio.Future[None],
        close_after: int | None = None,
        validate: bool = False,
    ) -> None:
        self.result = result
        self.done = done
        self.close_after = close_after
        self.validate = validate
        self.transport: asyncio.Transport | None = None
        self.raw = b""  # undecoded bytes: headers, then chunk framing
        self.headers_done = False
        self.chunked = False
        self.chunk_left = -1  # -1: a chunk-size line is next; 0: the CRLF after chunk data
        self.events = b""  # decoded body not yet split into events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now_ns = time.time_ns()
        now = now_ns / 1e9
        self.raw += data
        if not self.headers_done:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.raw[:end].decode("latin-1").split("\r\n")
            self.raw = self.raw[end + 4 :]
            self.result.status = int(head[0].split()[1])
            self.chunked = any(
                h.lower().startswith("transfer-encoding:") and "chunked" in h.lower()
                for h in head[1:]
            )
            for h in head[1:]:
                name, _, value = h.partition(":")
                if name.strip().lower() == "retry-after":
                    with contextlib.suppress(ValueError):
                        self.result.retry_after_s = float(value.strip())
            self.headers_done = True
        if not self.chunked:
            self._feed_body(self.raw, now, now_ns)
            self.raw = b""
            return
        self._dechunk(now, now_ns)

    def _dechunk(self, now: float, now_ns: int) -> None:
        while self.raw:
            if self.chunk_left == -1:
                eol = self.raw.find(b"\r\n")
                if eol < 0:
                    return
                size = int(self.raw[:eol].split(b";", 1)[0], 16)
                self.raw = self.raw[eol + 2 :]
                if size == 0:
                    self.result.complete = True
                    self._finish()
                    return
                self.chunk_left = size
            elif self.chunk_left == 0:
                if len(self.raw) < 2:
                    return
                self.raw = self.raw[2:]
                self.chunk_left = -1
            else:
                part = self.raw[: self.chunk_left]
                self.raw = self.raw[len(part) :]
                self.chunk_left -= len(part)
                self._feed_body(part, now, now_ns)

    def _feed_body(self, data: bytes, now: float, now_ns: int) -> None:
        result = self.result
        if result.status != 200:
            result.body = (result.body + data)[:4096]
            return
        self.events += data
        while (end := self.events.find(b"\n\n")) >= 0:
            event = self.events[:end]
            self.events = self.events[end + 2 :]
            if self.validate and not _well_formed(event):
                result.bad_events += 1  # not a token the client could read
            elif TOKEN_EVENT_MARK in event or (
                TEXT_EVENT_MARK in event and b'"text":""' not in event
            ):
                result.arrivals.append(now)
                result.arrivals_ns.append(now_ns)
                if self.validate:  # what the client read, for a count of its own
                    result.text.append(_event_text(event))
                stamp = _int_after(event, STAMP_MARK)
                if stamp is not None:
                    result.stamps_ns.append(stamp)
                if self.close_after is not None and len(result.arrivals_ns) >= self.close_after:
                    result.client_closed = True
                    self._finish()
                    return
            elif event == b"data: [DONE]":
                result.saw_done = True
            elif ERROR_MARK in event:
                try:
                    error = orjson.loads(event[event.find(b"{") :])["error"]
                    result.error_code = str(error.get("code") or error.get("type"))
                except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
                    result.error_code = "unreadable"
            if USAGE_MARK in event and b'"usage":{' in event:
                tokens = _int_after(event, USAGE_MARK)
                if tokens is not None:
                    result.completion_tokens = tokens
                    result.prompt_tokens = _int_after(event, PROMPT_MARK)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.chunked and self.headers_done:
            self.result.complete = self.result.saw_done
        self._finish()


async def timed_stream(
    port: int,
    request: bytes,
    request_id: str,
    timeout_s: float | None = None,
    host: str = "127.0.0.1",
    close_after: int | None = None,
    validate: bool = False,
) -> TimedStream:
    """One request on a fresh connection; the connect happens before the send time.

    ``timeout_s``: give up on a response not finished that long after the send; the stream
    comes back with ``timed_out`` set and what had arrived so far. ``close_after``: hang
    up after that many token events (a client that goes away mid-stream); ``validate``:
    count the events that aren't well-formed (``bad_events``).
    """
    loop = asyncio.get_running_loop()
    result = TimedStream(request_id)
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(
        lambda: _TimedSseProtocol(result, done, close_after, validate), host, port
    )
    result.sent_ns = time.time_ns()
    result.sent_at = result.sent_ns / 1e9
    transport.write(request)
    try:
        await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        result.timed_out = True
    finally:
        transport.close()
    return result
