"""The validated configuration, as immutable dataclasses.

Everything the hot path reads is resolved here once (plan + tenant overrides merged per
model, aliases flattened), so a request never walks the YAML tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ChargeMode = Literal["incremental", "reserve_max"]
OnExhaustion = Literal["error", "truncate"]
RpmCounts = Literal["attempts", "admitted"]


class ConfigError(ValueError):
    """A wrong configuration value; ``path`` names the field, e.g. ``plans.free.batch_tokens``."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """Limits of one tenant on one quota model; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    batch_tokens: int | None = None  # overrides the plan's batch size for this model


@dataclass(frozen=True, slots=True)
class PlanSpec:
    name: str
    limits: dict[str, LimitSpec]  # quota model name or "*"
    window_s: int = 60
    tenant_tpm: int | None = None
    daily_tokens: int | None = None
    charge_mode: ChargeMode = "incremental"
    batch_tokens: int = 32
    on_exhaustion: OnExhaustion = "error"


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


@dataclass(frozen=True, slots=True)
class Config:
    listen: str
    redis_url: str
    key_prefix: str
    max_body_bytes: int
    rpm_counts: RpmCounts
    shutdown_grace_s: float
    stream_idle_timeout_s: float
    image_tokens: int
    default_model: str | None
    tokenizers: tuple[dict[str, str], ...] | None
    models: dict[str, ModelSpec]
    plans: dict[str, PlanSpec]
    tenants: dict[str, TenantSpec]
    # Every model name and alias -> its quota model, built once by the loader.
    model_index: dict[str, ModelSpec] = field(repr=False, default_factory=dict)
    # Normalised document and its sha256: logged at start so diverging replicas show.
    normalised: dict = field(repr=False, compare=False, default_factory=dict)
    hash: str = ""

    def resolve_model(self, requested: str) -> ModelSpec | None:
        """Map a client's model name or alias to its quota model (or the default model)."""
        spec = self.model_index.get(requested)
        if spec is None and self.default_model is not None:
            return self.models[self.default_model]
        return spec
