"""Which counters a tenant's request on a model is charged against, resolved once and cached.

Plans and tenant overrides are immutable after load, so the counter list of a
(tenant, quota model) pair is computed on first use and reused by every later request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.config import PlanSpec, TenantSpec
from extproc.config.schema import ChargeMode, OnExhaustion
from extproc.quota import keys
from extproc.quota.base import Counter, CounterKind

DAY_S = 86400


@dataclass(frozen=True, slots=True)
class QuotaPolicy:
    request_counters: tuple[Counter, ...]
    token_counters: tuple[Counter, ...]
    charge_mode: ChargeMode
    batch_tokens: int
    on_exhaustion: OnExhaustion
    allowed: bool  # False: the plan lists neither this model nor "*"
    # ``on_backend_failure: open``: every counter carries this processor's local allowance
    # (``Counter.fail_open_limit``), so the backend wrapper may admit and lease from it
    # while the backend is unavailable.
    fail_open: bool = False

    @property
    def metered(self) -> bool:
        return bool(self.request_counters or self.token_counters)


class PolicyBook:
    def __init__(self, key_prefix: str) -> None:
        self._prefix = key_prefix
        self._cache: dict[tuple[str, str], QuotaPolicy] = {}

    def policy(self, tenant: TenantSpec, model: str) -> QuotaPolicy:
        cached = self._cache.get((tenant.id, model))
        if cached is None:
            cached = self._cache[(tenant.id, model)] = self._resolve(tenant.id, tenant.plan, model)
        return cached

    def _resolve(self, tenant: str, plan: PlanSpec, model: str) -> QuotaPolicy:
        limit = plan.limits.get(model) or plan.limits.get("*")
        window = plan.window_s
        requests: list[Counter] = []
        tokens: list[Counter] = []
        fail_open = plan.on_backend_failure == "open"

        def counter(kind: CounterKind, key: str, value: int, window_s: int) -> Counter:
            # Rounded to micro-units first, so that 30 × 0.1 is 3, not 4.
            local = math.ceil(round(value * plan.fail_open_fraction, 6)) if fail_open else None
            return Counter(kind, key, value, window_s, fail_open_limit=local)

        if limit is not None and limit.rpm is not None:
            key = keys.counter_key(tenant, "rpm", model, window, self._prefix)
            requests.append(counter("rpm", key, limit.rpm, window))
        if limit is not None and limit.tpm is not None:
            key = keys.counter_key(tenant, "tpm", model, window, self._prefix)
            tokens.append(counter("tpm", key, limit.tpm, window))
        if plan.tenant_tpm is not None:
            key = keys.counter_key(tenant, "tenant_tpm", None, window, self._prefix)
            tokens.append(counter("tenant_tpm", key, plan.tenant_tpm, window))
        if plan.daily_tokens is not None:
            key = keys.counter_key(tenant, "daily", None, DAY_S, self._prefix)
            tokens.append(counter("daily", key, plan.daily_tokens, DAY_S))
        batch = (
            limit.batch_tokens if limit is not None and limit.batch_tokens else plan.batch_tokens
        )
        return QuotaPolicy(
            request_counters=tuple(requests),
            token_counters=tuple(tokens),
            charge_mode=plan.charge_mode,
            batch_tokens=batch,
            on_exhaustion=plan.on_exhaustion,
            allowed=limit is not None,
            fail_open=fail_open,
        )
