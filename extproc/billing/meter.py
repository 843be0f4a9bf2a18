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
from typing import TYPE_CHECKING, Any, Literal

import orjson
import structlog

from extproc.admission.limit_names import describe_limit
from extproc.billing import answer
from extproc.billing.decoding import DECODABLE, Decoder, UndecodableBody, encodings
from extproc.billing.lease import (
    REFUND_RETRY_S,
    cover_lease,
    fair_share,
    lease_due_at,
    next_lease,
    refund_retries,
)
from extproc.billing.sse import (
    MALFORMED,
    JsonBodyCollector,
    SseEvent,
    SseProtocolError,
    SseReassembler,
    parse_json_data,
)
from extproc.quota.base import SettleReason
from extproc.tokens.incremental import IncrementalCounter
from extproc.tracing import ExchangeSpan, fail

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.runtime import Runtime

log = structlog.get_logger("extproc.billing")

# sse: metered event by event; json: read whole at the end (a JSON answer, or a stream under
# another content type); unreadable: an encoding the meter can't decode (refused).
Mode = Literal["pending", "sse", "json", "upstream_error", "unreadable"]
# Our count may differ from the upstream's usage by this much before it is flagged.
USAGE_TOLERANCE = 0.02
_DONE = b"data: [DONE]\n\n"


_PLAIN_DELTA_KEYS = frozenset(("role", "content"))


def delta_text(choice: dict[str, Any]) -> str:
    """The generated text one chunk choice carries: content, reasoning, tool-call arguments."""
    delta = choice.get("delta")
    # Nearly every chat chunk is a plain content delta: answer it without the general walk.
    if type(delta) is dict and delta.keys() <= _PLAIN_DELTA_KEYS and "text" not in choice:
        content = delta.get("content")
        return content if type(content) is str else ""
    return answer.choice_text(choice)


class ResponseMeter:
    def __init__(
        self,
        admitted: Admitted,
        runtime: Runtime,
        refund_wait_s: float | None = None,
        trace: ExchangeSpan | None = None,
    ) -> None:
        self.admitted = admitted
        self.trace = trace  # tracing on: a span per lease batch and one for the settlement
        self.runtime = runtime
        self.metrics = runtime.metrics
        self._labels = admitted.metric_labels  # (model, plan)
        self.states = admitted.states
        self.mode: Mode = "pending"
        self.incremental = admitted.incremental
        self.batch = admitted.policy.batch_tokens
        self.max_output = admitted.request.max_tokens * admitted.request.choices
        self.leased = admitted.output_reserved  # output tokens covered so far
        # Delivered tokens at which the next background lease is due (None: never).
        self._lease_due = lease_due_at(self.leased, self.batch, self.max_output)
        self.delivered = 0  # output tokens in events forwarded to the client
        self.counted = 0  # output tokens in every event parsed so far (delivered or not)
        self.text_tokens = 0  # our own count of the text so far, summed over choices
        self.seq = 0  # lease batch sequence number (idempotency with the request id)
        self.lease_task: asyncio.Task[None] | None = None
        self.exhausted = False
        self.refusals = 0  # leases refused while others held reservations (asked again)
        self._refusal_retries = refund_retries(
            runtime.config.refund_wait_s if refund_wait_s is None else refund_wait_s
        )  # the config it was admitted under (a reload may have come since)
        self.retry_due = False  # the last lease was such a refusal: wait, then ask again
        self.exhausted_code = "tpm_limit_exceeded"
        self.exhausted_what = "tokens per minute"  # the limit that cut, for the message
        self.started = False  # response headers seen: the watchdog applies from here
        self.finished = False  # we ended the client's stream (cut-off or timeout)
        self.completed = False  # the upstream ended its stream normally
        # The upstream's closing usage chunk arrived: it settles the request from here on,
        # whatever the client does next.
        self.final_usage: answer.Usage | None = None
        # Cached prompt tokens of the upstream usage the bill was taken from (cost limits).
        self.cached_input = 0
        self.settled = False
        self._decoder: Decoder | None = None
        self._sse = SseReassembler()
        self._json: JsonBodyCollector | None = None
        self._counters: dict[int, IncrementalCounter] = {}
        self._last_chunk: dict[str, Any] | None = None
        # An event ``on_body_now`` counted but could not forward (the lease didn't cover it):
        # the body message it came in, the event, its cost. ``on_body`` takes it from here
        # (the same bytes: upb hands out a new bytes object per access, so compared by value).
        self._declined: tuple[bytes, SseEvent, int] | None = None

    @property
    def may_rewrite_body(self) -> bool:
        """An SSE body may lose the forced usage chunk or gain a closing event; a decoded
        body changes length."""
        return self.mode == "sse" or self._decoder is not None

    @property
    def decoding(self) -> bool:
        return self._decoder is not None

    def on_headers(self, status: int, content_type: str, content_encoding: str = "") -> None:
        self.started = True  # from here the idle watchdog guards the reservation
        if status >= 400 or status < 200:
            self.mode = "upstream_error"
            return
        codings = encodings(content_encoding)
        if len(codings) > 1 or (codings and codings[0] not in DECODABLE):
            log.warning("unreadable_encoding", request_id=self._rid, encoding=content_encoding)
            self.mode = "unreadable"
            self.runtime.spawn(self.settle("unreadable"))
            return
        if codings:
            self._decoder = Decoder()
        if self.admitted.request.stream and "text/event-stream" in content_type.lower():
            self.mode = "sse"
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
            return None  # not JSON ([DONE], malformed, invalid UTF-8): the general path
        if type(parsed) is not dict:
            return None
        cost = self._chunk_cost(parsed)
        if cost < 0:  # the forced usage chunk, withheld from the client
            self.metrics.events_total += 1
            return b""
        if self.incremental and self.delivered + cost > self.leased:
            self._declined = (chunk, SseEvent(chunk, data.decode("utf-8", "replace")), cost)
            return None
        self.metrics.events_total += 1
        self.delivered += cost
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
        if self._decoder is not None:
            try:
                chunk = self._decoder.feed(chunk, end_of_stream)
            except UndecodableBody as exc:
                log.warning("undecodable_body", request_id=self._rid, error=str(exc))
                self.mode = "unreadable"
                stream = self.admitted.request.stream
                tail = self._closing_bytes("upstream_error") if stream else b""
                return tail, self._finish("unreadable")
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
            return out + self._closing_bytes("upstream_error"), self._finish("protocol_error")
        out = await self._forward(events)
        if out is None:  # ended elsewhere (the watchdog) while this message waited
            return None, False
        if self.finished:
            return out, True
        if end_of_stream:
            self._complete()
        return out, end_of_stream

    async def on_trailers(self) -> bytes | None:
        """Trailers end the body: forward what the reassembler still holds, then settle."""
        if self.finished:
            return None
        out = b""
        if self.mode == "sse":
            try:
                tail = self._sse.finish()
            except SseProtocolError as exc:
                tail = exc.events
            out = await self._forward(tail)
            if out is None:
                return None
            if self.finished:
                return out
        self._complete()
        return out

    async def on_idle_timeout(self) -> bytes | None:
        if self.finished or self.settled:
            return None
        log.warning("stream_idle_timeout", request_id=self._rid)
        tail = self._closing_bytes("timeout") if self.mode == "sse" else b""
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
        tail = self._closing_bytes("shutdown") if self.mode == "sse" else b""
        self._finish("shutdown")
        return tail

    async def _forward(
        self, events: list[SseEvent], costs: list[int] | None = None
    ) -> bytes | None:
        """Forward the events the lease covers; cut the stream off at the first that isn't.

        ``costs``: the events' costs when already counted (``on_body_now``). None: the
        stream was ended by someone else (the idle watchdog) during the wait for a lease,
        so nothing more may go out.
        """
        if not events:
            return b""
        self.metrics.events_total += len(events)
        usage_before = self.final_usage
        if costs is None:
            costs = [self._cost(event) for event in events]
        need = self.delivered
        for cost in costs:
            if cost > 0:
                need += cost
        if need > self.leased and self.incremental:
            # A usage chunk among these events settles the request only once the events
            # before it are out: held while they wait for a lease, so a stream that ends
            # during the wait (a hang-up, the watchdog, shutdown) is billed what it got.
            parsed_usage, self.final_usage = self.final_usage, usage_before
            self.metrics.events_waited_total += len(events)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await self._cover(need)
            self.metrics.observe("lease_wait", self._labels, loop.time() - started)
            if self.finished:
                return None
            self.final_usage = parsed_usage
        out = bytearray()
        for event, cost in zip(events, costs, strict=True):
            if cost < 0:  # an event withheld from the client (the forced usage chunk)
                continue
            if self.incremental and self.delivered + cost > self.leased:
                # The cut-off decides the bill (what was delivered), not a usage chunk
                # parsed from the same message that the client will never see.
                self.final_usage = None
                out += self._closing_bytes(self.exhausted_code)
                self.metrics.cutoffs[self._labels] += 1
                self._finish("cutoff")
                return bytes(out)
            self.delivered += cost
            out += event.raw
        if self.incremental:
            self._lease_ahead()
        return bytes(out)

    def _cost(self, event: SseEvent) -> int:
        """Output tokens an event carries; -1 for an event the client must not see."""
        if event.data is None:
            return 0
        chunk = parse_json_data(event)
        if chunk is None:
            return 0
        if chunk is MALFORMED:
            self.metrics.malformed_events_total += 1
            log.warning("malformed_sse_event", request_id=self._rid, size=len(event.raw))
            return 0
        return self._chunk_cost(chunk)

    def _chunk_cost(self, chunk: dict[str, Any]) -> int:
        """``_cost`` of an event whose data is the JSON object ``chunk``."""
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not choices:
            if isinstance(usage, dict):
                self.final_usage = answer.usage_counts(usage)
                return 0 if self.admitted.request.client_wants_usage else -1
            return 0
        self._last_chunk = chunk
        if usage is not None and type(usage) is dict:
            running = usage.get("completion_tokens")
            if type(running) is int:
                # vLLM continuous_usage_stats: the upstream's own running count.
                return self._advance(running)
        if type(choices) is not list:
            return 0
        total = self.text_tokens
        counters = self._counters
        for choice in choices:
            if type(choice) is not dict:
                continue
            text = delta_text(choice)
            if text:
                index = choice.get("index", 0)
                counter = counters.get(index)
                if counter is None:
                    counter = counters[index] = IncrementalCounter(self.admitted.tokenizer)
                before = counter.total
                total += counter.feed(text) - before
        self.text_tokens = total
        # _advance, inlined: this runs once per event.
        cost = total - self.counted
        if cost <= 0:
            return 0
        self.counted = total
        return cost

    def _advance(self, total: int) -> int:
        """The tokens an event adds to the running count (a BPE merge can't make it negative)."""
        cost = max(0, total - self.counted)
        self.counted += cost
        return cost

    # -- leases ----------------------------------------------------------------------------

    def _lease_ahead(self) -> None:
        """Reserve in the background what ``extproc.billing.lease.next_lease`` says is due.

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
            grant = await self.runtime.backend.reserve(
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
            for kind in grant.shadow_cut_by:
                # Granted all the same: a shadow limit only reports the cut it would make.
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
        """The events that end a stream we cut: an error event, or a normal length stop."""
        limit = code.endswith("_exceeded")
        if self.admitted.policy.on_exhaustion == "truncate" and limit:
            return self._truncation_bytes()
        messages = {
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
        message = messages.get(code) or (
            f"Rate limit reached on {self.exhausted_what}: the stream was ended. "
            "Please try again later."
        )
        error_type = "rate_limit_error" if limit else "api_error"
        error = {"error": {"message": message, "type": error_type, "code": code}}
        return b"data: " + orjson.dumps(error) + b"\n\n" + _DONE

    def _truncation_bytes(self) -> bytes:
        last = self._last_chunk or {}
        is_chat = self.admitted.request.endpoint == "chat"
        indices = sorted(self._counters) or [0]
        if is_chat:
            choices = [{"index": i, "delta": {}, "finish_reason": "length"} for i in indices]
        else:
            choices = [{"index": i, "text": "", "finish_reason": "length"} for i in indices]
        final = {
            "id": last.get("id", f"cmpl-{self._rid}"),
            "object": last.get("object", "chat.completion.chunk" if is_chat else "text_completion"),
            "created": last.get("created", 0),
            "model": last.get("model", self.admitted.request.requested_model),
            "choices": choices,
        }
        out = b"data: " + orjson.dumps(final) + b"\n\n"
        if self.admitted.request.client_wants_usage:
            usage = {
                "prompt_tokens": self.admitted.prompt_tokens,
                "completion_tokens": self.delivered,
                "total_tokens": self.admitted.prompt_tokens + self.delivered,
            }
            out += b"data: " + orjson.dumps({**final, "choices": [], "usage": usage}) + b"\n\n"
        return out + _DONE

    def _finish(self, reason: str) -> bool:
        self.finished = True
        self.runtime.spawn(self.settle(reason))
        return True

    def _complete(self) -> None:
        self.completed = True
        self.runtime.spawn(self.settle("completed"))

    # -- settlement ------------------------------------------------------------------------

    def used_tokens(self) -> int:
        """What this request really cost: the figure committed at settlement."""
        return sum(self.billed())

    def billed(self) -> tuple[int, int]:
        """``(prompt, output)`` committed at settlement.

        Never the prompt alone for an answer that may hold output: what can't be read keeps
        the reservation (or ``max_tokens`` where only that bounds the output).
        """
        prompt = self.admitted.prompt_tokens
        if self.mode == "upstream_error":
            return prompt, 0  # no output was produced; the RPM attempt stays charged
        if self.mode == "unreadable":
            return prompt, max(self.leased, self.delivered)
        if self.mode == "json":
            return self._json_used(prompt)
        if self.final_usage is not None:
            if self._disagrees(self.final_usage[1]):
                self.metrics.usage_disagreements_total += 1
                log.warning(
                    "usage_disagreement",
                    request_id=self._rid,
                    upstream=self.final_usage[1],
                    counted=self.delivered,
                )
            self.cached_input = self.final_usage[2]
            return answer.billed(prompt, self.delivered, self.final_usage)
        return prompt, self.delivered

    def _json_used(self, prompt: int) -> tuple[int, int]:
        body = self._json.body() if self._json is not None and self.completed else None
        read = None if body is None else answer.read_answer(body, self.admitted.tokenizer)
        if read is None:
            # Cut short, unreadable or over the size limit: only max_tokens bounds it.
            return prompt, self.max_output
        counted, usage = read
        self.cached_input = usage[2] if usage is not None else 0
        return answer.billed(prompt, counted, usage)

    def _disagrees(self, upstream: int) -> bool:
        return abs(upstream - self.delivered) > max(2, USAGE_TOLERANCE * upstream)

    async def settle(self, reason: str) -> None:
        if self.settled:
            return
        self.settled = True
        if self.lease_task is not None:
            await asyncio.gather(self.lease_task, return_exceptions=True)
        counters = self.admitted.policy.token_counters
        metrics = self.metrics
        labels = self._labels
        ledger_reason = self._ledger_reason(reason)
        metrics.settled[(*labels, ledger_reason)] += 1
        if not self.admitted.policy.metered:
            return  # nothing was admitted in the backend: no record to settle
        # RPM-only requests are settled too (no counter changes): the ledger records them.
        prompt, output = self.billed()
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
            settlement = await self.runtime.backend.settle(
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
        if self.mode in ("upstream_error", "unreadable") or reason == "protocol_error":
            return "upstream_error"
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
