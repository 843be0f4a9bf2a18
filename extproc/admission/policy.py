"""Which counters a tenant's request on a model is charged against, resolved once and cached.

Every config format (our plans YAML, the envoyproxy/ratelimit descriptors) is loaded into
the same rules (``LimitRule``); this turns a plan's rules for one quota model into backend
counters. Plans and tenant overrides are immutable after load, so the counter list of a
(tenant, quota model) pair is computed on first use and reused by every later request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.config import LimitRule, ModelSpec, PlanSpec, TenantSpec
from extproc.config.schema import ChargeMode, OnExhaustion
from extproc.quota import keys
from extproc.quota.base import SHADOW_PREFIX, Counter, CounterKind, CounterState, unit_of

DAY_S = 86400
_NOMINAL_S = {"day": DAY_S, "week": 7 * DAY_S, "month": 31 * DAY_S}
_PER_WINDOW = {
    "requests": "rpm",
    "tokens": "tpm",
    "input_tokens": "itpm",
    "output_tokens": "otpm",
    "cost": "cost",
}
_PERIOD = {"day": "daily", "week": "weekly", "month": "monthly"}
_CALENDAR_SUFFIX = {
    "tokens": "",
    "requests": "_requests",
    "input_tokens": "_input",
    "output_tokens": "_output",
    "cost": "_cost",
}


def kind_of(rule: LimitRule, tenant_wide: bool) -> CounterKind:
    """``rpm``/``tpm``/``itpm``/``otpm``/``cost`` per window (``tenant_`` across models),
    ``daily``/``weekly``/``monthly`` (+ metric suffix) for calendar budgets (``model_``
    when per model): the names headers, errors, metrics and the ledger show."""
    if rule.window.kind == "calendar":
        kind = _PERIOD[rule.window.period or "day"] + _CALENDAR_SUFFIX[rule.metric]
        return kind if tenant_wide else "model_" + kind
    kind = _PER_WINDOW[rule.metric]
    return "tenant_" + kind if tenant_wide else kind


def limit_kind(kind: CounterKind) -> CounterKind:
    """The kind a shadow counter reports under (metrics, logs): its rule's metric and scope."""
    return kind.removeprefix(SHADOW_PREFIX)


def weights_of(rule: LimitRule, model: ModelSpec | None) -> tuple[int, int, int]:
    """What one input, output and cached input token charges the counter."""
    if rule.metric == "input_tokens":
        return (1, 0, 1)
    if rule.metric == "output_tokens":
        return (0, 1, 0)
    if rule.metric == "cost":
        prices = model.prices if model is not None else None
        if prices is None:  # the loader refuses this; a request never gets here
            raise ValueError(f"cost limit on model {model and model.name!r} without prices")
        cached = prices.input if prices.cached_input is None else prices.cached_input
        return (prices.input, prices.output, cached)
    return (1, 1, 1)


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
    # Token counter kinds that limit (not shadow): the lease's fair share reads their room.
    enforced_token_kinds: frozenset[CounterKind] = frozenset()
    shadow_kinds: frozenset[CounterKind] = frozenset()

    def enforced(self, states: tuple[CounterState, ...]) -> tuple[CounterState, ...]:
        """The states of counters that limit (shadow ones left out: headers, cut codes)."""
        if not self.shadow_kinds:
            return states
        return tuple(s for s in states if s.kind not in self.shadow_kinds)

    @property
    def metered(self) -> bool:
        return bool(self.request_counters or self.token_counters)


class PolicyBook:
    def __init__(self, key_prefix: str, models: dict[str, ModelSpec] | None = None) -> None:
        self._prefix = key_prefix
        self._models = models or {}
        self._cache: dict[tuple[str, str], QuotaPolicy] = {}

    def policy(self, tenant: TenantSpec, model: str) -> QuotaPolicy:
        cached = self._cache.get((tenant.id, model))
        if cached is None:
            cached = self._cache[(tenant.id, model)] = self._resolve(tenant.id, tenant.plan, model)
        return cached

    def _counter(
        self, tenant: str, plan: PlanSpec, rule: LimitRule, model: str, tenant_wide: bool
    ) -> Counter:
        w = rule.window
        kind = kind_of(rule, tenant_wide)
        if rule.shadow:
            # A shadow rule of the same metric and window as an enforced one is how a new
            # limit is tried: its own counter, so it never charges the enforced one again.
            kind = SHADOW_PREFIX + kind
        shape = w.kind
        window_s = w.seconds
        if shape == "calendar":
            window_s = _NOMINAL_S[w.period or "day"]
            if w.period == "day" and w.timezone == "UTC":
                shape = "fixed"  # the UTC day is the epoch-aligned 86400 s window
        span = keys.window_span(shape, window_s, w.bucket_s, w.period or "", w.timezone)
        key = keys.counter_key(
            tenant, kind, None if tenant_wide else model, window_s, self._prefix, span
        )
        weights = weights_of(rule, self._models.get(model))
        # The local fail-open allowance covers fixed windows of requests and total tokens;
        # a request under any other limit fails closed while the backend is away.
        local = None
        plain = shape == "fixed" and weights == (1, 1, 1) and not rule.shadow
        if plan.on_backend_failure == "open" and plain:
            # Rounded to micro-units first, so that 30 × 0.1 is 3, not 4.
            local = math.ceil(round(rule.limit * plan.fail_open_fraction, 6))
        return Counter(
            kind,
            key,
            rule.limit,
            window_s,
            fail_open_limit=local,
            shape=shape,
            bucket_s=w.bucket_s,
            period=w.period or "",
            timezone=w.timezone,
            weights=weights,
            shadow=rule.shadow,
        )

    def _resolve(self, tenant: str, plan: PlanSpec, model: str) -> QuotaPolicy:
        spec = plan.limits.get(model) or plan.limits.get("*")
        requests: list[Counter] = []
        tokens: list[Counter] = []
        scoped = [(r, False) for r in (spec.rules if spec is not None else ())]
        for rule, tenant_wide in [*scoped, *((r, True) for r in plan.tenant_rules)]:
            counter = self._counter(tenant, plan, rule, model, tenant_wide)
            (requests if rule.metric == "requests" else tokens).append(counter)
        counters = requests + tokens
        batch = spec.batch_tokens if spec is not None and spec.batch_tokens else plan.batch_tokens
        return QuotaPolicy(
            request_counters=tuple(requests),
            token_counters=tuple(tokens),
            charge_mode=plan.charge_mode,
            batch_tokens=batch,
            on_exhaustion=plan.on_exhaustion,
            allowed=spec is not None,
            fail_open=bool(counters) and all(c.fail_open_limit is not None for c in counters),
            enforced_token_kinds=frozenset(
                c.kind for c in tokens if not c.shadow and unit_of(c.kind) == "tokens"
            ),
            shadow_kinds=frozenset(c.kind for c in counters if c.shadow),
        )
