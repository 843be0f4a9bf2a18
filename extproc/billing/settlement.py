"""The meter's settlement: what a response is billed, committed once.

``settle`` bills the response (``billed``: the meter's count or the upstream's usage, per
the model's authority; docs/billing.md), commits it and refunds the rest of the
reservation in one call to the quota backend, once, whatever ended the stream, with the
reason the usage ledger records.

A part of ``extproc.billing.meter.ResponseMeter``, apart from it by job: it reads the parts
of the meter declared below, and only it changes ``settled`` and ``cached_input``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from extproc.billing import answer
from extproc.tracing import ExchangeSpan, fail

if TYPE_CHECKING:
    from extproc.admission.gate import Admitted
    from extproc.billing.meter import Mode
    from extproc.billing.output import OutputCount
    from extproc.billing.sse import JsonBodyCollector
    from extproc.metrics import Metrics
    from extproc.quota.base import QuotaBackend, SettleReason

log = structlog.get_logger("extproc.billing")

# Our count may differ from the upstream's usage by this much before it is flagged.
USAGE_TOLERANCE = 0.02


class Settlement:
    # What the settlement reads of the meter (``ResponseMeter.__init__`` sets them).
    admitted: Admitted
    backend: QuotaBackend
    metrics: Metrics
    trace: ExchangeSpan | None
    _labels: tuple[str, str]
    _rid: str
    mode: Mode
    max_output: int
    delivered: int
    leased: int
    lease_task: asyncio.Task[None] | None
    completed: bool
    upstream_failed: bool
    final_usage: answer.Usage | None
    _authority: answer.Authority
    _tolerance: float
    _json: JsonBodyCollector | None
    _output: OutputCount

    def _init_settlement(self) -> None:
        # Cached prompt tokens of the upstream usage the bill was taken from (cost limits).
        self.cached_input = 0
        self.settled = False

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
                seen_admitted=True,
                usage=self.admitted.usage,
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
        if settlement.record_lost:
            metrics.lost_admissions_charged_total += 1
            log.warning("admission_record_lost", request_id=self._rid, used=used)
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


# Anything else ends the gRPC stream before the answer did (``end_of_stream``,
# ``cancelled``, ``error``): the client went away.
_LEDGER_REASONS: dict[str, SettleReason] = {
    "completed": "completed",
    "cutoff": "cutoff",
    "idle_timeout": "timeout",
    "shutdown": "shutdown",
}
