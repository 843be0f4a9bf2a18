"""Admission: identity → request → prompt tokens → one atomic quota charge → verdict."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import structlog

from extproc.admission.blocks import AdmissionBlocks
from extproc.admission.errors import ApiError, invalid_request, model_not_found, unauthorized
from extproc.admission.identity import KeyRing, presented_key
from extproc.admission.lease import REFUND_RETRY_S, first_lease, refund_retries
from extproc.admission.limit_names import describe_limit
from extproc.admission.policy import PolicyBook, QuotaPolicy, limit_kind
from extproc.admission.ratelimit_headers import ratelimit_headers, retry_after
from extproc.admission.request import (
    ModelRequest,
    parse_model_request,
    parse_unserialised,
    serialise,
)
from extproc.admission.retry import NoAnswer, until_answered
from extproc.config import Config, TenantSpec
from extproc.config.schema import NANO_PER_UNIT
from extproc.endpoints import Endpoint
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import (
    AdmitRequest,
    Counter,
    CounterState,
    QuotaBackend,
    QuotaUnavailable,
    UsageTags,
    Verdict,
    unit_of,
)
from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.offload import PromptCounter
from extproc.tokens.prompt import MalformedRequest
from extproc.tokens.registry import TokenizerRegistry

log = structlog.get_logger("extproc.admission")

# From this body size the loop runs once between parsing the body and re-serialising it
# (~0.5 ms each at this size, ~2-3 ms each per MiB of mixed scripts), so no other stream
# waits for both back to back.
SPLIT_PARSE_MIN_BYTES = 128 * 1024


def token_count_failed() -> ApiError:
    """The tokenizer itself failed (in the worker thread or on the loop): nothing was
    charged, nothing is forwarded. Not the client's fault; the same body would fail again."""
    return ApiError(
        500,
        "The gateway could not count the prompt's tokens; the request was not forwarded.",
        "api_error",
        "token_count_failed",
    )


NO_USAGE = UsageTags()


@dataclass(frozen=True, slots=True)
class Admitted:
    """Everything the response side needs to bill and settle this request."""

    tenant: TenantSpec
    request: ModelRequest
    policy: QuotaPolicy
    tokenizer: ModelTokenizer
    reservation_key: str
    prompt_tokens: int
    output_reserved: int  # output tokens covered by the admission charge
    states: tuple[CounterState, ...]
    replayed: bool
    # Of the configuration it was admitted under: a refused lease is asked again this long.
    refund_wait_s: float
    # What the admission recorded for the usage ledger (a lost admission's entry needs it).
    usage: UsageTags = NO_USAGE

    @property
    def metric_labels(self) -> tuple[str, str]:
        """(model, plan): the labels of this request's metrics (never the tenant)."""
        return self.request.model.name, self.tenant.plan.name

    @property
    def enforced_token_kinds(self) -> frozenset[str]:
        return self.policy.enforced_token_kinds

    @property
    def incremental(self) -> bool:
        """Lease-ahead billing applies: a stream on an incremental plan with token limits."""
        return leases_output(self.request, self.policy) and bool(self.policy.token_counters)


def leases_output(request: ModelRequest, policy: QuotaPolicy) -> bool:
    """Output is leased in batches as it streams, rather than reserved whole at admission.

    Not for a model whose output may exceed its visible text (``reserve_max``): without a
    running usage from the upstream, only ``max_tokens`` reserved up front bounds it.
    """
    return request.stream and policy.charge_mode == "incremental" and not request.model.reserve_max


class Admission:
    def __init__(
        self,
        config: Config,
        backend: QuotaBackend,
        registry: TokenizerRegistry,
        metrics: Metrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        blocks: AdmissionBlocks | None = None,
    ) -> None:
        """``blocks``: admit from blocks of a tenant's budget held here (it is ``backend``
        too, then: the records it creates are waited for there)."""
        self.spawn = spawn
        self.blocks = blocks
        self.config = config
        self.metrics = metrics
        self.backend = backend
        self.registry = registry
        self.keyring = KeyRing(config.tenants)
        self.policies = PolicyBook(config.key_prefix, config.models)
        self.prompts = PromptCounter()

    def authenticate(self, headers: dict[str, str]) -> TenantSpec:
        key = presented_key(headers)
        if key is None:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        tenant = self.keyring.identify(key)
        if tenant is None:
            raise unauthorized("Incorrect API key provided.")
        return tenant

    async def admit(
        self,
        tenant: TenantSpec,
        endpoint: Endpoint | str,
        request_id: str,
        raw_body: bytes,
        client_request_id: str = "",
    ) -> Admitted:
        loop = asyncio.get_running_loop()
        started = loop.time()  # the histogram covers parsing too, but not invalid bodies
        if len(raw_body) < SPLIT_PARSE_MIN_BYTES:
            request = parse_model_request(endpoint, raw_body, self.config)
        else:
            request = parse_unserialised(endpoint, raw_body, self.config)
            await asyncio.sleep(0)
            request = serialise(request)
        policy = self.policies.policy(tenant, request.model.name)
        if not policy.allowed:
            raise model_not_found(request.requested_model)
        labels = (request.model.name, tenant.plan.name)
        try:
            return await self._admit(
                tenant, request, policy, request_id, raw_body, labels, client_request_id
            )
        finally:
            self.metrics.observe("admission", labels, loop.time() - started)

    async def _admit(
        self,
        tenant: TenantSpec,
        request: ModelRequest,
        policy: QuotaPolicy,
        request_id: str,
        raw_body: bytes,
        labels: tuple[str, str],
        client_request_id: str,
    ) -> Admitted:
        tokenizer = self.registry.counter_for(request.model.name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            # Big prompts are counted off the loop (or in slices): extproc.tokens.offload.
            prompt_tokens = await self.prompts.count(
                request.body, tokenizer, image_tokens=self.config.image_tokens
            )
            self.metrics.observe("prompt_count", labels[:1], loop.time() - started)
        except MalformedRequest as exc:
            raise invalid_request(str(exc), "invalid_request") from exc
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # CountFailed from the worker, or a Rust panic here
            log.error(
                "prompt_count_failed",
                request_id=request_id,
                tokenizer=tokenizer.name,
                body_bytes=len(raw_body),
                error=repr(exc),
            )
            raise token_count_failed() from exc

        most_output = request.max_tokens * request.choices
        if leases_output(request, policy):
            output_reserved = first_lease(policy.batch_tokens, most_output)
        else:
            output_reserved = most_output
        reservation_key = keys.reservation_key(tenant.id, request_id, self.config.key_prefix)
        if not policy.metered:
            return Admitted(
                tenant, request, policy, tokenizer, reservation_key,
                prompt_tokens, output_reserved, (), False, self.config.refund_wait_s,
            )  # fmt: skip
        usage = UsageTags(tenant.plan.name, request.model.name, client_request_id, prompt_tokens)
        charge = AdmitRequest(
            reservation_key=reservation_key,
            request_counters=policy.request_counters,
            token_counters=policy.token_counters,
            tokens=prompt_tokens + output_reserved,
            count_refused_attempts=self.config.rpm_counts == "attempts",
            # Kept in the reservation record for the usage ledger entry of its settlement.
            usage=usage,
        )
        # Refused only because other requests hold leases they may not use: ask again for
        # up to refund_wait_ms while their refunds come back, then take the final verdict.
        verdict = self.blocks.admit_here(charge) if self.blocks is not None else None
        waits = 0 if verdict is not None else refund_retries(self.config.refund_wait_s) + 1
        for attempt in range(waits):
            soft = attempt < waits - 1
            verdict = await self._charge(replace(charge, soft_refusal=soft))
            if not verdict.retry_soon:
                break
            self.metrics.admission_waits_total += 1
            await asyncio.sleep(REFUND_RETRY_S)
        assert verdict is not None  # admitted here, or at least one charge
        if verdict.cancelled:
            # Only a retry of this processor's own call can meet a cancelled key.
            raise QuotaUnavailable(f"reservation {reservation_key} was cancelled")
        if not verdict.admitted:
            self.metrics.refused[(*labels, verdict.refused_by or "rpm")] += 1
            raise _refusal(
                verdict.refused_by, verdict.states, prompt_tokens, output_reserved, policy
            )
        if verdict.replayed:
            self.metrics.replays["admit"] += 1
        for shadow in verdict.shadow_refused_by:
            # Admitted: a shadow limit only reports what it would have refused.
            kind = limit_kind(shadow)
            self.metrics.shadow_violations[(*labels, kind, "refuse")] += 1
            log.warning(
                "shadow_limit_would_refuse", request_id=request_id, tenant=tenant.id, kind=kind
            )
        self.metrics.tokens_reserved[labels] += charge.tokens
        states = policy.enforced(verdict.states)
        return Admitted(
            tenant, request, policy, tokenizer, reservation_key,
            prompt_tokens, output_reserved, states, verdict.replayed, self.config.refund_wait_s,
            usage,
        )  # fmt: skip

    def close(self) -> None:
        self.prompts.close()

    async def _charge(self, charge: AdmitRequest) -> Verdict:
        self.metrics.quota_round_trips_total += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self.backend.admit(charge)
        except Exception:
            # The charge may have been applied (or may still be, by a paused server): the
            # request is answered 503, so the key is cancelled until the backend answers.
            self.metrics.backend_errors["admit"] += 1
            self.spawn(self._cancel(charge.reservation_key, charge.token_counters))
            raise
        finally:
            self.metrics.observe("backend", ("admit",), loop.time() - started)

    async def _cancel(self, reservation_key: str, counters: tuple[Counter, ...]) -> None:
        self.metrics.lost_admissions_total += 1
        await cancel_until_answered(self.backend, reservation_key, counters, self.metrics)


async def cancel_until_answered(
    backend: QuotaBackend, reservation_key: str, counters: tuple[Counter, ...], metrics: Metrics
) -> bool:
    """Cancel (idempotent) until the backend answers (``extproc.admission.retry``)."""
    loop = asyncio.get_running_loop()

    async def cancel() -> None:
        started = loop.time()
        await backend.cancel(reservation_key, counters)
        metrics.observe("backend", ("cancel",), loop.time() - started)

    def failed(attempt: int, exc: Exception) -> None:
        metrics.backend_errors["cancel"] += 1
        log.warning("cancel_retry", request_id=reservation_key, attempt=attempt, error=repr(exc))

    try:
        await until_answered(cancel, failed)
    except NoAnswer:
        metrics.settle_errors_total += 1
        log.error("cancel_failed", request_id=reservation_key)
        return False
    return True


def _amount(counter: Counter | None, value: int) -> str:
    """A limit or count as the client reads it: cost counters hold nano-units."""
    if counter is not None and unit_of(counter.kind) == "cost":
        return f"{value / NANO_PER_UNIT:.9f}".rstrip("0").rstrip(".")
    return str(value)


def _refusal(
    refused_by: str | None,
    states: tuple[CounterState, ...],
    prompt: int,
    output: int,
    policy: QuotaPolicy,
) -> ApiError:
    counters = policy.request_counters + policy.token_counters
    counter = next((c for c in counters if c.kind == refused_by), None)
    if counter is None:
        code, what = "rpm_limit_exceeded", "requests"
    else:
        code, what = describe_limit(counter)
    state = next((s for s in states if s.kind == refused_by), None)
    need = 1
    if counter is not None and counter in policy.token_counters:
        need = prompt * counter.weights[0] + output * counter.weights[1]
    if state is not None and need > state.limit:
        needs = _amount(counter, need)
        needs = f"a spend of {needs}" if what.startswith("spend") else f"{needs} tokens"
        message = (
            f"Request too large: it needs {needs} "
            f"but the limit is {_amount(counter, state.limit)} {what}."
        )
    elif state is not None:
        message = (
            f"Rate limit reached: limit {_amount(counter, state.limit)} {what}, "
            f"{_amount(counter, state.remaining)} remaining. "
            f"Please try again in {retry_after(states, refused_by)}s."
        )
    else:
        message = f"Rate limit reached on {what}."
    headers = (
        ("retry-after", retry_after(states, refused_by)),
        *ratelimit_headers(policy.enforced(states)),
    )
    return ApiError(429, message, "rate_limit_error", code, None, headers)
