"""Lease-ahead billing of one response: what goes out, what it costs, where it is cut.

The meter holds a lease: output tokens already reserved in the quota backend (admission
reserved the first batch; ``extproc.billing.leasing``). An SSE event reaches the client
only when the tokens it carries are covered by the lease. When the lease runs low, the next
batch is reserved in the background, so in normal operation no event waits for Redis. When
a batch can't be had, the covered events go out followed by a closing event and ``[DONE]``
with ``end_of_stream``: Envoy ends the client's response cleanly and drops the upstream.

Settlement (``extproc.billing.settlement``) commits what was delivered and refunds the
rest of the reservation, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
import structlog

from extproc.billing import answer, closing, sniff
from extproc.billing.decoding import DECODABLE, Decoder, UndecodableBody, encodings
from extproc.billing.leasing import Leasing
from extproc.billing.output import OutputCount
from extproc.billing.settlement import Settlement
from extproc.billing.sse import (
    MALFORMED,
    JsonBodyCollector,
    SseEvent,
    SseProtocolError,
    SseReassembler,
    parse_json_data,
)
from extproc.quota.base import QuotaBackend
from extproc.tracing import ExchangeSpan

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.billing")

# sniff: an event stream whose first bytes are not in yet (SSE, or a JSON answer or gzip
# bytes under the SSE label); sse: metered event by event; done: ``[DONE]`` went out, what
# follows is dropped; json: read whole at the end (a JSON answer, or a stream under another
# content type or not SSE); unreadable: an encoding the meter can't decode (refused).
Mode = Literal["pending", "sniff", "sse", "done", "json", "unreadable"]
# ``_cost`` of an event that is not forwarded as counted: the forced usage chunk (withheld),
# ``[DONE]`` (forwarded; the rest of the body is dropped), data no client parser reads
# (the stream ends there as an upstream error).
_WITHHELD = -1
_DONE_EVENT = -2
_UNREADABLE = -3


class BillingDeps(Protocol):
    """What a meter uses of the processor: the quota backend it leases from and settles on,
    the metrics it counts in, and ``spawn``, which runs a settlement to its end even when the
    stream that started it is cancelled (``extproc.app.runtime.Billing`` provides them)."""

    @property
    def backend(self) -> QuotaBackend: ...

    @property
    def metrics(self) -> Metrics: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], /) -> object: ...


class ResponseMeter(Leasing, Settlement):
    """One response, message by message: decodes and reassembles the body, counts each
    event's output, forwards what the lease covers, cuts the stream where it doesn't, and
    settles once at the end (the lease and the settlement are ``Leasing``'s and
    ``Settlement``'s)."""

    def __init__(
        self, admitted: Admitted, billing: BillingDeps, trace: ExchangeSpan | None = None
    ) -> None:
        self.admitted = admitted
        self.trace = trace  # tracing on: a span per lease batch and one for the settlement
        self.backend = billing.backend
        self.metrics = billing.metrics
        self.spawn = billing.spawn
        self._labels = admitted.metric_labels  # (model, plan)
        self._rid = admitted.reservation_key
        self.mode: Mode = "pending"
        self.incremental = admitted.incremental
        self.max_output = admitted.request.max_tokens * admitted.request.choices
        model = admitted.request.model
        self._authority: answer.Authority = model.usage_authority
        self._tolerance = model.usage_tolerance
        self._wants_usage = admitted.request.client_wants_usage
        self._init_lease(admitted)
        self.delivered = 0  # output tokens in events forwarded to the client
        self.started = False  # response headers seen: the watchdog applies from here
        self.finished = False  # we ended the client's stream (cut-off or timeout)
        self.completed = False  # the upstream ended its stream normally
        # The upstream failed the request: an error status, an error event or an answer
        # that can't be read. Metered all the same; the ledger says ``upstream_error``.
        self.upstream_failed = False
        # The upstream's own usage as of the events delivered so far (its closing report,
        # or its running count): it settles the request from here on, whatever the client
        # does next (``answer.billed``).
        self.final_usage: answer.Usage | None = None
        self._init_settlement()
        self._decoder: Decoder | None = None
        self._sse = SseReassembler()
        self._json: JsonBodyCollector | None = None
        self._held = b""  # the body's first bytes while the mode is ``sniff``
        # What counts as output, event by event (extproc.billing.output).
        self._output = OutputCount(admitted.tokenizer)
        self._feed = self._output.feed
        # An event ``on_body_now`` counted but could not forward (the lease didn't cover it):
        # the body message it came in, the event, its cost. ``on_body`` takes it from here
        # (the same bytes: upb hands out a new bytes object per access, so compared by value).
        self._declined: tuple[bytes, SseEvent, int] | None = None

    @property
    def may_rewrite_body(self) -> bool:
        """An SSE body may lose the forced usage chunk or gain a closing event; a decoded
        body changes length."""
        return self.mode in ("sse", "sniff") or self._decoder is not None

    @property
    def decoding(self) -> bool:
        return self._decoder is not None

    def on_headers(self, status: int, content_type: str, content_encoding: str = "") -> None:
        self.started = True  # from here the idle watchdog guards the reservation
        if status >= 400 or status < 200:
            # Metered like any other answer: an error body may carry output all the same.
            self.upstream_failed = True
        codings = encodings(content_encoding)
        if len(codings) > 1 or (codings and codings[0] not in DECODABLE):
            log.warning("unreadable_encoding", request_id=self._rid, encoding=content_encoding)
            self.mode = "unreadable"
            self.spawn(self.settle("unreadable"))
            return
        if codings:
            self._decoder = Decoder()
        if self.admitted.request.stream and "text/event-stream" in content_type.lower():
            self.mode = "sniff"  # SSE once its first bytes say so
        else:
            self.mode = "json"
            self._json = JsonBodyCollector()

    # -- body ------------------------------------------------------------------------------

    def on_body_now(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """The bytes to forward for the common body message, without awaiting anything.

        That message is one complete ``data:`` event the lease already covers: it goes out
        unchanged. None for any other message, and for one whose tokens the lease doesn't
        cover: ``on_body`` must then be called with the same message (an event counted here
        is handed over, never counted twice). The general path gives the same result.
        """
        if end_of_stream or self.finished or self.mode != "sse" or self._decoder is not None:
            return None
        data = self._sse.lone_data(chunk)
        if data is None:
            return None
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None  # not JSON ([DONE], NaN, malformed, invalid UTF-8): the general path
        if type(parsed) is not dict:
            return None
        cost = self._feed(parsed)
        if cost < 0:  # a usage chunk: every event before it has gone out
            self.final_usage = self._output.take_usage()
            self.metrics.events_total += 1
            if not self._wants_usage:
                return b""  # the forced usage chunk, withheld from the client
            return chunk
        if self.incremental and self.delivered + cost > self.leased:
            self._declined = (chunk, SseEvent(chunk, data.decode("utf-8", "replace")), cost)
            return None
        self.metrics.events_total += 1
        self.delivered += cost
        if self._output.fresh_usage:  # a running usage rode on this event
            self.final_usage = self._output.take_usage()
        if self.incremental:
            self._lease_ahead()
        return chunk

    async def on_body(self, chunk: bytes, end_of_stream: bool) -> tuple[bytes | None, bool]:
        """Bytes to forward for this body message, and whether they end the client's stream."""
        if self.finished:
            return None, False
        declined = self._declined
        if declined is not None:
            self._declined = None
            if declined[0] != chunk:
                raise RuntimeError("on_body must follow on_body_now for the message it declined")
            out = await self._forward([declined[1]], [declined[2]])
            return (None, False) if out is None else (out, self.finished)
        if self.mode == "done":  # what an upstream sends after [DONE] is not the answer's
            if end_of_stream:
                self._complete()
            return b"", end_of_stream
        if self._decoder is not None:
            try:
                chunk = self._decoder.feed(chunk, end_of_stream)
            except UndecodableBody as exc:
                return self._undecodable(exc)
        if self.mode == "sniff":
            try:
                chunk = self._sniff(chunk, end_of_stream)
            except UndecodableBody as exc:
                return self._undecodable(exc)
            if self.mode == "sniff":
                return b"", False  # too few bytes yet to tell
        if self.mode != "sse":
            if self._json is not None:
                self._json.feed(chunk)
            if end_of_stream:
                self._complete()
            return chunk, end_of_stream
        try:
            events = self._sse.feed(chunk)
            if end_of_stream:
                events.extend(self._sse.finish())
        except SseProtocolError as exc:
            log.warning("sse_protocol_error", request_id=self._rid, error=str(exc))
            out = await self._forward(exc.events)
            if out is None:
                return None, False
            if self.finished:
                return out, True
            return out + self._closing_bytes("upstream_error"), self._finish("protocol_error")
        out = await self._forward(events)
        if out is None:  # ended elsewhere (the watchdog) while this message waited
            return None, False
        if self.finished:
            return out, True
        if end_of_stream:
            self._complete()
        return out, end_of_stream

    def _undecodable(self, exc: UndecodableBody) -> tuple[bytes, bool]:
        log.warning("undecodable_body", request_id=self._rid, error=str(exc))
        self.mode = "unreadable"
        stream = self.admitted.request.stream
        tail = self._closing_bytes("upstream_error") if stream else b""
        return tail, self._finish("unreadable")

    def _sniff(self, chunk: bytes, end_of_stream: bool) -> bytes:
        """What a ``text/event-stream`` body is (``extproc.billing.sniff``). Returns the
        bytes to go on with once decided; until then holds them (the mode stays ``sniff``)."""
        held = self._held + chunk
        if self._decoder is None:
            if sniff.maybe_gzip(held, end_of_stream):
                self._held = held
                return b""
            if held.startswith(sniff.GZIP_MAGIC):
                log.warning("undeclared_gzip_body", request_id=self._rid)
                self._decoder = Decoder()
                held = self._decoder.feed(held, end_of_stream)
        kind = sniff.event_stream_kind(held, end_of_stream)
        if kind == "undecided":
            self._held = held
            return b""
        self._held = b""
        if kind == "sse":
            self.mode = "sse"
        else:
            log.warning("event_stream_not_sse", request_id=self._rid)
            self.mode = "json"
            self._json = JsonBodyCollector()
        return held

    async def on_trailers(self) -> bytes | None:
        """Trailers end the body: forward what is still held back, then settle."""
        if self.finished:
            return None
        out, _ = await self.on_body(b"", True)
        return out

    async def on_idle_timeout(self) -> bytes | None:
        if self.finished or self.settled:
            return None
        log.warning("stream_idle_timeout", request_id=self._rid)
        tail = self._closing_bytes("timeout") if self.mode in ("sse", "sniff") else b""
        self._finish("idle_timeout")
        return tail

    async def on_shutdown(self) -> bytes | None:
        """The processor's shutdown grace is over: end the client's stream cleanly, settle.

        None when nothing may be sent: the stream already ended, or no response headers yet
        (a body can't go before them; the caller settles such a request itself).
        """
        if self.finished or self.settled or not self.started:
            return None
        log.warning("stream_shutdown", request_id=self._rid, delivered=self.delivered)
        tail = self._closing_bytes("shutdown") if self.mode in ("sse", "sniff") else b""
        self._finish("shutdown")
        return tail

    async def _forward(
        self, events: list[SseEvent], costs: list[int] | None = None
    ) -> bytes | None:
        """Forward the events the lease covers; cut the stream off at the first that isn't.

        ``costs``: the events' costs when already counted (``on_body_now``). None: the
        stream was ended by someone else (the idle watchdog) during the wait for a lease,
        so nothing more may go out. ``[DONE]`` goes out and the rest of the body is dropped;
        at data no client parser reads the stream ends, as an upstream error.
        """
        if not events:
            return b""
        self.metrics.events_total += len(events)
        unreadable = False
        if costs is None:
            costs = []
            for i, event in enumerate(events):
                cost = self._cost(event)
                if cost == _UNREADABLE:
                    events, unreadable = events[:i], True
                    break
                costs.append(cost)
                if cost == _DONE_EVENT:
                    events = events[: i + 1]
                    break
        need = self.delivered
        for cost in costs:
            if cost > 0:
                need += cost
        if need > self.leased and self.incremental:
            # A usage among these events settles the request only once the events before
            # it are out: ``final_usage`` is taken after they are, so a stream that ends
            # during the wait (a hang-up, the watchdog, shutdown) is billed what it got.
            self.metrics.events_waited_total += len(events)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await self._cover(need)
            self.metrics.observe("lease_wait", self._labels, loop.time() - started)
            if self.finished:
                return None
        out = bytearray()
        for event, cost in zip(events, costs, strict=True):
            if cost == _WITHHELD:  # the forced usage chunk
                continue
            if cost > 0:
                if self.incremental and self.delivered + cost > self.leased:
                    # The cut-off decides the bill (what was delivered), not a usage parsed
                    # from the same message that the client will never see.
                    self.final_usage = None
                    out += self._closing_bytes(self.exhausted_code)
                    self.metrics.cutoffs[self._labels] += 1
                    self._finish("cutoff")
                    return bytes(out)
                self.delivered += cost
            elif cost == _DONE_EVENT:
                self.mode = "done"
            out += event.raw
        if self._output.fresh_usage:
            self.final_usage = self._output.take_usage()
        if unreadable:
            out += self._closing_bytes("upstream_error")
            self._finish("protocol_error")
            return bytes(out)
        if self.incremental:
            self._lease_ahead()
        return bytes(out)

    def _cost(self, event: SseEvent) -> int:
        """Output tokens an event carries, or one of ``_WITHHELD``, ``_DONE_EVENT``,
        ``_UNREADABLE``."""
        data = event.data
        if data is None:
            return 0
        chunk = parse_json_data(event)
        if chunk is None:
            return _DONE_EVENT  # data that is no JSON payload can only be [DONE]
        if chunk is MALFORMED:
            self.metrics.malformed_events_total += 1
            log.warning("malformed_sse_event", request_id=self._rid, size=len(event.raw))
            # Whitespace carries no output; anything else might, to a client of its own.
            return _UNREADABLE if data.strip() else 0
        cost = self._feed(chunk)
        if cost < 0:  # a usage chunk: the forced one is withheld
            return 0 if self._wants_usage else _WITHHELD
        return cost

    # -- ending ----------------------------------------------------------------------------

    def _closing_bytes(self, code: str) -> bytes:
        """The events that end a stream we cut (``extproc.billing.closing``)."""
        if self.admitted.policy.on_exhaustion == "truncate" and code.endswith("_exceeded"):
            request = self.admitted.request
            usage = (self.admitted.prompt_tokens, self.delivered)
            return closing.length_stop(
                request.endpoint,
                self._output.last_chunk,
                self._output.choice_indices(),
                f"cmpl-{self._rid}",
                request.requested_model,
                usage if request.client_wants_usage else None,
            )
        return closing.error_event(code, self.exhausted_what)

    def _finish(self, reason: str) -> bool:
        self.finished = True
        self.spawn(self.settle(reason))
        return True

    def _complete(self) -> None:
        self.completed = True
        self.spawn(self.settle("completed"))
