"""The validated configuration, as immutable dataclasses.

Everything the hot path reads is resolved here once (plan + tenant overrides merged per
model, aliases flattened), so a request never walks the YAML tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from extproc.quota.base import LedgerSettings, Period, WindowKind, WindowSpec

__all__ = ["Period", "WindowKind", "WindowSpec"]  # re-exported: defined with the counters

ChargeMode = Literal["incremental", "reserve_max"]
OnExhaustion = Literal["error", "truncate"]
RpmCounts = Literal["attempts", "admitted"]
OnBackendFailure = Literal["closed", "open"]
# Whose figure bills a model's tokens when the meter's count and the upstream's usage
# disagree (docs/billing.md): the meter's (its tokenizer is the model's own) or the
# upstream's, floored at (1 - usage_tolerance) × the meter's count.
UsageAuthority = Literal["meter", "upstream"]


class ConfigError(ValueError):
    """A wrong configuration value; ``path`` names the field, e.g. ``plans.free.batch_tokens``."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


Metric = Literal["requests", "tokens", "input_tokens", "output_tokens", "cost"]
# Cost counters count nano-units (1e-9) of the configured currency: a price per million
# tokens with up to three decimals is a whole number of nano-units per token, and a
# budget up to ~9 million currency units stays exact in Lua's doubles (2**53).
NANO_PER_UNIT = 1_000_000_000


@dataclass(frozen=True, slots=True)
class LimitRule:
    """One limit: at most ``limit`` of ``metric`` per window. ``limit`` counts requests,
    tokens (input + output; ``input_tokens``/``output_tokens`` one side only), or cost in
    nano-units (``NANO_PER_UNIT``) priced by the model's ``PriceSpec``. A ``shadow`` limit
    is counted and reports what it would have refused or cut, but refuses nothing."""

    metric: Metric
    limit: int
    window: WindowSpec = field(default_factory=WindowSpec)
    shadow: bool = False
    name: str = ""  # from an RLS descriptor's ``name`` (``replaces`` refers to it)


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """Limits of one tenant on one quota model (or ``"*"``: each model on its own). An
    entry with no rules allows the model, unlimited (RLS ``unlimited: true``)."""

    rules: tuple[LimitRule, ...] = ()
    batch_tokens: int | None = None  # overrides the plan's batch size for this model


@dataclass(frozen=True, slots=True)
class PriceSpec:
    """A model's prices in nano-units per token (the YAML gives them per million tokens)."""

    input: int = 0
    output: int = 0
    cached_input: int | None = None  # None: cached input tokens cost ``input``


@dataclass(frozen=True, slots=True)
class PlanSpec:
    name: str
    # Per quota model name or "*": a model's own entry replaces the "*" entry (as a more
    # specific descriptor does in envoyproxy/ratelimit). A model in neither is refused.
    limits: dict[str, LimitSpec]
    # One counter for the tenant across all its models (tenant TPM, calendar budgets).
    tenant_rules: tuple[LimitRule, ...] = ()
    charge_mode: ChargeMode = "incremental"
    batch_tokens: int = 32
    on_exhaustion: OnExhaustion = "error"
    # When the quota backend is unavailable: ``closed`` answers 503 ``quota_unavailable``;
    # ``open`` serves from a local allowance of ``fail_open_fraction`` × each limit per
    # processor, reconciled into the backend when it returns.
    on_backend_failure: OnBackendFailure = "closed"
    fail_open_fraction: float = 0.1


@dataclass(frozen=True, slots=True)
class TenantSpec:
    id: str
    plan: PlanSpec  # the tenant's plan with its overrides already applied
    key_sha256: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # the quota model: every alias shares its counters
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None  # None: chosen by the tokenizer registry from the name
    max_tokens: int = 4096  # server limit on output tokens
    default_max_tokens: int = 1024  # when the client sends none
    upstream_name: str = ""  # the name the upstream serves it under ("" = ``name``)
    # The upstream reports a running usage per chunk (vLLM ``continuous_usage_stats``):
    # forced on, and the lease follows the upstream's count, hidden tokens included.
    continuous_usage: bool = False
    # Output can exceed the visible text (hidden reasoning) and there is no running usage:
    # admission reserves ``max_tokens`` whatever the plan's charge mode.
    reserve_max: bool = False
    # ``Bearer <secret>`` read from the environment or a file at load time, never from YAML.
    upstream_authorization: str | None = field(default=None, repr=False, compare=False)
    prices: PriceSpec | None = None  # needed by any cost limit that applies to the model
    # The loader's defaults: ``meter`` where the built-in table names the model's own
    # tokenizer, else ``upstream``; 0.15, or 0.7 for a model counted by the estimator.
    usage_authority: UsageAuthority = "meter"
    usage_tolerance: float = 0.15

    @property
    def served_name(self) -> str:
        return self.upstream_name or self.name


@dataclass(frozen=True, slots=True)
class CircuitBreakerSpec:
    """After ``failures`` consecutive failed backend calls, calls stop reaching the backend;
    one probe every ``probe_interval_s`` closes the breaker again when it succeeds."""

    failures: int = 5
    probe_interval_s: float = 0.5


@dataclass(frozen=True, slots=True)
class ListenerTls:
    """TLS on the gRPC listener. With ``client_ca_file`` client certificates are verified
    against that CA bundle; ``require_client_cert`` refuses a client without one (mutual
    TLS). The files are read again on every new connection when they changed, so a
    rotated certificate is served without a restart."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    require_client_cert: bool = False


@dataclass(frozen=True, slots=True)
class AdmissionLeaseSpec:
    """``admission_leases``: admit a tenant far from its limits from a block of its budget
    this processor holds (``extproc.admission.blocks``), without a round trip."""

    enabled: bool = False
    fraction: float = 0.05  # of each counter's limit, at most, per block
    idle_s: float = 1.0  # a block unused this long is returned


@dataclass(frozen=True, slots=True)
class Config:
    listen: str
    redis_url: str
    key_prefix: str
    max_body_bytes: int
    rpm_counts: RpmCounts
    shutdown_grace_s: float
    drain_delay_s: float  # SIGTERM → NOT_SERVING, new streams still taken for this long
    stream_idle_timeout_s: float
    quota_timeout_s: float
    # A refusal while other requests of the tenant hold leases is asked again for this long
    # (their unused leases come back when they settle); 0: refuse at once.
    refund_wait_s: float
    image_tokens: int
    default_model: str | None
    tokenizers: tuple[dict[str, str], ...] | None
    models: dict[str, ModelSpec]
    plans: dict[str, PlanSpec]
    tenants: dict[str, TenantSpec]
    circuit_breaker: CircuitBreakerSpec = field(default_factory=CircuitBreakerSpec)
    # Settlements, cancels and fail-open reconciliations waiting for the backend to return.
    settle_queue_max: int = 100_000
    # A processor whose heartbeat is this old is dead: peers settle its open reservations
    # (extproc.quota.liveness.orphans); each processor looks for dead peers every orphan_sweep_s.
    heartbeat_ttl_s: float = 30.0
    orphan_sweep_s: float = 10.0
    # The per-tenant usage ledger (a Redis Stream each) and its bounds.
    usage_ledger: LedgerSettings = field(default_factory=LedgerSettings)
    admission_leases: AdmissionLeaseSpec = field(default_factory=AdmissionLeaseSpec)
    # Redis ACL user and password (from ``redis_password_file`` or ``redis_password_env``);
    # each overrides what the URL carries. The password is never in the normal form.
    redis_username: str | None = None
    redis_password: str | None = field(default=None, repr=False, compare=False)
    tls: ListenerTls | None = None
    # A second, plaintext listener serving only grpc.health.v1 (Kubernetes' gRPC probes
    # speak no TLS); None: health is served on ``listen`` only.
    health_listen: str | None = None
    # Every model name and alias -> its quota model, built once by the loader.
    model_index: dict[str, ModelSpec] = field(repr=False, default_factory=dict)
    # Normalised document and its sha256: logged at start so diverging replicas show.
    normalised: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    hash: str = ""

    def resolve_model(self, requested: str) -> ModelSpec | None:
        """Map a client's model name or alias to its quota model (or the default model)."""
        spec = self.model_index.get(requested)
        if spec is None and self.default_model is not None:
            return self.models[self.default_model]
        return spec
