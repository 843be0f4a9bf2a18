"""Reassembly of Server-Sent Events from arbitrarily split response body messages.

In FULL_DUPLEX_STREAMED mode Envoy hands the processor the upstream body in whatever pieces
the network produced: an event can be cut mid-line, mid-UTF-8 character or between the CR
and LF of a CRLF. Billing needs whole events, and the client must receive the upstream's
bytes unchanged, so every ``SseEvent`` carries the exact bytes it was parsed from
(``raw``) and concatenating ``raw`` over all events of a stream gives the stream back.

Parsing follows the WHATWG event-stream rules (HTML Living Standard, "Server-sent
events"): lines end with CRLF, LF or a lone CR; a blank line ends an event; ``:`` starts a
comment; the field name is everything before the first colon and one space after it is
dropped; ``data`` lines are joined with LF; an ``id`` holding NUL is ignored; one leading
UTF-8 BOM is ignored. Where this module departs from a browser, it is to keep every byte:

* Every blank-line-terminated block becomes an event, even one holding only comments or
  nothing at all (a stray blank line), so it can be forwarded; such events have
  ``data=None``. Browsers drop them silently.
* ``event`` is None when the block had no ``event`` line (a browser would say "message"),
  and ``id`` is the id set by this block only (the browser's "last event ID" persists
  across events; the billing layer has no use for it).
* ``finish`` returns a non-empty unterminated tail as an event with ``terminated=False``
  (a browser discards it): the bytes still belong to the client, and billing decides
  whether an unterminated event counts.
* A lone CR ending the buffered bytes could be the first half of a CRLF, so the event it
  would end is held back until the next byte arrives (or ``finish``). Only streams that
  really use lone CRs pay this one-event delay; a CRLF split between its CR and LF is thus
  never read as two line endings.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

DEFAULT_MAX_EVENT_BYTES: Final = 4 * 1024 * 1024
DEFAULT_MAX_JSON_BODY_BYTES: Final = 16 * 1024 * 1024

_BOM: Final = b"\xef\xbb\xbf"
_LF: Final = 0x0A
_CR: Final = 0x0D

# A line ending followed by a blank line's ending, i.e. the end of an event. A lone CR must
# not be followed by LF (that pair is one CRLF); the second ending may be a lone CR at the
# very end of the buffer, which the caller treats as ambiguous.
_EVENT_END: Final = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)")
_LINE_END: Final = re.compile(r"\r\n|\r|\n")


class SseProtocolError(Exception):
    """The upstream's event stream can't be reassembled safely (an event is too large).

    ``events`` holds the events completed by the same ``feed`` call before the problem, so
    the caller can still forward (and bill) them before it ends the stream.
    """

    def __init__(self, message: str, events: list[SseEvent] | None = None) -> None:
        super().__init__(message)
        self.events: list[SseEvent] = events or []


@dataclass(frozen=True, slots=True, init=False)
class SseEvent:
    """One event and the exact bytes it came from (its terminating blank line included)."""

    raw: bytes
    data: str | None  # data lines joined with LF; None when no data field
    event: str | None  # None when no event field (WHATWG default type: "message")
    id: str | None  # id field of this event only
    terminated: bool  # False only for a tail returned by ``finish`` without blank line

    # One event is built per SSE event on the hot path. The __init__ dataclass generates for
    # a frozen class looks up object.__setattr__ per field; writing through the slots'
    # descriptors directly is about twice as fast and keeps the instance just as frozen.
    def __init__(
        self,
        raw: bytes,
        data: str | None = None,
        event: str | None = None,
        id: str | None = None,
        terminated: bool = True,
    ) -> None:
        _set_raw(self, raw)
        _set_data(self, data)
        _set_event(self, event)
        _set_id(self, id)
        _set_terminated(self, terminated)


# The slots' member descriptors, read from the class's namespace (the checker sees the
# fields' types there, not the descriptors).
_slots = vars(SseEvent)
_set_raw: Callable[[SseEvent, bytes], None] = _slots["raw"].__set__
_set_data: Callable[[SseEvent, str | None], None] = _slots["data"].__set__
_set_event: Callable[[SseEvent, str | None], None] = _slots["event"].__set__
_set_id: Callable[[SseEvent, str | None], None] = _slots["id"].__set__
_set_terminated: Callable[[SseEvent, bool], None] = _slots["terminated"].__set__
del _slots


def _parse_event(raw: bytes, content: bytes, terminated: bool = True) -> SseEvent:
    """Build an event from ``content``: its lines without the final line ending."""
    # The shape LLM servers send: a single `data:` line.
    if content.startswith(b"data:") and b"\n" not in content and b"\r" not in content:
        payload = content[6:] if content[5:6] == b" " else content[5:]
        return SseEvent(raw, payload.decode("utf-8", "replace"), None, None, terminated)
    # Decoding the whole block at once equals decoding line by line: invalid UTF-8 never
    # swallows an ASCII byte, so no CR or LF is lost or created by the replacement.
    text = content.decode("utf-8", "replace")
    lines = _LINE_END.split(text) if "\r" in text else text.split("\n")
    data_parts: list[str] | None = None
    event_type: str | None = None
    event_id: str | None = None
    for line in lines:
        colon = line.find(":")
        if colon == 0 or not line:
            continue  # comment, or the empty piece after a trailing line ending
        if colon < 0:
            name, value = line, ""
        else:
            name = line[:colon]
            value = line[colon + 2 :] if line[colon + 1 : colon + 2] == " " else line[colon + 1 :]
        if name == "data":
            if data_parts is None:
                data_parts = [value]
            else:
                data_parts.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\x00" not in value:
            event_id = value
        # `retry` and unknown fields only travel in `raw`.
    data = None if data_parts is None else "\n".join(data_parts)
    return SseEvent(raw, data, event_type, event_id, terminated)


def _lone_data_line_end(chunk: bytes, has_cr: bool) -> int:
    """Where the line ends if ``chunk`` is exactly one ``data:`` line and a blank line, else -1."""
    if not chunk.startswith(b"data:"):
        return -1
    size = len(chunk)
    if not has_cr:
        return size - 2 if chunk.find(b"\n") == size - 2 and chunk[-1] == _LF else -1
    if chunk.endswith(b"\r\n\r\n") and chunk.find(b"\r") == size - 4:
        return size - 4 if chunk.find(b"\n") == size - 3 else -1
    return -1


class SseReassembler:
    """Turns body messages into complete events, holding back an incomplete tail.

    Work is linear in the bytes fed: the search for the next event end resumes where the
    previous one stopped, and a long event arriving in many small messages is appended to
    one buffer instead of being re-joined each time.
    """

    __slots__ = ("_buf", "_buf_has_cr", "_closed", "_failed", "_max", "_scan", "_skip")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be positive")
        self._max = max_event_bytes
        self._buf = bytearray()  # held-back tail: the start of the next, incomplete event
        self._buf_has_cr = False
        # Index in the buffer before which no event end can start (already scanned).
        self._scan = 0
        # Bytes of BOM at the start of the first event; None until the stream's first three
        # bytes (or fewer, if they can't be a BOM) have arrived.
        self._skip: int | None = None
        self._closed = False  # finished or failed: one flag keeps the hot path to one test
        self._failed = False

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet returned in an event."""
        return bytes(self._buf)

    def lone_data(self, chunk: bytes) -> bytes | None:
        """The data of ``chunk`` when it is exactly one ``data:`` line and a blank line and
        nothing is held back (so ``feed`` would return that one event and keep no state);
        None otherwise. Consumes nothing: the caller either forwards ``chunk`` whole as that
        event or hands it to ``feed``."""
        if self._buf or self._skip is None or self._closed or len(chunk) > self._max:
            return None
        if type(chunk) is not bytes:
            return None
        content_end = _lone_data_line_end(chunk, b"\r" in chunk)
        if content_end <= 0:
            return None
        return chunk[6 if chunk[5] == 0x20 else 5 : content_end]

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Return the events that ``chunk`` completes, in stream order."""
        if self._closed:
            self._refuse()
        if not chunk:
            return []
        if type(chunk) is not bytes:
            chunk = bytes(chunk)
        chunk_has_cr = b"\r" in chunk
        if not self._buf and self._skip is not None:
            # Fast path for the common message: exactly one `data:` line and a blank line.
            # (An empty buffer means any BOM has already gone out with the first event.)
            content_end = _lone_data_line_end(chunk, chunk_has_cr)
            if content_end > 0 and len(chunk) <= self._max:
                value = 6 if chunk[5] == 0x20 else 5
                return [SseEvent(chunk, chunk[value:content_end].decode("utf-8", "replace"))]
            return self._split(chunk, chunk_has_cr, final=False)
        buf = self._buf
        buf += chunk
        has_cr = self._buf_has_cr = self._buf_has_cr or chunk_has_cr
        if self._skip is None:
            head = bytes(buf[:3])
            if len(head) < 3 and _BOM.startswith(head):
                return []  # could still become a BOM
            self._skip = 3 if head == _BOM else 0
        else:
            # Copy the buffer into an immutable string only when an event may end in it: a
            # long event arriving in small messages then costs one append per message.
            lstart = self._skip
            search = self._scan if self._scan > lstart else lstart
            if buf[lstart] not in (_LF, _CR) and (
                _EVENT_END.search(buf, search) is None if has_cr else buf.find(b"\n\n", search) < 0
            ):
                self._scan = len(buf) - 3
                if len(buf) > self._max:
                    self._fail([], len(buf))
                return []
        return self._split_buffer(final=False)

    def finish(self) -> list[SseEvent]:
        """Return the remaining events at end of stream, then refuse further input.

        A tail without its blank line comes back as one event with ``terminated=False``.
        """
        if self._closed:
            self._refuse()
        self._closed = True
        if not self._buf:
            return []
        if self._skip is None:
            self._skip = 3 if self._buf.startswith(_BOM) else 0
        events = self._split_buffer(final=True)
        if self._buf:
            tail = bytes(self._buf)
            self._buf = bytearray()
            events.append(_parse_event(tail, tail[self._skip :], terminated=False))
        return events

    def _refuse(self) -> None:
        if self._failed:
            raise SseProtocolError("event stream already failed")
        raise RuntimeError("feed or finish called after finish")

    def _split_buffer(self, final: bool) -> list[SseEvent]:
        data = bytes(self._buf)
        self._buf = bytearray()
        return self._split(data, self._buf_has_cr, final)

    def _split(self, data: bytes, has_cr: bool, final: bool) -> list[SseEvent]:
        """Cut ``data`` (held-back tail + new bytes) into events; keep the rest as the tail."""
        events: list[SseEvent] = []
        if has_cr:
            pos, resume = self._cut_any_endings(data, events, final)
        else:
            pos, resume = self._cut_lf_only(data, events)
        n = len(data)
        if pos:
            self._skip = 0  # the BOM, if any, went out with the first event
        if pos < n:
            self._buf = bytearray(data[pos:]) if pos else bytearray(data)
            self._buf_has_cr = has_cr and (pos == 0 or data.find(b"\r", pos) >= 0)
            self._scan = resume - pos
            if n - pos > self._max:
                self._fail(events, n - pos)
        else:
            self._buf_has_cr = False
            self._scan = 0
        return events

    def _cut_lf_only(self, data: bytes, events: list[SseEvent]) -> tuple[int, int]:
        """Events of data without any CR; returns (end of the last event, where to resume).

        One search for LF per event: an LF right after it is the blank line, so for a
        single-line event that one search finds both the line and the event end.
        """
        n = len(data)
        find = data.find
        max_bytes = self._max
        pos = 0  # start of the current event's raw bytes
        lstart = self._skip or 0  # start of its lines (after a BOM)
        search = self._scan if self._scan > lstart else lstart
        while True:
            line_end = find(b"\n", search)
            if line_end < 0:
                break
            if line_end == lstart:  # a blank line right at the start: an event with no lines
                events.append(SseEvent(data[pos : line_end + 1]))
                pos = lstart = search = line_end + 1
                continue
            if line_end + 1 < n and data[line_end + 1] == _LF:
                content_end = line_end
                single_line = search == lstart or find(b"\n", lstart, line_end) < 0
            else:
                content_end = find(b"\n\n", line_end + 1)
                if content_end < 0:
                    break
                single_line = False
            end = content_end + 2
            if end - pos > max_bytes:
                self._fail(events, end - pos)
            if single_line and data.startswith(b"data:", lstart):
                value = lstart + 6 if data[lstart + 5] == 0x20 else lstart + 5
                text = data[value:content_end].decode("utf-8", "replace")
                events.append(SseEvent(data[pos:end], text))
            else:
                events.append(_parse_event(data[pos:end], data[lstart:content_end]))
            pos = lstart = search = end
        # An event end spans at most 4 bytes, so none can start before n - 3 unseen.
        return pos, max(lstart, n - 3)

    def _cut_any_endings(self, data: bytes, events: list[SseEvent], final: bool) -> tuple[int, int]:
        """Events of data with CR, CRLF and LF line endings; returns like ``_cut_lf_only``."""
        n = len(data)
        max_bytes = self._max
        pos = 0
        lstart = self._skip or 0
        search = self._scan if self._scan > lstart else lstart
        while lstart < n:
            first = data[lstart]
            if first in (_LF, _CR):
                # A blank line right at the start: an event with no lines at all.
                end = lstart + 1
                if first == _CR:
                    if end < n:
                        if data[end] == _LF:
                            end += 1
                    elif not final:
                        return pos, lstart  # the LF of a CRLF may be in the next message
                events.append(SseEvent(data[pos:end]))
                pos = lstart = search = end
                continue
            match = _EVENT_END.search(data, search)
            if match is None:
                break
            content_end, end = match.span()
            if end == n and data[end - 1] == _CR and not final:
                return pos, content_end  # find it again once the next byte is known
            if end - pos > max_bytes:
                self._fail(events, end - pos)
            events.append(_parse_event(data[pos:end], data[lstart:content_end]))
            pos = lstart = search = end
        return pos, max(lstart, n - 3)

    def _fail(self, events: list[SseEvent], size: int) -> None:
        self._closed = self._failed = True
        self._buf = bytearray()
        raise SseProtocolError(
            f"SSE event larger than {self._max} bytes (at least {size} bytes)", events
        )


class _Malformed(enum.Enum):
    MALFORMED = "malformed"


# Returned by ``parse_json_data`` for data that is not a JSON object: the billing layer must
# tolerate (forward, count, not bill from) such an event rather than fail the stream.
MALFORMED: Final = _Malformed.MALFORMED

JsonData = dict[str, Any] | None | Literal[_Malformed.MALFORMED]


class BadJson(ValueError):
    """No JSON parser a client uses reads this."""


def client_json(data: str | bytes) -> Any:
    """JSON as clients read it: orjson, else Python's ``json`` (what the openai SDK uses),
    which also takes NaN, Infinity, numbers beyond a double and lone surrogate escapes.
    JavaScript's ``JSON.parse`` reads no more than ``json`` does, so nothing a client's
    parser reads is refused here (orjson alone refuses all of those)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadJson(str(exc)) from None


def parse_json_data(event: SseEvent) -> JsonData:
    """The event's data as a JSON object, read as clients read it (``client_json``); None
    when it carries none (no data, ``[DONE]``); MALFORMED for any other data."""
    data = event.data
    if data is None:
        return None
    try:
        value = client_json(data)
    except BadJson:
        return None if data.strip() == "[DONE]" else MALFORMED
    return value if isinstance(value, dict) else MALFORMED


class JsonBodyCollector:
    """Collects a non-streamed JSON response body to read its ``usage`` at the end.

    Oversized or malformed bodies are flagged rather than raised: the body is still
    forwarded to the client unchanged, and billing falls back to the reservation.
    """

    __slots__ = ("_chunks", "_limit", "_size", "malformed", "overflowed")

    def __init__(self, limit_bytes: int = DEFAULT_MAX_JSON_BODY_BYTES) -> None:
        self._limit = limit_bytes
        self._chunks: list[bytes] = []
        self._size = 0
        self.overflowed = False  # more than ``limit_bytes`` arrived; usage can't be read
        self.malformed = False  # the collected body was not a JSON object

    @property
    def size(self) -> int:
        """Bytes seen so far, including any beyond the limit."""
        return self._size

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self.overflowed:
            return
        if self._size > self._limit:
            self.overflowed = True
            self._chunks.clear()  # release memory now; nothing can be parsed anyway
            return
        if chunk:
            self._chunks.append(bytes(chunk))

    def body(self) -> bytes | None:
        """The whole body, or None when it went over the limit."""
        return None if self.overflowed else b"".join(self._chunks)

    def finish(self) -> dict[str, Any] | None:
        """The body's ``usage`` object, or None when absent or unreadable."""
        body = self.body()
        self._chunks.clear()
        if body is None:
            return None
        try:
            value = client_json(body)
        except BadJson:
            self.malformed = True
            return None
        if not isinstance(value, dict):
            self.malformed = True
            return None
        usage = value.get("usage")
        return usage if isinstance(usage, dict) else None
