"""YAML → validated ``Config``; every error names the field that is wrong."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import yaml

from extproc.config import limits
from extproc.config import values as check
from extproc.config.limits import Entry, Layer, PlanWindow, Sourced
from extproc.config.normal import PER_REPLICA_FIELDS, normal_form
from extproc.config.ratelimit import RlsLimits, parse_ratelimit, read_file
from extproc.config.schema import (
    AdmissionLeaseSpec,
    CircuitBreakerSpec,
    Config,
    ConfigError,
    LimitRule,
    LimitSpec,
    ListenerTls,
    Metric,
    ModelSpec,
    Period,
    PlanSpec,
    TenantSpec,
    UsageAuthority,
)
from extproc.quota.base import LedgerSettings
from extproc.quota.redis.topology import parse_redis_url, seeds_to_url
from extproc.tokens.registry import DEFAULT_RULES, ESTIMATOR_SPEC, TokenizerRule

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOP_KEYS = {
    "listen",
    "redis_url",
    "key_prefix",
    "max_body_bytes",
    "rpm_counts",
    "shutdown_grace_s",
    "drain_delay_s",
    "stream_idle_timeout_s",
    "quota_timeout_ms",
    "refund_wait_ms",
    "image_tokens",
    "default_model",
    "tokenizers",
    "models",
    "plans",
    "tenants",
    "circuit_breaker",
    "settle_queue_max",
    "heartbeat_ttl_s",
    "orphan_sweep_s",
    "usage_ledger",
    "admission_leases",
    "ratelimit",
    "ratelimit_file",
    "redis_username",
    "redis_password_file",
    "redis_password_env",
    "tls",
    "health_listen",
}
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "require_client_cert"}
_LEDGER_KEYS = {"enabled", "max_len", "retention_s"}
_LEASE_KEYS = {"enabled", "fraction", "idle_ms"}
_BREAKER_KEYS = {"failures", "probe_interval_ms"}
_PLAN_KEYS = {
    "limits",
    "window_s",
    "window",
    "bucket_s",
    "timezone",
    "tenant_tpm",
    "daily_tokens",
    "weekly_tokens",
    "monthly_tokens",
    "daily_cost",
    "monthly_cost",
    "tenant_rules",
    "shadow",
    "charge_mode",
    "batch_tokens",
    "on_exhaustion",
    "on_backend_failure",
    "fail_open_fraction",
}
_OVERRIDE_KEYS = _PLAN_KEYS - {"window_s"}
# Per-window sugar of a model's entry: each is one rule in the plan's window.
_SUGAR: dict[str, Metric] = {
    "rpm": "requests",
    "tpm": "tokens",
    "itpm": "input_tokens",
    "otpm": "output_tokens",
    "cost": "cost",
}
_LIMIT_KEYS = {*_SUGAR, "rules", "batch_tokens"}
# Tenant-wide calendar budgets in the plan's time zone.
_CALENDAR_SUGAR: dict[str, tuple[Metric, Period]] = {
    "daily_tokens": ("tokens", "day"),
    "weekly_tokens": ("tokens", "week"),
    "monthly_tokens": ("tokens", "month"),
    "daily_cost": ("cost", "day"),
    "monthly_cost": ("cost", "month"),
}
_MODEL_KEYS = {
    "aliases",
    "tokenizer",
    "max_tokens",
    "default_max_tokens",
    "upstream_name",
    "upstream_api_key_env",
    "upstream_api_key_file",
    "continuous_usage",
    "reserve_max",
    "prices",
    "usage_authority",
    "usage_tolerance",
}
_TENANT_KEYS = {"plan", "key_sha256", "overrides"}


def _breaker(doc: Any) -> CircuitBreakerSpec:
    doc = check.mapping({} if doc is None else doc, "circuit_breaker")
    check.known(doc, _BREAKER_KEYS, "circuit_breaker")
    failures = check.integer(doc.get("failures", 5), "circuit_breaker.failures")
    interval = check.integer(doc.get("probe_interval_ms", 500), "circuit_breaker.probe_interval_ms")
    return CircuitBreakerSpec(failures=failures, probe_interval_s=interval / 1000)


def _ledger(doc: Any) -> LedgerSettings:
    doc = check.mapping({} if doc is None else doc, "usage_ledger")
    check.known(doc, _LEDGER_KEYS, "usage_ledger")
    default = LedgerSettings()
    return LedgerSettings(
        enabled=check.boolean(doc.get("enabled", default.enabled), "usage_ledger.enabled"),
        max_len=check.integer(
            doc.get("max_len", default.max_len), "usage_ledger.max_len", minimum=0
        ),
        retention_s=check.integer(
            doc.get("retention_s", default.retention_s), "usage_ledger.retention_s", minimum=0
        ),
    )


def _admission_leases(doc: Any) -> AdmissionLeaseSpec:
    doc = check.mapping({} if doc is None else doc, "admission_leases")
    check.known(doc, _LEASE_KEYS, "admission_leases")
    default = AdmissionLeaseSpec()
    fraction = check.fraction(doc.get("fraction", default.fraction), "admission_leases.fraction")
    if fraction > 0.25:
        # A block is at most a quarter of what is left anyway; more would only mislead.
        raise ConfigError("admission_leases.fraction", f"must be at most 0.25, got {fraction!r}")
    idle_ms = check.integer(
        doc.get("idle_ms", round(default.idle_s * 1000)), "admission_leases.idle_ms", minimum=10
    )
    return AdmissionLeaseSpec(
        enabled=check.boolean(doc.get("enabled", default.enabled), "admission_leases.enabled"),
        fraction=fraction,
        idle_s=idle_ms / 1000,
    )


def _tls(doc: Any) -> ListenerTls | None:
    if doc is None:
        return None
    doc = check.mapping(doc, "tls")
    check.known(doc, _TLS_KEYS, "tls")
    for key in ("cert_file", "key_file"):
        if key not in doc:
            raise ConfigError(f"tls.{key}", "required when tls is set")
    ca = doc.get("client_ca_file")
    client_ca = None if ca is None else check.readable(ca, "tls.client_ca_file")
    require = check.boolean(
        doc.get("require_client_cert", client_ca is not None), "tls.require_client_cert"
    )
    if require and client_ca is None:
        raise ConfigError("tls.require_client_cert", "needs tls.client_ca_file to verify against")
    return ListenerTls(
        cert_file=check.readable(doc["cert_file"], "tls.cert_file"),
        key_file=check.readable(doc["key_file"], "tls.key_file"),
        client_ca_file=client_ca,
        require_client_cert=require,
    )


class _Layers:
    """A plan's YAML and the tenant overrides merged over it, each value with its field."""

    def __init__(self, layers: list[tuple[dict[str, Any], str]]) -> None:
        self.layers = layers

    def get(self, key: str, default: Any = None) -> tuple[Any, str]:
        for doc, path in reversed(self.layers):
            if key in doc:
                return doc[key], f"{path}.{key}"
        return default, f"{self.layers[0][1]}.{key}"

    def has(self, key: str) -> bool:
        return any(key in doc for doc, _ in self.layers)

    def limits(self) -> dict[str, tuple[Any, str]]:
        """Per model key: a ``limits.<m>`` entry replaces that model's entry whole."""
        out: dict[str, tuple[Any, str]] = {}
        for doc, path in self.layers:
            if "limits" in doc:
                for model, entry in check.mapping(doc["limits"], f"{path}.limits").items():
                    out[str(model)] = (entry, f"{path}.limits.{model}")
        return out


def _window(layers: _Layers) -> PlanWindow:
    window_s, path = layers.get("window_s", 60)
    seconds = check.integer(window_s, path)
    kind, kind_path = layers.get("window", "fixed")
    check.choice(kind, kind_path, ("fixed", "sliding"))
    bucket, bucket_path = layers.get("bucket_s")
    if bucket is not None and kind != "sliding":
        raise ConfigError(bucket_path, "only applies to window: sliding")
    if kind == "sliding":
        default = bucket is None
        bucket = limits.default_bucket(seconds) if default else bucket
        limits.sliding(seconds, bucket, bucket_path, default=default)
    zone, zone_path = layers.get("timezone", "UTC")
    return PlanWindow(
        kind=kind,
        seconds=seconds,
        bucket_s=bucket or 1,
        timezone=limits.timezone(zone, zone_path),
    )


def _entry(doc: Any, path: str, window: PlanWindow) -> Entry:
    doc = check.mapping({} if doc is None else doc, path)
    check.known(doc, _LIMIT_KEYS, path)
    found: list[Sourced] = []
    for key, metric in _SUGAR.items():
        if doc.get(key) is not None:
            where = f"{path}.{key}"
            amount = (limits.cost_limit if metric == "cost" else limits.check_limit)(
                doc[key], where
            )
            found.append(Sourced(LimitRule(metric, amount, window.spec()), where))
    if "rules" in doc:
        found.extend(limits.rules(doc["rules"], f"{path}.rules", window))
    batch = check.optional_integer(doc.get("batch_tokens"), f"{path}.batch_tokens")
    return Entry(rules=tuple(found), batch_tokens=batch)


def _tenant_rules(layers: _Layers, window: PlanWindow) -> list[Sourced]:
    found: list[Sourced] = []
    tpm, path = layers.get("tenant_tpm")
    if tpm is not None:
        found.append(
            Sourced(LimitRule("tokens", limits.check_limit(tpm, path), window.spec()), path)
        )
    for key, (metric, period) in _CALENDAR_SUGAR.items():
        value, path = layers.get(key)
        if value is not None:
            amount = (limits.cost_limit if metric == "cost" else limits.check_limit)(value, path)
            found.append(Sourced(LimitRule(metric, amount, window.calendar(period)), path))
    general, path = layers.get("tenant_rules")
    if general is not None:
        found.extend(limits.rules(general, path, window))
    return found


def _plan(
    name: str,
    layers: _Layers,
    models: dict[str, ModelSpec],
    rls_limits: dict[str, Entry] | None = None,
    rls_tenant: dict[str, Layer] | None = None,
) -> PlanSpec:
    """One plan (a tenant's: its overrides as a second layer) with every limit as rules."""
    for i, (doc, path) in enumerate(layers.layers):
        check.known(doc, _PLAN_KEYS if i == 0 else _OVERRIDE_KEYS, path)
    window = _window(layers)
    own = layers.limits()
    for model, (_, path) in own.items():
        if model != "*" and model not in models:
            raise ConfigError(path, "is not a configured model")
    entries = {model: _entry(doc, path, window) for model, (doc, path) in own.items()}
    if rls_limits is not None:
        entries = {**rls_limits, **entries}  # the caller refused limits in both places
    elif not layers.has("limits"):
        raise ConfigError(f"{layers.layers[0][1]}.limits", "is required (use '*' for every model)")
    if rls_tenant is not None:
        entries = limits.layer_over(entries, rls_tenant)
    tenant_rules = _tenant_rules(layers, window)
    shadow, shadow_path = layers.get("shadow", False)
    if check.boolean(shadow, shadow_path):
        entries = {m: Entry(limits.shadowed(e.rules), e.batch_tokens) for m, e in entries.items()}
        tenant_rules = list(limits.shadowed(tenant_rules))
    _check_rules(entries, tenant_rules, models)
    pick = layers.get
    return PlanSpec(
        name=name,
        limits={
            m: LimitSpec(rules=_ordered(e.rules), batch_tokens=e.batch_tokens)
            for m, e in entries.items()
        },
        tenant_rules=_ordered(tenant_rules),
        charge_mode=check.choice(
            *pick("charge_mode", "incremental"), ("incremental", "reserve_max")
        ),
        batch_tokens=check.integer(*pick("batch_tokens", 32)),
        on_exhaustion=check.choice(*pick("on_exhaustion", "error"), ("error", "truncate")),
        on_backend_failure=check.choice(*pick("on_backend_failure", "closed"), ("closed", "open")),
        fail_open_fraction=check.fraction(*pick("fail_open_fraction", 0.1)),
    )


def _ordered(rules: Any) -> tuple[LimitRule, ...]:
    return tuple(sorted((s.rule for s in rules), key=limits.rule_order))


def _check_rules(
    entries: dict[str, Entry], tenant_rules: list[Sourced], models: dict[str, ModelSpec]
) -> None:
    """Duplicates, and prices for every model a cost rule reaches."""
    by_star = [m for name, m in sorted(models.items()) if name not in entries]
    reached: list[ModelSpec] = []
    for model, entry in entries.items():
        limits.check_duplicates(entry.rules)
        scope = by_star if model == "*" else [models[model]] if model in models else []
        limits.check_cost(entry.rules, scope)
        reached.extend(scope)
    limits.check_duplicates(tenant_rules)
    limits.check_cost(tenant_rules, reached)


# A model counted by the estimator (an over-count by design: 2.5-3x o200k on English text)
# is floored at 30% of it; any real tokenizer at 85% of its count.
_TOLERANCE = 0.15
_ESTIMATOR_TOLERANCE = 0.7


def _tokenizer_of(name: str, rules: tuple[TokenizerRule, ...]) -> str | None:
    """The tokenizer ``rules`` give ``name``: an exact rule first, then the first pattern
    (as ``TokenizerRegistry`` resolves it)."""
    lowered = name.lower()
    exact = next((r for r in rules if not r.is_pattern and r.match == lowered), None)
    if exact is not None:
        return exact.tokenizer
    return next(
        (r.tokenizer for r in rules if r.is_pattern and fnmatch.fnmatchcase(lowered, r.match)),
        None,
    )


def _usage_policy(spec: ModelSpec, doc: dict[str, Any], path: str, rules: Any) -> ModelSpec:
    """``usage_authority`` and ``usage_tolerance``, their defaults from the tokenizer the
    model is counted with: its own (the built-in table maps its name, an alias or its
    upstream name to it) makes the meter authoritative, anything else the upstream."""
    configured = tuple(TokenizerRule.from_dict(r, i) for i, r in enumerate(rules or ()))
    counted = spec.tokenizer or _tokenizer_of(spec.name, configured + DEFAULT_RULES)
    counted = counted or ESTIMATOR_SPEC
    own = counted != ESTIMATOR_SPEC and any(
        _tokenizer_of(n, DEFAULT_RULES) == counted
        for n in (spec.name, *spec.aliases, spec.served_name)
    )
    authority: UsageAuthority = check.choice(
        doc.get("usage_authority", "meter" if own else "upstream"),
        f"{path}.usage_authority",
        ("meter", "upstream"),
    )
    default = _ESTIMATOR_TOLERANCE if counted == ESTIMATOR_SPEC else _TOLERANCE
    tolerance = doc.get("usage_tolerance", default)
    number = not isinstance(tolerance, bool) and isinstance(tolerance, int | float)
    if not number or not 0 <= tolerance < 1:
        raise ConfigError(
            f"{path}.usage_tolerance", f"must be a number in [0, 1), got {tolerance!r}"
        )
    return replace(
        spec,
        usage_authority=authority,
        usage_tolerance=float(tolerance),
    )


def _model(name: str, doc: Any, path: str, tokenizers: Any = None) -> ModelSpec:
    doc = check.mapping(doc or {}, path)
    check.known(doc, _MODEL_KEYS, path)
    aliases = doc.get("aliases", [])
    if not isinstance(aliases, list):
        raise ConfigError(f"{path}.aliases", "must be a list of names")
    max_tokens = check.integer(doc.get("max_tokens", 4096), f"{path}.max_tokens")
    default_max = check.integer(
        doc.get("default_max_tokens", min(1024, max_tokens)), f"{path}.default_max_tokens"
    )
    if default_max > max_tokens:
        raise ConfigError(
            f"{path}.default_max_tokens", f"must not exceed max_tokens ({max_tokens})"
        )
    tokenizer = doc.get("tokenizer")
    upstream_name = doc.get("upstream_name")
    spec = ModelSpec(
        name=name,
        aliases=tuple(check.string(a, f"{path}.aliases[{i}]") for i, a in enumerate(aliases)),
        tokenizer=None if tokenizer is None else check.string(tokenizer, f"{path}.tokenizer"),
        max_tokens=max_tokens,
        default_max_tokens=default_max,
        upstream_name=""
        if upstream_name is None
        else check.string(upstream_name, f"{path}.upstream_name"),
        continuous_usage=check.boolean(
            doc.get("continuous_usage", False), f"{path}.continuous_usage"
        ),
        reserve_max=check.boolean(doc.get("reserve_max", False), f"{path}.reserve_max"),
        upstream_authorization=_upstream_credential(doc, path),
        prices=None
        if doc.get("prices") is None
        else limits.prices(doc["prices"], f"{path}.prices"),
    )
    return _usage_policy(spec, doc, path, tokenizers)


def _upstream_credential(doc: dict[str, Any], path: str) -> str | None:
    """The upstream's API key as an Authorization value; secrets never live in the YAML."""
    env, file = doc.get("upstream_api_key_env"), doc.get("upstream_api_key_file")
    if env is not None and file is not None:
        raise ConfigError(path, "set upstream_api_key_env or upstream_api_key_file, not both")
    if env is not None:
        name = check.string(env, f"{path}.upstream_api_key_env")
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(
                f"{path}.upstream_api_key_env", f"environment variable {name} is unset or empty"
            )
    elif file is not None:
        where = check.string(file, f"{path}.upstream_api_key_file")
        try:
            secret = Path(where).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"{path}.upstream_api_key_file", f"cannot read: {exc.strerror}"
            ) from exc
        if not secret:
            raise ConfigError(f"{path}.upstream_api_key_file", "the file is empty")
    else:
        return None
    if any(c in secret for c in "\r\n\0"):
        raise ConfigError(path, "the upstream API key holds a line break or NUL")
    return f"Bearer {secret}"


def _tenant(tenant_id: str, doc: Any, path: str, plans: _Plans, rls: RlsLimits) -> TenantSpec:
    doc = check.mapping(doc, path)
    check.known(doc, _TENANT_KEYS, path)
    plan_name = check.string(doc.get("plan"), f"{path}.plan")
    if plan_name not in plans.specs:
        raise ConfigError(f"{path}.plan", f"unknown plan {plan_name!r}")
    hashes = doc.get("key_sha256", [])
    if isinstance(hashes, str):
        hashes = [hashes]
    if not isinstance(hashes, list) or not hashes:
        raise ConfigError(f"{path}.key_sha256", "must list at least one SHA-256 hex digest")
    for i, digest in enumerate(hashes):
        if not isinstance(digest, str) or not _SHA256.match(digest.lower()):
            raise ConfigError(
                f"{path}.key_sha256[{i}]", "must be 64 hex characters (sha256 of the key)"
            )
    plan = plans.specs[plan_name]
    own = rls.tenants.get(tenant_id)
    if "overrides" in doc or own is not None:
        overrides = check.mapping(
            {} if doc.get("overrides") is None else doc["overrides"], f"{path}.overrides"
        )
        if own is not None and "limits" in overrides:
            raise ConfigError(
                f"{path}.overrides.limits",
                f"{rls.tenant_paths[tenant_id]} also defines this tenant's limits: "
                "define them in one place",
            )
        layers = _Layers([*plans.layers[plan_name].layers, (overrides, f"{path}.overrides")])
        # The tenant's plan keeps the plan's name: it is what the ledger and metrics show.
        plan = _plan(plan_name, layers, plans.models, plans.rls.get(plan_name), own)
    return TenantSpec(id=tenant_id, plan=plan, key_sha256=tuple(h.lower() for h in hashes))


class _Plans:
    """Every plan, from the YAML and the RLS document, and what builds each (a tenant's
    plan is built again from the same layers with its overrides on top)."""

    def __init__(self, doc: Any, models: dict[str, ModelSpec], rls: RlsLimits) -> None:
        self.models = models
        self.layers: dict[str, _Layers] = {}
        self.rls: dict[str, dict[str, Entry]] = {}
        self.specs: dict[str, PlanSpec] = {}
        raw = {str(k): v for k, v in check.mapping(doc, "plans").items()}
        for name in rls.plans:
            raw.setdefault(name, {})  # a plan only in RLS: default settings
        for name, spec in raw.items():
            path = f"plans.{name}"
            spec = check.mapping({} if spec is None else spec, path)
            from_rls = name in rls.plans or bool(rls.every_plan)
            if from_rls:
                where = rls.plan_paths.get(name, rls.every_plan_path)
                if "limits" in spec:
                    raise ConfigError(
                        f"{path}.limits",
                        f"{where} also defines this plan's limits: define them in one place",
                    )
                every = limits.layer_over({}, rls.every_plan)
                self.rls[name] = limits.layer_over(every, rls.plans.get(name, {}))
            self.layers[name] = _Layers([(spec, path)])
            self.specs[name] = _plan(name, self.layers[name], models, self.rls.get(name))


def _ratelimit(
    doc: dict[str, Any], base_dir: Path | None, index: dict[str, ModelSpec]
) -> RlsLimits:
    """The RLS document, inline (``ratelimit``) or in a file (``ratelimit_file``)."""
    inline, file = doc.get("ratelimit"), doc.get("ratelimit_file")
    if inline is not None and file is not None:
        raise ConfigError("ratelimit", "set ratelimit or ratelimit_file, not both")
    if inline is not None:
        return parse_ratelimit(inline, "ratelimit", index)
    if file is None:
        return RlsLimits()
    where = Path(check.string(file, "ratelimit_file"))
    if not where.is_absolute() and base_dir is not None:
        where = base_dir / where
    return parse_ratelimit(read_file(where), "ratelimit_file", index)


def _check_replaces(
    rls: RlsLimits, plans: dict[str, PlanSpec], tenants: dict[str, TenantSpec]
) -> None:
    names = set(rls.names)
    for plan in [*plans.values(), *(t.plan for t in tenants.values())]:
        for rule in [*plan.tenant_rules, *(r for s in plan.limits.values() for r in s.rules)]:
            names.add(rule.name)
    for name, where in rls.replaces:
        if name not in names:
            raise ConfigError(where, f"replaces {name!r}, which no limit is named")


def parse_config(doc: Any, base_dir: Path | None = None) -> Config:
    """Validate a loaded YAML document. Raises ConfigError naming the first wrong field.
    ``base_dir``: where a relative ``ratelimit_file`` is (the config file's directory)."""
    doc = check.mapping(doc, "(top level)")
    check.known(doc, _TOP_KEYS, "")
    tokenizers = doc.get("tokenizers")
    if tokenizers is not None:
        if not isinstance(tokenizers, list):
            raise ConfigError("tokenizers", "must be a list of {match, tokenizer, family} rules")
        for i, rule in enumerate(tokenizers):
            try:
                TokenizerRule.from_dict(rule, i)
            except ValueError as exc:
                raise ConfigError(f"tokenizers[{i}]", str(exc)) from exc
        tokenizers = tuple(dict(r) for r in tokenizers)
    models = {
        str(name): _model(str(name), spec, f"models.{name}", tokenizers)
        for name, spec in check.mapping(doc.get("models"), "models").items()
    }
    index: dict[str, ModelSpec] = {}
    for spec in models.values():
        for name in (spec.name, *spec.aliases):
            if name in index and index[name] is not spec:
                raise ConfigError(f"models.{spec.name}", f"name or alias {name!r} used twice")
            index[name] = spec
    rls = _ratelimit(doc, base_dir, index)
    built = _Plans(doc.get("plans", {}), models, rls)
    plans = built.specs
    tenant_docs = {str(k): v for k, v in check.mapping(doc.get("tenants"), "tenants").items()}
    for tid in rls.tenants:
        if tid not in tenant_docs:
            raise ConfigError(rls.tenant_paths[tid], f"tenant {tid!r} is not under tenants")
    tenants = {
        tid: _tenant(tid, spec, f"tenants.{tid}", built, rls) for tid, spec in tenant_docs.items()
    }
    _check_replaces(rls, plans, tenants)
    seen: dict[str, str] = {}
    for tenant in tenants.values():
        for digest in tenant.key_sha256:
            if digest in seen:
                raise ConfigError(
                    f"tenants.{tenant.id}.key_sha256", f"key also used by {seen[digest]}"
                )
            seen[digest] = tenant.id
    default_model = doc.get("default_model")
    if default_model is not None and default_model not in models:
        raise ConfigError("default_model", f"{default_model!r} is not a configured model")
    redis_url = _redis_url(doc.get("redis_url", "memory://"))

    config = Config(
        listen=check.string(doc.get("listen", "127.0.0.1:50051"), "listen"),
        redis_url=redis_url,
        key_prefix=check.string(doc.get("key_prefix", "tq"), "key_prefix"),
        max_body_bytes=check.integer(doc.get("max_body_bytes", 1 << 20), "max_body_bytes"),
        rpm_counts=check.choice(
            doc.get("rpm_counts", "attempts"), "rpm_counts", ("attempts", "admitted")
        ),
        # A 4096-token answer (the default max_tokens limit) at a loaded server's 15-30
        # tokens/s takes 2.5-4.5 minutes: five minutes lets nearly every stream finish.
        shutdown_grace_s=check.number(doc.get("shutdown_grace_s", 300), "shutdown_grace_s"),
        # Envoy's processor health check (1 s interval, 2 failures) plus one interval for
        # the check in flight: new streams keep coming until Envoy has seen NOT_SERVING.
        drain_delay_s=check.non_negative(doc.get("drain_delay_s", 3), "drain_delay_s"),
        stream_idle_timeout_s=check.number(
            doc.get("stream_idle_timeout_s", 60), "stream_idle_timeout_s"
        ),
        quota_timeout_s=check.integer(doc.get("quota_timeout_ms", 1000), "quota_timeout_ms") / 1000,
        refund_wait_s=check.integer(doc.get("refund_wait_ms", 1000), "refund_wait_ms", minimum=0)
        / 1000,
        image_tokens=check.integer(doc.get("image_tokens", 765), "image_tokens", minimum=0),
        default_model=default_model,
        tokenizers=tokenizers,
        models=models,
        plans=plans,
        tenants=tenants,
        circuit_breaker=_breaker(doc.get("circuit_breaker")),
        settle_queue_max=check.integer(doc.get("settle_queue_max", 100_000), "settle_queue_max"),
        # At most a record's hour: a longer one would outlive what it protects.
        heartbeat_ttl_s=check.seconds(doc.get("heartbeat_ttl_s", 30), "heartbeat_ttl_s", 1, 3600),
        orphan_sweep_s=check.seconds(doc.get("orphan_sweep_s", 10), "orphan_sweep_s", 0.1, 3600),
        usage_ledger=_ledger(doc.get("usage_ledger")),
        admission_leases=_admission_leases(doc.get("admission_leases")),
        redis_username=None
        if doc.get("redis_username") is None
        else check.string(doc["redis_username"], "redis_username"),
        redis_password=check.secret(doc, "redis_password_env", "redis_password_file"),
        tls=_tls(doc.get("tls")),
        health_listen=None
        if doc.get("health_listen") is None
        else check.string(doc["health_listen"], "health_listen"),
        model_index=index,
    )
    normalised = normal_form(config)
    # Where a replica listens is its own; replicas enforcing the same limits share one hash.
    shared = {k: v for k, v in normalised.items() if k not in PER_REPLICA_FIELDS}
    digest = hashlib.sha256(orjson.dumps(shared, option=orjson.OPT_SORT_KEYS)).hexdigest()
    object.__setattr__(config, "normalised", normalised)
    object.__setattr__(config, "hash", digest)
    return config


def _redis_url(value: Any) -> str:
    """One URL (any topology of ``extproc.quota.redis.topology``, or ``memory://``), or a list of
    ``redis://host:port`` seeds, which means a cluster (normalised to ``redis+cluster://``)."""
    if isinstance(value, list):
        try:
            return seeds_to_url(value)
        except ValueError as exc:
            index = re.match(r"^\[(\d+)\]: ", str(exc))
            if index:
                raise ConfigError(f"redis_url[{index[1]}]", str(exc)[index.end() :]) from exc
            raise ConfigError("redis_url", str(exc)) from exc
    url = check.string(value, "redis_url")
    if url == "memory://":
        return url
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ConfigError("redis_url", str(exc)) from exc
    return url


def source_files(path: str | Path) -> list[Path]:
    """The config file and the ``ratelimit_file`` it names, if any (for the reload poll);
    a file that cannot be read or parsed is only itself: loading it reports why."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return [path]
    named = doc.get("ratelimit_file") if isinstance(doc, dict) else None
    if not isinstance(named, str) or not named:
        return [path]
    return [path, path.parent / named]  # an absolute name stays absolute


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load and validate a YAML file; ``overrides`` replace top-level fields (CLI flags)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from exc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {exc}") from exc
    if overrides and isinstance(doc, dict):
        doc = {**doc, **overrides}
    return parse_config(doc, Path(path).parent)
