"""Admission: identity → request → prompt tokens → one atomic quota charge → verdict."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.admission.errors import ApiError, invalid_request, model_not_found, unauthorized
from extproc.admission.identity import KeyRing, presented_key
from extproc.admission.policy import PolicyBook, QuotaPolicy
from extproc.admission.ratelimit_headers import ratelimit_headers, retry_after
from extproc.admission.request import Endpoint, ModelRequest, parse_model_request
from extproc.config import Config, TenantSpec
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import AdmitRequest, CounterState, QuotaBackend
from extproc.tokens.prompt import MalformedRequest, count_prompt_tokens
from extproc.tokens.registry import ModelTokenizer, TokenizerRegistry

_REFUSAL_CODES = {
    "rpm": ("rpm_limit_exceeded", "requests per minute"),
    "tpm": ("tpm_limit_exceeded", "tokens per minute"),
    "tenant_tpm": ("tpm_limit_exceeded", "tokens per minute (all models)"),
    "daily": ("daily_budget_exceeded", "tokens per day"),
}


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

    @property
    def incremental(self) -> bool:
        """Lease-ahead billing applies: a stream on an incremental plan with token limits."""
        return (
            self.request.stream
            and self.policy.charge_mode == "incremental"
            and bool(self.policy.token_counters)
        )


class Admission:
    def __init__(
        self,
        config: Config,
        backend: QuotaBackend,
        registry: TokenizerRegistry,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.backend = backend
        self.registry = registry
        self.keyring = KeyRing(config.tenants)
        self.policies = PolicyBook(config.key_prefix)

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
        self, tenant: TenantSpec, endpoint: Endpoint, request_id: str, raw_body: bytes
    ) -> Admitted:
        request = parse_model_request(endpoint, raw_body, self.config)
        policy = self.policies.policy(tenant, request.model.name)
        if not policy.allowed:
            raise model_not_found(request.requested_model)
        tokenizer = self.registry.counter_for(request.model.name)
        try:
            prompt_tokens = count_prompt_tokens(
                request.body, tokenizer, image_tokens=self.config.image_tokens
            )
        except MalformedRequest as exc:
            raise invalid_request(str(exc), "invalid_request") from exc

        most_output = request.max_tokens * request.choices
        if request.stream and policy.charge_mode == "incremental":
            output_reserved = min(policy.batch_tokens, most_output)
        else:
            output_reserved = most_output
        reservation_key = keys.reservation_key(tenant.id, request_id, self.config.key_prefix)
        if not policy.metered:
            return Admitted(
                tenant, request, policy, tokenizer, reservation_key,
                prompt_tokens, output_reserved, (), False,
            )  # fmt: skip
        self.metrics.quota_round_trips_total += 1
        verdict = await self.backend.admit(
            AdmitRequest(
                reservation_key=reservation_key,
                request_counters=policy.request_counters,
                token_counters=policy.token_counters,
                tokens=prompt_tokens + output_reserved,
                count_refused_attempts=self.config.rpm_counts == "attempts",
            )
        )
        if not verdict.admitted:
            raise _refusal(verdict.refused_by, verdict.states, prompt_tokens + output_reserved)
        return Admitted(
            tenant, request, policy, tokenizer, reservation_key,
            prompt_tokens, output_reserved, verdict.states, verdict.replayed,
        )  # fmt: skip


def _refusal(refused_by: str | None, states: tuple[CounterState, ...], cost: int) -> ApiError:
    code, what = _REFUSAL_CODES.get(refused_by or "rpm", _REFUSAL_CODES["rpm"])
    state = next((s for s in states if s.kind == refused_by), None)
    if state is not None and refused_by != "rpm" and cost > state.limit:
        message = (
            f"Request too large: it needs {cost} tokens but the limit is {state.limit} {what}."
        )
    elif state is not None:
        message = (
            f"Rate limit reached: limit {state.limit} {what}, {state.remaining} remaining. "
            f"Please try again in {retry_after(states, refused_by)}s."  # type: ignore[arg-type]
        )
    else:
        message = f"Rate limit reached on {what}."
    headers = (
        ("retry-after", retry_after(states, refused_by)),  # type: ignore[arg-type]
        *ratelimit_headers(states),
    )
    return ApiError(429, message, "rate_limit_error", code, None, headers)
