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

from extproc.billing.sse import (
    MALFORMED,
    JsonBodyCollector,
    SseEvent,
    SseProtocolError,
    SseReassembler,
    parse_json_data,
)
from extproc.quota.base import Grant
from extproc.tokens.incremental import IncrementalCounter

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.runtime import Runtime

log = structlog.get_logger("extproc.billing")

Mode = Literal["pending", "sse", "json", "upstream_error"]
# Our count may differ from the upstream's usage by this much before it is flagged.
USAGE_TOLERANCE = 0.02
SETTLE_ATTEMPTS = 3
_DONE = b"data: [DONE]\n\n"


_PLAIN_DELTA_KEYS = frozenset(("role", "content"))


def delta_text(choice: dict[str, Any]) -> str:
    """The generated text one chunk choice carries: content, reasoning, tool-call arguments."""
    delta = choice.get("delta")
    # Nearly every chat chunk is a plain content delta: answer it without the general walk.
    if type(delta) is dict and delta.keys() <= _PLAIN_DELTA_KEYS and "text" not in choice:
        content = delta.get("content")
        return content if type(content) is str else ""
    text = choice.get("text")  # /v1/completions
    parts: list[str] = [text] if isinstance(text, str) else []
    if isinstance(delta, dict):
        for field in ("content", "reasoning_content", "reasoning", "refusal"):
            value = delta.get(field)
            if isinstance(value, str):
                parts.append(value)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    for field in ("name", "arguments"):
                        value = function.get(field)
                        if isinstance(value, str):
                            parts.append(value)
    return parts[0] if len(parts) == 1 else "".join(parts)


class ResponseMeter:
    def __init__(self, admitted: Admitted, runtime: Runtime) -> None:
        self.admitted = admitted
        self.runtime = runtime
        self.metrics = runtime.metrics
        self.states = admitted.states
        self.mode: Mode = "pending"
        self.incremental = admitted.incremental
        self.batch = admitted.policy.batch_tokens
        self.max_output = admitted.request.max_tokens * admitted.request.choices
        self.leased = admitted.output_reserved  # output tokens covered so far
        self.delivered = 0  # output tokens in events forwarded to the client
        self.counted = 0  # output tokens in every event parsed so far (delivered or not)
        self.text_tokens = 0  # our own count of the text so far, summed over choices
        self.seq = 0  # lease batch sequence number (idempotency with the request id)
        self.lease_task: asyncio.Task[None] | None = None
        self.exhausted = False
        self.exhausted_code = "tpm_limit_exceeded"
        self.started = False  # response headers seen: the watchdog applies from here
        self.finished = False  # we ended the client's stream (cut-off or timeout)
        self.completed = False  # the upstream ended its stream normally
        self.upstream_usage: dict[str, Any] | None = None
        self.settled = False
        self._sse = SseReassembler()
        self._json: JsonBodyCollector | None = None
        self._counters: dict[int, IncrementalCounter] = {}
        self._last_chunk: dict[str, Any] | None = None

    @property
    def may_rewrite_body(self) -> bool:
        """An SSE body may lose the forced usage chunk or gain a closing event."""
        return self.mode == "sse"

    def on_headers(self, status: int, content_type: str) -> None:
        self.started = True  # from here the idle watchdog guards the reservation
        if status >= 400 or status < 200:
            self.mode = "upstream_error"
        elif self.admitted.request.stream and "text/event-stream" in content_type:
            self.mode = "sse"
        else:
            self.mode = "json"
            self._json = JsonBodyCollector()

    # -- body ------------------------------------------------------------------------------

    async def on_body(self, chunk: bytes, end_of_stream: bool) -> tuple[bytes | None, bool]:
        """Bytes to forward for this body message, and whether they end the client's stream."""
        if self.finished:
            return None, False
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
        if self.finished:
            return out, True
        if end_of_stream:
            self._complete()
        return out, end_of_stream

    async def on_trailers(self) -> None:
        if not self.finished:
            self._complete()

    async def on_idle_timeout(self) -> bytes | None:
        if self.finished or self.settled:
            return None
        log.warning("stream_idle_timeout", request_id=self._rid)
        tail = self._closing_bytes("timeout") if self.mode == "sse" else b""
        self._finish("idle_timeout")
        return tail

    async def _forward(self, events: list[SseEvent]) -> bytes:
        """Forward the events the lease covers; cut the stream off at the first that isn't."""
        if not events:
            return b""
        self.metrics.events_total += len(events)
        costs = [self._cost(event) for event in events]
        need = self.delivered
        for cost in costs:
            if cost > 0:
                need += cost
        if need > self.leased and self.incremental:
            self.metrics.events_waited_total += len(events)
            await self._cover(need)
        out = bytearray()
        for event, cost in zip(events, costs, strict=True):
            if cost < 0:  # an event withheld from the client (the forced usage chunk)
                continue
            if self.incremental and self.delivered + cost > self.leased:
                out += self._closing_bytes(self.exhausted_code)
                self.metrics.cutoffs_total += 1
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
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not choices:
            if isinstance(usage, dict):
                self.upstream_usage = usage
                return 0 if self.admitted.request.client_wants_usage else -1
            return 0
        self._last_chunk = chunk
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            # vLLM continuous_usage_stats: the upstream's own running count.
            self.upstream_usage = usage
            return self._advance(usage["completion_tokens"])
        if not isinstance(choices, list):
            return 0
        total = self.text_tokens
        for choice in choices:
            if type(choice) is not dict:
                continue
            text = delta_text(choice)
            if text:
                index = choice.get("index", 0)
                counter = self._counters.get(index)
                if counter is None:
                    counter = self._counters[index] = IncrementalCounter(self.admitted.tokenizer)
                before = counter.total
                total += counter.feed(text) - before
        self.text_tokens = total
        return self._advance(total)

    def _advance(self, total: int) -> int:
        """The tokens an event adds to the running count (a BPE merge can't make it negative)."""
        cost = max(0, total - self.counted)
        self.counted += cost
        return cost

    # -- leases ----------------------------------------------------------------------------

    def _lease_ahead(self) -> None:
        """Reserve the next batch in the background as soon as the current one is in use.

        Holding up to two batches keeps events from waiting on Redis even when the processor
        runs behind under load; it costs no extra round trips (one lease per batch of output
        either way) and partial grants keep a nearly spent budget usable to the last token.
        """
        if (
            self.lease_task is None
            and not self.exhausted
            and self.leased < self.max_output
            and self.leased - self.delivered <= self.batch
        ):
            amount = min(self.batch, self.max_output - self.leased)
            self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    async def _cover(self, need: int) -> None:
        while need > self.leased and not self.exhausted:
            if self.lease_task is not None:
                await asyncio.shield(self.lease_task)
                continue
            shortfall = need - self.leased
            amount = max(shortfall, min(self.batch, self.max_output - self.leased))
            self.lease_task = asyncio.get_running_loop().create_task(self._lease(amount, 1))

    async def _lease(self, amount: int, minimum: int) -> None:
        self.seq += 1
        self.metrics.lease_batches_total += 1
        self.metrics.quota_round_trips_total += 1
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
            grant = Grant(0)
        if grant.granted > 0:
            self.leased += grant.granted
            self.states = grant.states or self.states
        else:
            self.exhausted = True
            self.metrics.lease_refusals_total += 1
            if grant.states:
                tightest = min(grant.states, key=lambda s: s.remaining)
                if tightest.kind == "daily":
                    self.exhausted_code = "daily_budget_exceeded"
        self.lease_task = None

    # -- ending ----------------------------------------------------------------------------

    def _closing_bytes(self, code: str) -> bytes:
        """The events that end a stream we cut: an error event, or a normal length stop."""
        if self.admitted.policy.on_exhaustion == "truncate" and code in (
            "tpm_limit_exceeded",
            "daily_budget_exceeded",
        ):
            return self._truncation_bytes()
        messages = {
            "tpm_limit_exceeded": "Token rate limit reached: the stream was ended because the "
            "tenant's token budget is used up. Please try again later.",
            "daily_budget_exceeded": "Daily token budget reached: the stream was ended.",
            "timeout": "The upstream stopped sending: the stream was ended by the gateway.",
            "upstream_error": "The upstream sent an event stream the gateway cannot read.",
        }
        error_type = "rate_limit_error" if code.endswith("_exceeded") else "api_error"
        error = {"error": {"message": messages[code], "type": error_type, "code": code}}
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
        if self._json is not None:
            self.upstream_usage = self._json.finish()
        self.runtime.spawn(self.settle("completed"))

    # -- settlement ------------------------------------------------------------------------

    def used_tokens(self) -> int:
        """What this request really cost: the figure committed at settlement."""
        prompt = self.admitted.prompt_tokens
        if self.mode == "upstream_error":
            return prompt  # no output was produced; the RPM attempt stays charged
        usage = self.upstream_usage
        if self.completed and not self.finished and isinstance(usage, dict):
            completion = usage.get("completion_tokens")
            upstream_prompt = usage.get("prompt_tokens")
            if isinstance(completion, int) and isinstance(upstream_prompt, int):
                if self.mode == "sse" and self._disagrees(completion):
                    self.metrics.usage_disagreements_total += 1
                    log.warning(
                        "usage_disagreement",
                        request_id=self._rid,
                        upstream=completion,
                        counted=self.delivered,
                    )
                return upstream_prompt + completion
        if self.mode == "json" and not self.completed:
            return prompt + self.max_output  # a JSON body can't be measured when cut short
        return prompt + self.delivered

    def _disagrees(self, upstream: int) -> bool:
        return abs(upstream - self.delivered) > max(2, USAGE_TOLERANCE * upstream)

    async def settle(self, reason: str) -> None:
        if self.settled:
            return
        self.settled = True
        if self.lease_task is not None:
            await asyncio.gather(self.lease_task, return_exceptions=True)
        counters = self.admitted.policy.token_counters
        self.metrics.settled[reason] += 1
        if not counters:
            return
        used = self.used_tokens()
        for attempt in range(SETTLE_ATTEMPTS):
            try:
                self.metrics.quota_round_trips_total += 1
                await self.runtime.backend.settle(self.admitted.reservation_key, counters, used)
                return
            except Exception as exc:
                log.warning("settle_retry", request_id=self._rid, attempt=attempt, error=repr(exc))
                await asyncio.sleep(0.05 * (attempt + 1))
        self.metrics.settle_errors_total += 1
        log.error("settle_failed", request_id=self._rid, used=used, reason=reason)

    @property
    def _rid(self) -> str:
        return self.admitted.reservation_key
