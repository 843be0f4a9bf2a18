"""A raw HTTP/1.1 streaming client that notes when each SSE token event arrives.

It reads any OpenAI-compatible stream: SSE framed as the spec says (``\\n``, ``\\r\\n`` or
``\\r`` line ends, ``data:`` with or without its space, several ``data`` lines per event,
comments and other fields skipped), each event's data parsed as JSON. A token event is a
chat chunk whose delta carries content, reasoning (``reasoning_content``/``reasoning``), a
refusal or tool calls, or a completions chunk with ``text``; role-only and finish chunks,
usage, errors and ``[DONE]`` are not.

With the simulator's ``ext-stamp-events`` on, each token event carries its send time
(``ext_sent_ns``, ``time.time_ns()`` at the write); the client keeps it next to the event's
arrival (``time.time_ns()`` in ``data_received``), so a chunk's one-way latency is exact on
the one host clock, whatever hops lie between. Other backends send no stamp: the
client-side figures (TTFT, ITL, TPOT, E2EL) need none.

Raw sockets rather than aiohttp: the send time is taken right before the request's single
``write`` (no client-side serialisation after it; the connect and a TLS handshake come
before), each arrival in ``data_received`` itself (no extra hop through a reader task), and
the per-event cost stays a few microseconds so 200 concurrent streams don't make the client
the thing being measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

DELTA_TOKEN_FIELDS = ("content", "reasoning_content", "reasoning", "refusal", "tool_calls")


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
    unreadable_events: int = 0  # data that isn't JSON (counted always)
    other_events: int = 0  # JSON events that are no token, usage, error (role, finish, …)
    client_closed: bool = False  # the client hung up itself after ``close_after`` events
    connect_error: str = ""  # why the connection (or its TLS handshake) failed
    text: list[str] = field(default_factory=list)  # the token events' text (validate only)


def host_header(host: str, port: int, tls: bool) -> str:
    """``Host`` as a browser sends it: the port only when it isn't the scheme's own."""
    name = f"[{host}]" if ":" in host else host
    return name if port == (443 if tls else 80) else f"{name}:{port}"


def chat_request(
    path: str, payload: dict, request_id: str, api_key: str | None = None, host: str = "bench"
) -> bytes:
    body = orjson.dumps(payload)
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
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


def is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk that carries output: content, reasoning, a refusal or tool calls in a chat
    delta, or a completions ``text``."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(f) for f in DELTA_TOKEN_FIELDS):
            return True
    return False


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text of one token chunk: chat content, or a completion's text."""
    return "".join(
        str((c.get("delta") or {}).get("content") or c.get("text") or "")
        for c in chunk.get("choices") or []
        if isinstance(c, dict)
    )


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
        self.pending = b""  # decoded body not yet split into lines
        self.lines: list[bytes] = []  # the event being read: its lines, without line ends

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now_ns = time.time_ns()
        if self.done.done():
            return  # ended (the last chunk, or the client hung up): the rest is trailers
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
            self._feed_body(self.raw, now_ns)
            self.raw = b""
            return
        self._dechunk(now_ns)

    def _dechunk(self, now_ns: int) -> None:
        while self.raw:
            if self.chunk_left == -1:
                eol = self.raw.find(b"\r\n")
                if eol < 0:
                    return
                size = int(self.raw[:eol].split(b";", 1)[0], 16)
                self.raw = self.raw[eol + 2 :]
                if size == 0:
                    self._end_of_body(now_ns)
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
                self._feed_body(part, now_ns)

    def _feed_body(self, data: bytes, now_ns: int) -> None:
        result = self.result
        if result.status != 200:
            result.body = (result.body + data)[:4096]
            return
        text = self.pending + data
        lines = text.splitlines(keepends=True)
        # The last line has no line end yet, or ends in a CR whose LF may be in the next
        # piece (CRLF split in two): both wait for more.
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            self.pending = lines.pop()
        else:
            self.pending = b""
        for line in lines:
            line = line.rstrip(b"\r\n")
            if line:
                self.lines.append(line)
            elif self.lines:
                event, self.lines = self.lines, []
                if self._event(event, now_ns):
                    return

    def _end_of_body(self, now_ns: int) -> None:
        """What is left when the body ends: a last line without its line end, an event
        without its blank line (read as the server meant it)."""
        if self.pending:
            self.lines.append(self.pending.rstrip(b"\r\n"))
            self.pending = b""
        if self.lines:
            event, self.lines = self.lines, []
            self._event(event, now_ns)

    def _event(self, lines: list[bytes], now_ns: int) -> bool:
        """One SSE event; True once the client hangs up (``close_after``)."""
        result = self.result
        data = []
        for line in lines:
            if line.startswith(b":"):
                continue  # a comment (keep-alive)
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)
        if self.validate and not _well_formed(b"\n".join(lines)):
            result.bad_events += 1  # not an event the client could read
            return False
        if not data:
            return False
        payload = b"\n".join(data)
        if payload == b"[DONE]":
            result.saw_done = True
            return False
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            result.unreadable_events += 1
            return False
        if not isinstance(chunk, dict):
            result.unreadable_events += 1
            return False
        error = chunk.get("error")
        if error is not None:
            if isinstance(error, dict):
                result.error_code = str(error.get("code") or error.get("type") or "error")
            else:
                result.error_code = "unreadable"
            return False
        usage = chunk.get("usage")
        if isinstance(usage, dict) and _count(usage.get("completion_tokens")) is not None:
            result.completion_tokens = usage["completion_tokens"]
            result.prompt_tokens = _count(usage.get("prompt_tokens"))
        if not is_token_chunk(chunk):
            result.other_events += 1
            return False
        result.arrivals.append(now_ns / 1e9)
        result.arrivals_ns.append(now_ns)
        if self.validate:  # what the client read, for a count of its own
            result.text.append(chunk_text(chunk))
        stamp = _count(chunk.get("ext_sent_ns"))
        if stamp is not None:
            result.stamps_ns.append(stamp)
        if self.close_after is not None and len(result.arrivals_ns) >= self.close_after:
            result.client_closed = True
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.chunked and self.headers_done and not self.result.client_closed:
            self._end_of_body(time.time_ns())
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
    tls: ssl.SSLContext | None = None,
) -> TimedStream:
    """One request on a fresh connection; the connect happens before the send time.

    ``timeout_s``: give up on a response not finished that long after the send; the stream
    comes back with ``timed_out`` set and what had arrived so far. ``close_after``: hang
    up after that many token events (a client that goes away mid-stream); ``validate``:
    count the events that aren't well-formed (``bad_events``); ``tls``: HTTPS, the
    handshake done before the send time.
    """
    loop = asyncio.get_running_loop()
    result = TimedStream(request_id)
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(
        lambda: _TimedSseProtocol(result, done, close_after, validate),
        host,
        port,
        ssl=tls,
        server_hostname=host if tls is not None else None,
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
