"""The envoyproxy/ratelimit (RLS) configuration format as a source of limits.

An RLS document (``domain`` + ``descriptors``) is read as the tree tenant → (plan →) model →
metric. Its meaning here:

* root ``key: tenant`` without a value applies to every tenant: metric and model descriptors
  directly under it are limits of every plan, ``key: plan, value: <name>`` holds the limits
  of one plan (layered over the every-plan ones);
* root ``key: tenant, value: <id>`` is that tenant's own subtree, layered over its plan's;
* ``key: model`` with a value (a configured model or alias: its quota model) or without
  (``"*"``); a metric descriptor with no model descriptor above it means ``"*"``;
* ``key: metric, value: rpm|tpm|itpm|otpm|cost`` with ``rate_limit`` is one limit.

Layering (``limits.layer_over``): a more specific scope's limits of one model and metric take
the place of the inherited ones of that metric (``unlimited: true`` takes them away), and
``replaces`` drops inherited limits by ``name``. Anything the tree cannot mean is an error
naming the descriptor by its path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.config.limits import Layer, Sourced, check_limit, cost_limit
from extproc.config.schema import ConfigError, LimitRule, Metric, ModelSpec, WindowSpec
from extproc.config.values import known

_ROOT_KEYS = {"domain", "descriptors"}
_DESCRIPTOR_KEYS = {"key", "value", "rate_limit", "descriptors", "shadow_mode"}
_RATE_LIMIT_KEYS = {"unit", "requests_per_unit", "unlimited", "name", "replaces"}
METRICS: dict[str, Metric] = {
    "rpm": "requests",
    "tpm": "tokens",
    "itpm": "input_tokens",
    "otpm": "output_tokens",
    "cost": "cost",
}
# RLS's own day is epoch-aligned, which is the UTC day; its week (from Thursday) and its
# 30-day month are not calendar periods: here they are the calendar week and month in UTC.
UNITS: dict[str, WindowSpec] = {
    "second": WindowSpec(kind="fixed", seconds=1),
    "minute": WindowSpec(kind="fixed", seconds=60),
    "hour": WindowSpec(kind="fixed", seconds=3600),
    "day": WindowSpec(kind="calendar", period="day"),
    "week": WindowSpec(kind="calendar", period="week"),
    "month": WindowSpec(kind="calendar", period="month"),
}


@dataclass
class RlsLimits:
    """An RLS document's limits, by scope."""

    every_plan: dict[str, Layer] = field(default_factory=dict)
    every_plan_path: str = ""  # the root descriptor holding them
    plans: dict[str, dict[str, Layer]] = field(default_factory=dict)
    plan_paths: dict[str, str] = field(default_factory=dict)
    tenants: dict[str, dict[str, Layer]] = field(default_factory=dict)
    tenant_paths: dict[str, str] = field(default_factory=dict)
    # Every ``replaces`` entry as (name, descriptor): checked once all names are known.
    replaces: list[tuple[str, str]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)


def read_file(where: Path) -> Any:
    try:
        text = where.read_text()
    except OSError as exc:
        raise ConfigError("ratelimit_file", f"cannot read {where}: {exc.strerror}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("ratelimit_file", f"invalid YAML in {where}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Node:
    doc: dict[str, Any]
    path: str  # ratelimit.descriptors[0].descriptors[1]
    key: str
    value: str | None

    @property
    def label(self) -> str:
        shown = f"key={self.key}" if self.value is None else f"key={self.key}, value={self.value}"
        return f"{self.path} ({shown})"

    def error(self, message: str) -> ConfigError:
        return ConfigError(self.label, message)

    def children(self) -> list[_Node]:
        return _nodes(self.doc.get("descriptors"), self.path, self.label)


def _nodes(docs: Any, parent: str, label: str) -> list[_Node]:
    if docs is None:
        return []
    if not isinstance(docs, list):
        raise ConfigError(f"{label}.descriptors", "must be a list of descriptors")
    out = []
    for i, doc in enumerate(docs):
        path = f"{parent}.descriptors[{i}]"
        if not isinstance(doc, dict):
            raise ConfigError(path, f"must be a descriptor mapping, got {type(doc).__name__}")
        key, value = doc.get("key"), doc.get("value")
        if not isinstance(key, str) or not key:
            raise ConfigError(path, f"needs a key, got {key!r}")
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{path} (key={key})", f"value must be a string, got {value!r}")
        node = _Node(doc, path, key, value)
        for k in doc:
            if k not in _DESCRIPTOR_KEYS:
                raise node.error(f"unknown or unsupported field {k!r}")
        if "rate_limit" in doc and key != "metric":
            raise node.error("only a metric descriptor (key=metric) can hold a rate_limit")
        if "shadow_mode" in doc and key != "metric":
            raise node.error("shadow_mode belongs on a metric descriptor (key=metric)")
        out.append(node)
    return out


def _unique(nodes: list[_Node]) -> None:
    seen: dict[tuple[str, str | None], _Node] = {}
    for node in nodes:
        if (node.key, node.value) in seen:
            raise node.error(f"the same descriptor as {seen[node.key, node.value].path}")
        seen[node.key, node.value] = node


class _Parser:
    def __init__(self, prefix: str, model_index: dict[str, ModelSpec]) -> None:
        self.prefix = prefix
        self.model_index = model_index
        self.out = RlsLimits()

    def document(self, doc: Any) -> RlsLimits:
        if not isinstance(doc, dict):
            raise ConfigError(self.prefix, "must be a mapping {domain, descriptors}")
        known(doc, _ROOT_KEYS, self.prefix)
        domain = doc.get("domain")
        if not isinstance(domain, str) or not domain:
            raise ConfigError(
                f"{self.prefix}.domain", f"must be a non-empty string, got {domain!r}"
            )
        roots = _nodes(doc.get("descriptors"), self.prefix, self.prefix)
        if not roots:
            raise ConfigError(f"{self.prefix}.descriptors", "must list at least one descriptor")
        _unique(roots)
        for node in roots:
            if node.key != "tenant":
                raise node.error("a root descriptor must be key: tenant")
            children = node.children()
            if not children:
                raise node.error("needs model or metric descriptors under it")
            if node.value is None:
                self.out.every_plan = self.models(node, children, plans_allowed=True)
                self.out.every_plan_path = node.label
            else:
                self.out.tenants[node.value] = self.models(node, children, plans_allowed=False)
                self.out.tenant_paths[node.value] = node.label
        return self.out

    def models(
        self, parent: _Node, children: list[_Node], *, plans_allowed: bool
    ) -> dict[str, Layer]:
        """The layers of one scope (every plan, one plan, one tenant), by model key."""
        _unique(children)
        layers: dict[str, Layer] = {}
        sources: dict[str, _Node] = {}
        direct = [n for n in children if n.key == "metric"]
        for node in children:
            if node.key == "plan" and plans_allowed:
                if node.value is None:
                    raise node.error("a plan descriptor needs the plan's name as its value")
                grandchildren = node.children()
                if not grandchildren:
                    raise node.error("needs model or metric descriptors under it")
                self.out.plans[node.value] = self.models(node, grandchildren, plans_allowed=False)
                self.out.plan_paths[node.value] = node.label
            elif node.key == "model":
                key = self.model_key(node)
                if key in sources:
                    raise node.error(f"model {key!r} is also defined by {sources[key].label}")
                metrics = node.children()
                for child in metrics:
                    if child.key != "metric":
                        raise child.error("under a model descriptor only key: metric can follow")
                layers[key] = self.layer(metrics)
                sources[key] = node
            elif node.key == "metric":
                continue  # every model: gathered below
            elif node.key == "plan":
                raise node.error(
                    "a plan descriptor belongs directly under the root key: tenant without a "
                    "value (a tenant has one plan: its own subtree holds its own limits)"
                )
            else:
                raise node.error(
                    f"{parent.key} → {node.key} cannot be expressed: the tree is "
                    "tenant → (plan →) model → metric"
                )
        if direct:
            if "*" in sources:
                raise direct[0].error(
                    f"a metric here means every model, which {sources['*'].label} defines"
                )
            layers["*"] = self.layer(direct)
        return layers

    def model_key(self, node: _Node) -> str:
        if node.value is None:
            return "*"
        spec = self.model_index.get(node.value)
        if spec is None:
            raise node.error(f"{node.value!r} is not a configured model or alias")
        return spec.name

    def layer(self, metrics: list[_Node]) -> Layer:
        _unique(metrics)
        rules: list[Sourced] = []
        defined: set[str] = set()
        replaces: set[str] = set()
        for node in metrics:
            metric, sourced, names = self.metric(node)
            defined.add(metric)
            replaces |= names
            if sourced is not None:
                rules.append(sourced)
        return Layer(tuple(rules), frozenset(defined), frozenset(replaces))

    def metric(self, node: _Node) -> tuple[Metric, Sourced | None, set[str]]:
        if node.value not in METRICS:
            raise node.error(f"a metric descriptor's value must be one of {', '.join(METRICS)}")
        if "descriptors" in node.doc:
            raise node.error("a metric descriptor is a leaf: nothing can follow it")
        metric = METRICS[node.value]
        doc = node.doc.get("rate_limit")
        if not isinstance(doc, dict):
            raise node.error("needs a rate_limit {unit, requests_per_unit} or {unlimited: true}")
        for k in doc:
            if k not in _RATE_LIMIT_KEYS:
                raise node.error(f"rate_limit: unknown field {k!r}")
        shadow = node.doc.get("shadow_mode", False)
        if not isinstance(shadow, bool):
            raise node.error("shadow_mode must be true or false")
        name = doc.get("name", "")
        if not isinstance(name, str):
            raise node.error(f"rate_limit.name must be a string, got {name!r}")
        names = self.replaces(node, doc.get("replaces"), name)
        unlimited = doc.get("unlimited", False)
        if not isinstance(unlimited, bool):
            raise node.error("rate_limit.unlimited must be true or false")
        if unlimited:
            for k in ("unit", "requests_per_unit", "name"):
                if k in doc:
                    raise node.error(f"rate_limit.{k} means nothing with unlimited: true")
            if shadow:
                raise node.error("shadow_mode means nothing with unlimited: true")
            return metric, None, names
        unit = doc.get("unit")
        spec = UNITS.get(unit.lower()) if isinstance(unit, str) else None
        if spec is None:
            raise node.error(f"rate_limit.unit must be one of {', '.join(UNITS)}, got {unit!r}")
        if "requests_per_unit" not in doc:
            raise node.error("rate_limit.requests_per_unit is required")
        amount = doc["requests_per_unit"]
        try:
            limit = (cost_limit if metric == "cost" else check_limit)(
                amount, "rate_limit.requests_per_unit"
            )
        except ConfigError as exc:
            raise node.error(str(exc)) from None
        if name:
            self.out.names.add(name)
        return metric, Sourced(LimitRule(metric, limit, spec, shadow, name), node.label), names

    def replaces(self, node: _Node, doc: Any, name: str) -> set[str]:
        if doc is None:
            return set()
        if not isinstance(doc, list):
            raise node.error("rate_limit.replaces must be a list of {name}")
        names = set()
        for i, entry in enumerate(doc):
            target = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or set(entry) != {"name"} or not target:
                raise node.error(f"rate_limit.replaces[{i}] must be {{name: <a limit's name>}}")
            if not isinstance(target, str):
                raise node.error(f"rate_limit.replaces[{i}].name must be a string")
            if target == name:
                raise node.error(f"rate_limit.replaces[{i}] names this limit itself")
            names.add(target)
            self.out.replaces.append((target, node.label))
        return names


def parse_ratelimit(doc: Any, prefix: str, model_index: dict[str, ModelSpec]) -> RlsLimits:
    """Validate an RLS document; errors name descriptors under ``prefix``."""
    return _Parser(prefix, model_index).document(doc)
