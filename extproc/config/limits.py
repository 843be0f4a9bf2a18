"""The limit grammar shared by both sources (our YAML and the envoyproxy/ratelimit format):
rules, windows, prices and exact decimal amounts, each rule kept with the field that
defined it until the plan is validated, so every later error still names that field."""

from __future__ import annotations

import decimal
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, get_args

from extproc.config.schema import (
    ConfigError,
    LimitRule,
    Metric,
    ModelSpec,
    Period,
    PriceSpec,
    WindowSpec,
)
from extproc.config.values import known

# Counters are compared in Lua, whose numbers are doubles: exact up to 2**53.
MAX_LIMIT = 2**53
# A sliding counter's worst calls (a refusal's Retry-After, the first call after most of
# the window sat idle) walk its buckets inside one script: ~1 ms of Redis time at 600
# (benchmarks/bench_windows.py), which is as long as one script may hold the server.
MAX_BUCKETS = 600
METRICS: tuple[Metric, ...] = get_args(Metric)
PERIODS: tuple[Period, ...] = get_args(Period)
_RULE_KEYS = {"metric", "limit", "window", "shadow", "name"}
_WINDOW_KEYS = {"kind", "seconds", "bucket_s", "period", "timezone"}
_PRICE_KEYS = {"input", "output", "cached_input"}
_UNITS = {"requests": "requests", "cost": "nano"}  # every other metric counts tokens


@dataclass(frozen=True, slots=True)
class Sourced:
    """A rule and the field (or RLS descriptor) that defined it."""

    rule: LimitRule
    path: str


@dataclass(frozen=True, slots=True)
class Entry:
    """A model's (or ``"*"``'s) limits while a plan is being built."""

    rules: tuple[Sourced, ...] = ()
    batch_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Layer:
    """What a more specific scope defines for one model key: its rules take the place of
    the inherited rules of the same ``metrics`` (an unlimited metric is defined with no
    rule), and inherited rules named in ``replaces`` are dropped."""

    rules: tuple[Sourced, ...]
    metrics: frozenset[str]
    replaces: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PlanWindow:
    """A plan's defaults for its rules: the kind and length of its per-window limits and the
    time zone of its calendar limits."""

    kind: str = "fixed"
    seconds: int = 60
    bucket_s: int = 1
    timezone: str = "UTC"

    def spec(self) -> WindowSpec:
        if self.kind == "sliding":
            return WindowSpec(kind="sliding", seconds=self.seconds, bucket_s=self.bucket_s)
        return WindowSpec(kind="fixed", seconds=self.seconds)

    def calendar(self, period: Period) -> WindowSpec:
        return WindowSpec(kind="calendar", period=period, timezone=self.timezone)


def layer_over(base: Mapping[str, Entry], layers: Mapping[str, Layer]) -> dict[str, Entry]:
    """``base`` (a less specific scope's limits) with a more specific scope's ``layers``.

    The more specific scope wins first, then the more specific model: for each model key,
    start from what applied to it in ``base`` (its own entry, else ``"*"``'s), apply the
    scope's ``"*"`` layer, then the scope's layer for that model."""
    out: dict[str, Entry] = {}
    for key in sorted({*base, *layers}):
        entry = base.get(key) or base.get("*") or Entry()
        for top in (layers.get("*"), layers.get(key) if key != "*" else None):
            if top is not None:
                kept = tuple(
                    s
                    for s in entry.rules
                    if s.rule.metric not in top.metrics and s.rule.name not in top.replaces
                )
                entry = Entry(rules=kept + top.rules, batch_tokens=entry.batch_tokens)
        out[key] = entry
    return out


def check_limit(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise ConfigError(path, f"must be an integer in [1, 2**53], got {value!r}")
    return value


def decimal_of(value: Any, path: str) -> decimal.Decimal:
    """An exact decimal from a YAML number or string, never through float arithmetic."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(path, f"must be a decimal number, got {value!r}")
    try:
        amount = decimal.Decimal(str(value).strip())
    except decimal.InvalidOperation:
        raise ConfigError(path, f"must be a decimal number, got {value!r}") from None
    if not amount.is_finite():
        raise ConfigError(path, f"must be a finite decimal number, got {value!r}")
    return amount


def nano(value: Any, path: str, *, per_million: bool = False, minimum: int = 1) -> int:
    """Currency units (per million tokens) as whole nano-units (per token), exactly:
    ``scaleb`` only moves the decimal point."""
    amount = decimal_of(value, path).scaleb(3 if per_million else 9)
    if amount != amount.to_integral_value():
        what = "nano-units per token" if per_million else "nano-units (1e-9)"
        raise ConfigError(path, f"{value} is not a whole number of {what}")
    count = int(amount)
    if not minimum <= count <= MAX_LIMIT:
        raise ConfigError(path, f"must be in [{minimum}, 2**53] nano-units, got {count}")
    return count


def cost_limit(value: Any, path: str) -> int:
    return nano(value, path)


def prices(doc: Any, path: str) -> PriceSpec:
    """``{input, output, cached_input}`` per million tokens → nano-units per token."""
    if not isinstance(doc, dict):
        raise ConfigError(path, "must be a mapping {input, output, cached_input}")
    known(doc, _PRICE_KEYS, path)
    for required in ("input", "output"):
        if required not in doc:
            raise ConfigError(f"{path}.{required}", "is required (per million tokens)")

    def per_token(key: str) -> int:
        return nano(doc[key], f"{path}.{key}", per_million=True, minimum=0)

    cached = doc.get("cached_input")
    return PriceSpec(
        input=per_token("input"),
        output=per_token("output"),
        cached_input=None if cached is None else per_token("cached_input"),
    )


def timezone(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be an IANA time zone name, got {value!r}")
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(path, f"unknown time zone {value!r}") from None
    return value


def sliding(seconds: int, bucket_s: Any, path: str, *, default: bool = False) -> int:
    """A sliding window's bucket size, checked against its length."""
    if isinstance(bucket_s, bool) or not isinstance(bucket_s, int) or bucket_s < 1:
        raise ConfigError(path, f"must be an integer >= 1, got {bucket_s!r}")
    if seconds % bucket_s:
        what = f"the default {bucket_s} (seconds // 60)" if default else str(bucket_s)
        raise ConfigError(path, f"{what} does not divide the window's {seconds} s")
    if seconds // bucket_s > MAX_BUCKETS:
        raise ConfigError(
            path, f"{seconds} s in buckets of {bucket_s} s is more than {MAX_BUCKETS} buckets"
        )
    return bucket_s


def default_bucket(seconds: int) -> int:
    return max(1, seconds // 60)


def window(doc: Any, path: str, plan: PlanWindow) -> WindowSpec:
    """A rule's ``window``; unset fields come from the plan."""
    if doc is None:
        return plan.spec()
    if not isinstance(doc, dict):
        raise ConfigError(path, "must be a mapping {kind, seconds, bucket_s, period, timezone}")
    known(doc, _WINDOW_KEYS, path)
    kind = doc.get("kind", plan.kind)
    if kind not in ("fixed", "sliding", "calendar"):
        raise ConfigError(f"{path}.kind", f"must be one of fixed, sliding, calendar, got {kind!r}")
    allowed = {"fixed": {"kind", "seconds"}, "sliding": {"kind", "seconds", "bucket_s"}}.get(
        kind, {"kind", "period", "timezone"}
    )
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"does not apply to a {kind} window")
    if kind == "calendar":
        period = doc.get("period")
        if period not in PERIODS:
            raise ConfigError(f"{path}.period", f"must be one of day, week, month, got {period!r}")
        zone = timezone(doc.get("timezone", plan.timezone), f"{path}.timezone")
        return WindowSpec(kind="calendar", period=period, timezone=zone)
    seconds = doc.get("seconds", plan.seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise ConfigError(f"{path}.seconds", f"must be an integer >= 1, got {seconds!r}")
    if kind == "fixed":
        return WindowSpec(kind="fixed", seconds=seconds)
    if "bucket_s" in doc:
        bucket = sliding(seconds, doc["bucket_s"], f"{path}.bucket_s")
    elif seconds == plan.seconds and plan.kind == "sliding":
        bucket = plan.bucket_s
    else:
        bucket = sliding(seconds, default_bucket(seconds), f"{path}.bucket_s", default=True)
    return WindowSpec(kind="sliding", seconds=seconds, bucket_s=bucket)


def rule(doc: Any, path: str, plan: PlanWindow) -> Sourced:
    """One rule of the general form ``{metric, limit, window, shadow, name}``."""
    if not isinstance(doc, dict):
        raise ConfigError(path, "must be a mapping {metric, limit, window, shadow, name}")
    known(doc, _RULE_KEYS, path)
    metric = doc.get("metric")
    if metric not in METRICS:
        raise ConfigError(f"{path}.metric", f"must be one of {', '.join(METRICS)}, got {metric!r}")
    if "limit" not in doc:
        raise ConfigError(f"{path}.limit", "is required")
    limit = doc["limit"]
    amount = (
        cost_limit(limit, f"{path}.limit")
        if metric == "cost"
        else check_limit(limit, f"{path}.limit")
    )
    shadow = doc.get("shadow", False)
    if not isinstance(shadow, bool):
        raise ConfigError(f"{path}.shadow", "must be true or false")
    name = doc.get("name", "")
    if not isinstance(name, str):
        raise ConfigError(f"{path}.name", f"must be a string, got {name!r}")
    spec = window(doc.get("window"), f"{path}.window", plan)
    return Sourced(LimitRule(metric, amount, spec, shadow, name), path)


def rules(doc: Any, path: str, plan: PlanWindow) -> tuple[Sourced, ...]:
    if not isinstance(doc, list):
        raise ConfigError(path, "must be a list of {metric, limit, window, shadow, name}")
    return tuple(rule(r, f"{path}[{i}]", plan) for i, r in enumerate(doc))


def shadowed(entries: Iterable[Sourced]) -> tuple[Sourced, ...]:
    return tuple(replace(s, rule=replace(s.rule, shadow=True)) for s in entries)


def unit(metric: str) -> str:
    return _UNITS.get(metric, "tokens")


def check_duplicates(entries: Iterable[Sourced]) -> None:
    """Two rules counting the same metric over the same window, both enforced or both
    shadow: one of them can never bind, which is a mistake worth naming."""
    seen: dict[tuple[str, WindowSpec, bool], str] = {}
    for s in entries:
        key = (s.rule.metric, s.rule.window, s.rule.shadow)
        if key in seen:
            raise ConfigError(s.path, f"counts {s.rule.metric} over the same window as {seen[key]}")
        seen[key] = s.path


def check_cost(entries: Iterable[Sourced], models: Iterable[ModelSpec]) -> None:
    """A cost rule needs prices on every model it applies to."""
    unpriced = sorted(m.name for m in models if m.prices is None)
    if not unpriced:
        return
    for s in entries:
        if s.rule.metric == "cost":
            raise ConfigError(
                s.path, f"a cost limit applies to model {unpriced[0]}, which has no prices"
            )


def rule_order(r: LimitRule) -> tuple[Any, ...]:
    w = r.window
    return (
        METRICS.index(r.metric),
        ("fixed", "sliding", "calendar").index(w.kind),
        w.seconds,
        w.bucket_s,
        PERIODS.index(w.period) if w.period else -1,
        w.timezone,
        r.limit,
        r.shadow,
        r.name,
    )


def normal_window(w: WindowSpec) -> dict[str, Any]:
    if w.kind == "calendar":
        return {"kind": "calendar", "period": w.period, "timezone": w.timezone}
    if w.kind == "sliding":
        return {"kind": "sliding", "seconds": w.seconds, "bucket_s": w.bucket_s}
    return {"kind": "fixed", "seconds": w.seconds}


def normal_rule(r: LimitRule) -> dict[str, Any]:
    return {
        "metric": r.metric,
        "limit": r.limit,
        "unit": unit(r.metric),
        "window": normal_window(r.window),
        "shadow": r.shadow,
        "name": r.name,
    }
