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
from extproc.config.limits import Entry, Layer, PlanWindow, Sourced
from extproc.config.ratelimit import RlsLimits, parse_ratelimit, read_file
from extproc.config.schema import (
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


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
    return value


def _known(doc: dict[str, Any], allowed: set[str], path: str) -> None:
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}" if path else str(key), "unknown field")


def _int(value: Any, path: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(path, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(path, f"must be a positive number, got {value!r}")
    return float(value)


def _non_negative(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        raise ConfigError(path, f"must be a number >= 0, got {value!r}")
    return float(value)


def _fraction(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(path, f"must be a number in (0, 1], got {value!r}")
    return float(value)


def _breaker(doc: Any) -> CircuitBreakerSpec:
    doc = _mapping({} if doc is None else doc, "circuit_breaker")
    _known(doc, _BREAKER_KEYS, "circuit_breaker")
    failures = _int(doc.get("failures", 5), "circuit_breaker.failures")
    interval = _int(doc.get("probe_interval_ms", 500), "circuit_breaker.probe_interval_ms")
    return CircuitBreakerSpec(failures=failures, probe_interval_s=interval / 1000)  # type: ignore[arg-type, operator]


def _ledger(doc: Any) -> LedgerSettings:
    doc = _mapping({} if doc is None else doc, "usage_ledger")
    _known(doc, _LEDGER_KEYS, "usage_ledger")
    default = LedgerSettings()
    return LedgerSettings(
        enabled=_bool(doc.get("enabled", default.enabled), "usage_ledger.enabled"),
        max_len=_int(doc.get("max_len", default.max_len), "usage_ledger.max_len", minimum=0),  # type: ignore[arg-type]
        retention_s=_int(  # type: ignore[arg-type]
            doc.get("retention_s", default.retention_s), "usage_ledger.retention_s", minimum=0
        ),
    )


def _secret(doc: dict[str, Any], env_key: str, file_key: str) -> str | None:
    """A secret read at load time from an environment variable or a file (one of them)."""
    env, file = doc.get(env_key), doc.get(file_key)
    if env is not None and file is not None:
        raise ConfigError(env_key, f"set {env_key} or {file_key}, not both")
    if env is not None:
        name = _str(env, env_key)
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(env_key, f"environment variable {name} is unset or empty")
        return secret
    if file is None:
        return None
    where = _str(file, file_key)
    try:
        secret = Path(where).read_text().strip()
    except OSError as exc:
        raise ConfigError(file_key, f"cannot read {where}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(file_key, f"{where} is empty")
    if any(c in secret for c in "\r\n\0"):
        raise ConfigError(file_key, "the secret holds a line break or NUL")
    return secret


def _readable(value: Any, path: str) -> str:
    where = _str(value, path)
    try:
        with open(where, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(path, f"cannot read {where}: {exc.strerror}") from exc
    return where


def _tls(doc: Any) -> ListenerTls | None:
    if doc is None:
        return None
    doc = _mapping(doc, "tls")
    _known(doc, _TLS_KEYS, "tls")
    for key in ("cert_file", "key_file"):
        if key not in doc:
            raise ConfigError(f"tls.{key}", "required when tls is set")
    ca = doc.get("client_ca_file")
    client_ca = None if ca is None else _readable(ca, "tls.client_ca_file")
    require = _bool(
        doc.get("require_client_cert", client_ca is not None), "tls.require_client_cert"
    )
    if require and client_ca is None:
        raise ConfigError("tls.require_client_cert", "needs tls.client_ca_file to verify against")
    return ListenerTls(
        cert_file=_readable(doc["cert_file"], "tls.cert_file"),
        key_file=_readable(doc["key_file"], "tls.key_file"),
        client_ca_file=client_ca,
        require_client_cert=require,
    )


def _seconds(value: Any, path: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(path, f"must be seconds in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(path, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be a non-empty string, got {value!r}")
    return value


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
                for model, entry in _mapping(doc["limits"], f"{path}.limits").items():
                    out[str(model)] = (entry, f"{path}.limits.{model}")
        return out


def _window(layers: _Layers) -> PlanWindow:
    window_s, path = layers.get("window_s", 60)
    seconds = _int(window_s, path)
    kind, kind_path = layers.get("window", "fixed")
    _choice(kind, kind_path, ("fixed", "sliding"))
    bucket, bucket_path = layers.get("bucket_s")
    if bucket is not None and kind != "sliding":
        raise ConfigError(bucket_path, "only applies to window: sliding")
    if kind == "sliding":
        default = bucket is None
        bucket = limits.default_bucket(seconds) if default else bucket  # type: ignore[arg-type]
        limits.sliding(seconds, bucket, bucket_path, default=default)  # type: ignore[arg-type]
    zone, zone_path = layers.get("timezone", "UTC")
    return PlanWindow(
        kind=kind,
        seconds=seconds,  # type: ignore[arg-type]
        bucket_s=bucket or 1,
        timezone=limits.timezone(zone, zone_path),
    )


def _entry(doc: Any, path: str, window: PlanWindow) -> Entry:
    doc = _mapping({} if doc is None else doc, path)
    _known(doc, _LIMIT_KEYS, path)
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
    batch = _int(doc.get("batch_tokens"), f"{path}.batch_tokens", optional=True)
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
        _known(doc, _PLAN_KEYS if i == 0 else _OVERRIDE_KEYS, path)
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
    if _bool(shadow, shadow_path):
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
        charge_mode=_choice(*pick("charge_mode", "incremental"), ("incremental", "reserve_max")),  # type: ignore[arg-type]
        batch_tokens=_int(*pick("batch_tokens", 32)),  # type: ignore[arg-type]
        on_exhaustion=_choice(*pick("on_exhaustion", "error"), ("error", "truncate")),  # type: ignore[arg-type]
        on_backend_failure=_choice(*pick("on_backend_failure", "closed"), ("closed", "open")),  # type: ignore[arg-type]
        fail_open_fraction=_fraction(*pick("fail_open_fraction", 0.1)),
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
    authority = _choice(
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
        usage_authority=authority,  # type: ignore[arg-type]  # one of _choice's choices
        usage_tolerance=float(tolerance),
    )


def _model(name: str, doc: Any, path: str, tokenizers: Any = None) -> ModelSpec:
    doc = _mapping(doc or {}, path)
    _known(doc, _MODEL_KEYS, path)
    aliases = doc.get("aliases", [])
    if not isinstance(aliases, list):
        raise ConfigError(f"{path}.aliases", "must be a list of names")
    max_tokens = _int(doc.get("max_tokens", 4096), f"{path}.max_tokens")
    default_max = _int(
        doc.get("default_max_tokens", min(1024, max_tokens)), f"{path}.default_max_tokens"
    )
    if default_max > max_tokens:  # type: ignore[operator]
        raise ConfigError(
            f"{path}.default_max_tokens", f"must not exceed max_tokens ({max_tokens})"
        )
    tokenizer = doc.get("tokenizer")
    upstream_name = doc.get("upstream_name")
    spec = ModelSpec(
        name=name,
        aliases=tuple(_str(a, f"{path}.aliases[{i}]") for i, a in enumerate(aliases)),
        tokenizer=None if tokenizer is None else _str(tokenizer, f"{path}.tokenizer"),
        max_tokens=max_tokens,  # type: ignore[arg-type]
        default_max_tokens=default_max,  # type: ignore[arg-type]
        upstream_name="" if upstream_name is None else _str(upstream_name, f"{path}.upstream_name"),
        continuous_usage=_bool(doc.get("continuous_usage", False), f"{path}.continuous_usage"),
        reserve_max=_bool(doc.get("reserve_max", False), f"{path}.reserve_max"),
        upstream_authorization=_upstream_credential(doc, path),
        prices=None
        if doc.get("prices") is None
        else limits.prices(doc["prices"], f"{path}.prices"),
    )
    return _usage_policy(spec, doc, path, tokenizers)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, "must be true or false")
    return value


def _upstream_credential(doc: dict[str, Any], path: str) -> str | None:
    """The upstream's API key as an Authorization value; secrets never live in the YAML."""
    env, file = doc.get("upstream_api_key_env"), doc.get("upstream_api_key_file")
    if env is not None and file is not None:
        raise ConfigError(path, "set upstream_api_key_env or upstream_api_key_file, not both")
    if env is not None:
        name = _str(env, f"{path}.upstream_api_key_env")
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(
                f"{path}.upstream_api_key_env", f"environment variable {name} is unset or empty"
            )
    elif file is not None:
        where = _str(file, f"{path}.upstream_api_key_file")
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
    doc = _mapping(doc, path)
    _known(doc, _TENANT_KEYS, path)
    plan_name = _str(doc.get("plan"), f"{path}.plan")
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
        overrides = _mapping(
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
        raw = {str(k): v for k, v in _mapping(doc, "plans").items()}
        for name in rls.plans:
            raw.setdefault(name, {})  # a plan only in RLS: default settings
        for name, spec in raw.items():
            path = f"plans.{name}"
            spec = _mapping({} if spec is None else spec, path)
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
    where = Path(_str(file, "ratelimit_file"))
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
    doc = _mapping(doc, "(top level)")
    _known(doc, _TOP_KEYS, "")
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
        for name, spec in _mapping(doc.get("models"), "models").items()
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
    tenant_docs = {str(k): v for k, v in _mapping(doc.get("tenants"), "tenants").items()}
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
        listen=_str(doc.get("listen", "127.0.0.1:50051"), "listen"),
        redis_url=redis_url,
        key_prefix=_str(doc.get("key_prefix", "tq"), "key_prefix"),
        max_body_bytes=_int(doc.get("max_body_bytes", 1 << 20), "max_body_bytes"),  # type: ignore[arg-type]
        rpm_counts=_choice(
            doc.get("rpm_counts", "attempts"), "rpm_counts", ("attempts", "admitted")
        ),  # type: ignore[arg-type]
        # A 4096-token answer (the default max_tokens limit) at a loaded server's 15-30
        # tokens/s takes 2.5-4.5 minutes: five minutes lets nearly every stream finish.
        shutdown_grace_s=_number(doc.get("shutdown_grace_s", 300), "shutdown_grace_s"),
        # Envoy's processor health check (1 s interval, 2 failures) plus one interval for
        # the check in flight: new streams keep coming until Envoy has seen NOT_SERVING.
        drain_delay_s=_non_negative(doc.get("drain_delay_s", 3), "drain_delay_s"),
        stream_idle_timeout_s=_number(
            doc.get("stream_idle_timeout_s", 60), "stream_idle_timeout_s"
        ),
        quota_timeout_s=_int(doc.get("quota_timeout_ms", 1000), "quota_timeout_ms") / 1000,  # type: ignore[operator]
        refund_wait_s=_int(doc.get("refund_wait_ms", 1000), "refund_wait_ms", minimum=0) / 1000,  # type: ignore[operator]
        image_tokens=_int(doc.get("image_tokens", 765), "image_tokens", minimum=0),  # type: ignore[arg-type]
        default_model=default_model,
        tokenizers=tokenizers,
        models=models,
        plans=plans,
        tenants=tenants,
        circuit_breaker=_breaker(doc.get("circuit_breaker")),
        settle_queue_max=_int(doc.get("settle_queue_max", 100_000), "settle_queue_max"),  # type: ignore[arg-type]
        # At most a record's hour: a longer one would outlive what it protects.
        heartbeat_ttl_s=_seconds(doc.get("heartbeat_ttl_s", 30), "heartbeat_ttl_s", 1, 3600),
        orphan_sweep_s=_seconds(doc.get("orphan_sweep_s", 10), "orphan_sweep_s", 0.1, 3600),
        usage_ledger=_ledger(doc.get("usage_ledger")),
        redis_username=None
        if doc.get("redis_username") is None
        else _str(doc["redis_username"], "redis_username"),
        redis_password=_secret(doc, "redis_password_env", "redis_password_file"),
        tls=_tls(doc.get("tls")),
        health_listen=None
        if doc.get("health_listen") is None
        else _str(doc["health_listen"], "health_listen"),
        model_index=index,
    )
    normalised = _normalise(config)
    # Where a replica listens is its own; replicas enforcing the same limits share one hash.
    shared = {k: v for k, v in normalised.items() if k not in PER_REPLICA_FIELDS}
    digest = hashlib.sha256(orjson.dumps(shared, option=orjson.OPT_SORT_KEYS)).hexdigest()
    object.__setattr__(config, "normalised", normalised)
    object.__setattr__(config, "hash", digest)
    return config


# Normal-form fields that differ between replicas of one deployment: not in the hash.
PER_REPLICA_FIELDS = frozenset({"listen", "health_listen"})


def _normalise(config: Config) -> dict[str, Any]:
    """A canonical plain form: defaults filled in, overrides merged, secrets only as hashes."""

    def entries(spec: dict[str, LimitSpec]) -> dict[str, Any]:
        return {
            k: {"rules": [limits.normal_rule(r) for r in v.rules], "batch_tokens": v.batch_tokens}
            for k, v in sorted(spec.items())
        }

    def plan(p: PlanSpec) -> dict[str, Any]:
        # Every limit as a rule, whichever form (sugar, rules, RLS) defined it.
        return {
            "limits": entries(p.limits),
            "tenant_rules": [limits.normal_rule(r) for r in p.tenant_rules],
            "charge_mode": p.charge_mode,
            "batch_tokens": p.batch_tokens,
            "on_exhaustion": p.on_exhaustion,
            "on_backend_failure": p.on_backend_failure,
            "fail_open_fraction": p.fail_open_fraction,
        }

    return {
        "listen": config.listen,
        "redis_url": _redact(config.redis_url),
        "key_prefix": config.key_prefix,
        "max_body_bytes": config.max_body_bytes,
        "rpm_counts": config.rpm_counts,
        "shutdown_grace_s": config.shutdown_grace_s,
        "drain_delay_s": config.drain_delay_s,
        "stream_idle_timeout_s": config.stream_idle_timeout_s,
        "quota_timeout_ms": round(config.quota_timeout_s * 1000),
        "refund_wait_ms": round(config.refund_wait_s * 1000),
        "image_tokens": config.image_tokens,
        "default_model": config.default_model,
        "tokenizers": list(config.tokenizers) if config.tokenizers is not None else None,
        "circuit_breaker": {
            "failures": config.circuit_breaker.failures,
            "probe_interval_ms": round(config.circuit_breaker.probe_interval_s * 1000),
        },
        "settle_queue_max": config.settle_queue_max,
        "heartbeat_ttl_s": config.heartbeat_ttl_s,
        "orphan_sweep_s": config.orphan_sweep_s,
        # Only whether a password is set: it never reaches logs or hashes.
        "redis_auth": {
            "username": config.redis_username,
            "password": config.redis_password is not None,
        },
        "tls": None
        if config.tls is None
        else {
            "cert_file": config.tls.cert_file,
            "key_file": config.tls.key_file,
            "client_ca_file": config.tls.client_ca_file,
            "require_client_cert": config.tls.require_client_cert,
        },
        "health_listen": config.health_listen,
        "usage_ledger": {
            "enabled": config.usage_ledger.enabled,
            "max_len": config.usage_ledger.max_len,
            "retention_s": config.usage_ledger.retention_s,
        },
        "models": {
            m.name: {
                "aliases": sorted(m.aliases),
                "tokenizer": m.tokenizer,
                "max_tokens": m.max_tokens,
                "default_max_tokens": m.default_max_tokens,
                "upstream_name": m.served_name,
                "continuous_usage": m.continuous_usage,
                "reserve_max": m.reserve_max,
                "usage_authority": m.usage_authority,
                "usage_tolerance": m.usage_tolerance,
                "prices": None
                if m.prices is None
                else {
                    "input": m.prices.input,
                    "output": m.prices.output,
                    "cached_input": m.prices.cached_input,
                    "unit": "nano per token",
                },
                # Only whether a credential is set: the secret never reaches logs or hashes.
                "upstream_credential": m.upstream_authorization is not None,
            }
            for m in sorted(config.models.values(), key=lambda m: m.name)
        },
        "plans": {name: plan(p) for name, p in sorted(config.plans.items())},
        "tenants": {
            t.id: {
                "plan": plan(t.plan),
                "plan_name": t.plan.name,
                "key_sha256": sorted(t.key_sha256),
            }
            for t in sorted(config.tenants.values(), key=lambda t: t.id)
        },
    }


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
    url = _str(value, "redis_url")
    if url == "memory://":
        return url
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ConfigError("redis_url", str(exc)) from exc
    return url


def _redact(url: str) -> str:
    """Drop the password from a Redis URL so the normalised form can be printed and logged."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)


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
