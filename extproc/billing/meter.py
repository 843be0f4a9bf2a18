"""Lease-ahead billing of one response, and its settlement.

The meter holds a lease: output tokens already reserved in the quota backend (admission
reserved the first batch). An SSE event reaches the client only when the tokens it carries
are covered by the lease. When the lease runs low, the next batch is reserved in the
background, so in normal operation no event waits for Redis. When a batch can't be had,
the covered events go out followed by a closing event and ``[DONE]`` with
``end_of_stream``: Envoy ends the client's response cleanly and drops the upstream.

Settlement commits what was delivered and refunds the rest of the reservation, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
import structlog

from extproc.admission.lease import (
    REFUND_RETRY_S,
    cover_lease,
    fair_share,
    lease_due_at,
    next_lease,
    refund_retries,
)
from extproc.admission.limit_names import describe_limit
from extproc.admission.policy import limit_kind
from extproc.billing import answer, closing, sniff
from extproc.billing.decoding import DECODABLE, Decoder, UndecodableBody, encodings
from extproc.billing.output import OutputCount
from extproc.billing.sse import (
    MALFORMED,
    JsonBodyCollector,
    SseEvent,
    SseProtocolError,
    SseReassembler,
    parse_json_data,
)
from extproc.quota.base import QuotaBackend, SettleReason
from extproc.tracing import ExchangeSpan, fail

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.billing")

# sniff: an event stream whose first bytes are not in yet (SSE, or a JSON answer or gzip
# bytes under the SSE label); sse: metered event by event; done: ``[DONE]`` went out, what
# follows is dropped; json: read whole at the end (a JSON answer, or a stream under another
# content type or not SSE); unreadable: an encoding the meter can't decode (refused).
Mode = Literal["pending", "sniff", "sse", "done", "json", "unreadable"]
# Our count may differ from the upstream's usage by this much before it is flagged.
USAGE_TOLERANCE = 0.02
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


class ResponseMeter:
    def __init__(
        self, admitted: Admitted, billing: BillingDeps, trace: ExchangeSpan | None = None
    ) -> None:
        self.admitted = admitted
        self.trace = trace  # tracing on: a span per lease batch and one for the settlement
        self.backend = billing.backend
        self.metrics = billing.metrics
        self.spawn = billing.spawn
        self._labels = admitted.metric_labels  # (model, plan)
        self.states = admitted.states
        self.mode: Mode = "pending"
        self.incremental = admitted.incremental
        self.batch = admitted.policy.batch_tokens
        self.max_output = admitted.request.max_tokens * admitted.request.choices
        model = admitted.request.model
        self._authority: answer.Authority = model.usage_authority
        self._tolerance = model.usage_tolerance
        self._wants_usage = admitted.request.client_wants_usage
        self.leased = admitted.output_reserved  # output tokens covered so far
        # Delivered tokens at which the next background lease is due (None: never).
        self._lease_due = lease_due_at(self.leased, self.batch, self.max_output)
        self.delivered = 0  # output tokens in events forwarded to the client
        self.seq = 0  # lease batch sequence number (idempotency with the request id)
        self.lease_task: asyncio.Task[None] | None = None
        self.exhausted = False
        self.refusals = 0  # leases refused while others held reservations (asked again)
        # The configuration it was admitted under (a reload may have come since).
        self._refusal_retries = refund_retries(admitted.refund_wait_s)
        self.retry_due = False  # the last lease was such a refusal: wait, then ask again
        self.exhausted_code = "tpm_limit_exceeded"
        self.exhausted_what = "tokens per minute"  # the limit that cut, for the message
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
        # Cached prompt tokens of the upstream usage the bill was taken from (cost limits).
        self.cached_input = 0
        self.settled = False
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

    # -- leases ----------------------------------------------------------------------------

    def _lease_ahead(self) -> None:
        """Reserve in the background what ``extproc.admission.lease.next_lease`` says is due.

        One batch in hand before the first token (admission's share topped up on the first
        event), the next batch once the current one is half used: at most one batch ahead,
        one lease per batch of output. Partial grants keep a nearly spent budget usable to
        the last token; after one, ``_cover`` leases only when an event needs the tokens.
        """
        due = self._lease_due  # where next_lease turns positive: one compare per event
        if due is None or self.delivered < due:
            return
        if self.lease_task is None and not self.exhausted and not self.refusals:
            amount = next_lease(self.leased, self.delivered, self.batch, self.max_output)
            if amount > 0:
                amount = fair_share(amount, self._room_left())
                self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    async def _cover(self, need: int) -> None:
        while need > self.leased and not self.exhausted:
            if self.lease_task is not None:
                await asyncio.shield(self.lease_task)
                continue
            if self.retry_due:
                # Refused while other requests of the tenant hold reservations: what they
                # don't use comes back when they settle, so ask again shortly.
                await asyncio.sleep(REFUND_RETRY_S)
            amount = cover_lease(self.leased, need, self.batch, self.max_output)
            amount = max(need - self.leased, fair_share(amount, self._room_left()))
            self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    def _room_left(self) -> int | None:
        """Tokens the tightest token counter had left at this request's last charge."""
        enforced = self.admitted.enforced_token_kinds
        rooms = [s.remaining for s in self.states if s.kind in enforced]
        return min(rooms) if rooms else None

    async def _lease(self, amount: int, minimum: int) -> None:
        self.seq += 1
        metrics = self.metrics
        metrics.quota_round_trips_total += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        span = None
        if self.trace is not None:
            span = self.trace.child("extproc.lease", **{"extproc.seq": self.seq})
            span.set_attribute("extproc.amount", amount)
        try:
            grant = await self.backend.reserve(
                self.admitted.reservation_key,
                self.seq,
                self.admitted.policy.token_counters,
                amount,
                minimum,
            )
        except Exception as exc:  # fail closed: no tokens without a charge
            log.error("lease_failed", request_id=self._rid, error=repr(exc))
            # The backend failed, not the budget: the client is told so, not "limit reached".
            self.exhausted_code = "quota_unavailable"
            metrics.backend_errors["reserve"] += 1
            metrics.lease_batches[(*self._labels, "failed")] += 1
            if span is not None:
                fail(span, exc)
                span.end()
            self.exhausted = True
            self.lease_task = None
            return
        finally:
            metrics.observe("backend", ("reserve",), loop.time() - started)
        if grant.replayed:
            metrics.replays["reserve"] += 1
        if span is not None:
            span.set_attribute("extproc.granted", grant.granted)
            span.end()
        self.retry_due = False
        if grant.granted > 0:
            metrics.lease_batches[(*self._labels, "granted")] += 1
            metrics.tokens_reserved[self._labels] += grant.granted
            self.leased += grant.granted
            self._lease_due = lease_due_at(self.leased, self.batch, self.max_output)
            self.states = grant.states or self.states
            for shadow in grant.shadow_cut_by:
                # Granted all the same: a shadow limit only reports the cut it would make.
                kind = limit_kind(shadow)
                metrics.shadow_violations[(*self._labels, kind, "cut")] += 1
                log.warning("shadow_limit_would_cut", request_id=self._rid, kind=kind)
        elif grant.others_open > 0 and self.refusals < self._refusal_retries:
            # A budget full of others' unused leases is not used up: ask again for up to
            # refund_wait_ms; refused with nobody else open, the stream is cut at once.
            self.refusals += 1
            self.retry_due = True
            metrics.lease_batches[(*self._labels, "deferred")] += 1
        else:
            self.exhausted = True
            metrics.lease_batches[(*self._labels, "refused")] += 1
            enforced = self.admitted.policy.enforced(grant.states)
            if enforced:
                tightest = min(enforced, key=lambda s: s.remaining / max(1, s.limit))
                counters = self.admitted.policy.token_counters
                counter = next((c for c in counters if c.kind == tightest.kind), None)
                if counter is not None:
                    self.exhausted_code, self.exhausted_what = describe_limit(counter)
        self.lease_task = None

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

    # -- settlement ------------------------------------------------------------------------

    def billed(self) -> tuple[int, int]:
        """``(prompt, output)`` committed at settlement (docs/billing.md).

        Never the prompt alone for a readable answer that may hold output: what can't be
        read keeps the reservation (or ``max_tokens`` where only that bounds the output),
        unless the upstream answered an error (an error body holds no output).
        """
        prompt = self.admitted.prompt_tokens
        if self.mode == "unreadable":
            return prompt, 0 if self.upstream_failed else max(self.leased, self.delivered)
        if self.mode == "json":
            return self._json_used(prompt)
        usage = self.final_usage
        if usage is not None:
            if self._disagrees(usage[1]):
                self.metrics.usage_disagreements_total += 1
                log.warning(
                    "usage_disagreement",
                    request_id=self._rid,
                    upstream=usage[1],
                    counted=self.delivered,
                )
            self.cached_input = usage[2]
        return answer.billed(prompt, self.delivered, usage, self._authority, self._tolerance)

    def _json_used(self, prompt: int) -> tuple[int, int]:
        body = self._json.body() if self._json is not None and self.completed else None
        count = None if body is None else answer.read_answer(body, self.admitted.tokenizer)
        if count is None:
            # Cut short, unreadable or over the size limit: only max_tokens bounds it.
            return prompt, 0 if self.upstream_failed else self.max_output
        if count.error:
            self.upstream_failed = True
        usage = count.usage
        self.cached_input = usage[2] if usage is not None else 0
        return answer.billed(prompt, count.total, usage, self._authority, self._tolerance)

    def _disagrees(self, upstream: int) -> bool:
        # An upstream-authority model's tokenizer differs by design: up to its tolerance.
        tolerance = USAGE_TOLERANCE if self._authority == "meter" else self._tolerance
        return abs(upstream - self.delivered) > max(2, tolerance * max(upstream, self.delivered))

    def _safe_bill(self) -> tuple[int, int]:
        """``billed``, or, should reading the answer fail (a bug), the reservation: the
        request is settled once whatever happened, never left open or billed nothing."""
        try:
            return self.billed()
        except Exception as exc:
            self.metrics.billing_errors_total += 1
            log.error("billing_failed", request_id=self._rid, error=repr(exc), exc_info=True)
            return self.admitted.prompt_tokens, max(self.leased, self.delivered)

    async def settle(self, reason: str) -> None:
        if self.settled:
            return
        self.settled = True
        if self.lease_task is not None:
            await asyncio.gather(self.lease_task, return_exceptions=True)
        counters = self.admitted.policy.token_counters
        metrics = self.metrics
        labels = self._labels
        metered = self.admitted.policy.metered
        # RPM-only requests are settled too (no counter changes): the ledger records them.
        prompt, output = self._safe_bill() if metered else (0, 0)
        ledger_reason = self._ledger_reason(reason)  # after the bill: it reads the answer
        metrics.settled[(*labels, ledger_reason)] += 1
        if not metered:
            return  # nothing was admitted in the backend: no record to settle
        used = prompt + output
        span = None
        if self.trace is not None:
            self.trace.span.set_attributes(
                {"gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": output}
            )
            span = self.trace.child("extproc.settle", **{"extproc.reason": ledger_reason})
            span.set_attribute("extproc.used", used)
        metrics.tokens[(*labels, "prompt")] += prompt
        metrics.tokens[(*labels, "output")] += output
        metrics.quota_round_trips_total += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            # A Redis backend (wrapped by the factory in ``ResilientQuotaBackend``) keeps
            # what it cannot apply now in its queue and applies it when Redis returns, so
            # the settlement is not retried here; memory:// cannot fail.
            settlement = await self.backend.settle(
                self.admitted.reservation_key,
                counters,
                used,
                reason=ledger_reason,
                output_tokens=output,
                cached_tokens=self.cached_input,
            )
        except Exception as exc:
            metrics.settle_errors_total += 1
            metrics.backend_errors["settle"] += 1
            log.error(
                "settle_failed", request_id=self._rid, used=used, reason=reason, error=repr(exc)
            )
            if span is not None:
                fail(span, exc)
                span.end()
            return
        finally:
            metrics.observe("backend", ("settle",), loop.time() - started)
        if settlement.already_settled:
            metrics.replays["settle"] += 1
        metrics.tokens_refunded[labels] += settlement.refunded
        if span is not None:
            span.set_attributes(
                {
                    "extproc.reserved": settlement.reserved,
                    "extproc.refunded": settlement.refunded,
                    "extproc.already_settled": settlement.already_settled,
                    "extproc.queued": settlement.queued,
                }
            )
            span.end()

    def _ledger_reason(self, reason: str) -> SettleReason:
        """The meter's (and the gRPC stream's) end reasons as the usage ledger names them."""
        failed = self.upstream_failed or self._output.error or self.mode == "unreadable"
        if failed or reason == "protocol_error":
            return "upstream_error"
        if self.mode == "done":
            return "completed"  # [DONE] went out: whatever ended the stream came after it
        return _LEDGER_REASONS.get(reason, "disconnect")

    @property
    def _rid(self) -> str:
        return self.admitted.reservation_key


# Anything else ends the gRPC stream before the answer did (``end_of_stream``,
# ``cancelled``, ``error``): the client went away.
_LEDGER_REASONS: dict[str, SettleReason] = {
    "completed": "completed",
    "cutoff": "cutoff",
    "idle_timeout": "timeout",
    "shutdown": "shutdown",
}
