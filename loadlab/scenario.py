"""Scenario files: what a benchmark run starts and sends, validated key by key.

A scenario is a YAML mapping (see ``benchmarks/scenarios/``); command-line flags override
its keys. Every mistake is a ``ScenarioError`` naming the key (``load.levels``), which the
CLI prints on one line with exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.config.limits import MAX_BUCKETS

ROUTES = ("direct", "envoy", "noop", "processor")
CHARGE_MODES = ("incremental", "reserve_max")
LOAD_MODES = ("closed", "rate")
WINDOWS = ("fixed", "sliding")
DISTRIBUTIONS = ("fixed", "uniform", "normal")
APIS = ("chat", "completions")
TARGET_SCHEMES = ("http://", "https://")
# Targets interleaved when a scenario has several and says nothing: rounds per level.
DEFAULT_TARGET_ROUNDS = 4


class ScenarioError(ValueError):
    """A scenario value that can't be used; ``key`` is its dotted path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class Lengths:
    """A token-count distribution: fixed, uniform over [low, high], or normal (clipped ≥ 1)."""

    dist: str = "fixed"
    value: int = 100
    low: int = 0
    high: int = 0
    mean: float = 0.0
    std: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        if self.dist == "normal":
            return max(1, round(rng.gauss(self.mean, self.std)))
        return self.value

    def to_doc(self) -> Any:
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return {"dist": "uniform", "min": self.low, "max": self.high}
        return {"dist": "normal", "mean": self.mean, "std": self.std}


@dataclass(frozen=True)
class Variant:
    """One processor configuration the ``processor`` route is run with."""

    charge_mode: str = "incremental"
    batch_tokens: int = 32
    window: str = "fixed"  # the budget's window kind

    @property
    def name(self) -> str:
        # Fixed is the default and goes unnamed: route names of earlier results still match.
        kind = "" if self.window == "fixed" else f"/{self.window}"
        return f"processor/{self.charge_mode}/b{self.batch_tokens}{kind}"


@dataclass(frozen=True)
class Budget:
    """A TPM budget on the processor routes' tenant: the quota-accuracy figures. Each window
    kind in ``windows`` is a processor variant of its own; ``bucket_s`` (None: the
    processor's default, window_s // 60) is the sliding windows' bucket."""

    tpm: int
    window_s: int = 60
    windows: tuple[str, ...] = ("fixed",)
    bucket_s: int | None = None

    @property
    def bucket(self) -> int:
        return self.bucket_s if self.bucket_s is not None else max(1, self.window_s // 60)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "tpm": self.tpm, "window_s": self.window_s, "window": list(self.windows),
        }  # fmt: skip
        if "sliding" in self.windows:
            doc["bucket_s"] = self.bucket
        return doc


@dataclass(frozen=True)
class Ceiling:
    """Levels rise until ``route`` saturates: its e2el p99 over ``baseline``'s passes
    ``e2el_p99_ratio``, its processor's CPU share passes ``cpu_share`` of a core, or a
    request fails. A level that trips is run once more; it stops the search if it trips again
    (a burst of other load on a shared machine doesn't end it)."""

    route: str = "processor"
    baseline: str = "envoy"
    e2el_p99_ratio: float = 1.1
    cpu_share: float = 0.9


@dataclass(frozen=True)
class Target:
    """An already running OpenAI-compatible endpoint (this gateway, vLLM, a LiteLLM proxy,
    a hosted API): measured from the client side only. ``name`` is its route in the
    results; ``model`` None takes the scenario's."""

    url: str
    name: str = "target"
    api_key: str | None = None
    model: str | None = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "url": self.url}
        if self.model is not None:
            doc["model"] = self.model
        return doc  # never the API key


@dataclass(frozen=True)
class Scenario:
    name: str = "bench"
    description: str = ""
    seed: int = 1
    # Simulator
    profile: str = "fast.yaml"
    itl_ms: float = 10.0
    itl_std_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_chunk: int = 1
    # Routes and processor
    routes: tuple[str, ...] = ROUTES
    charge_modes: tuple[str, ...] = ("incremental",)
    batch_tokens: tuple[int, ...] = (32,)
    budget: Budget | None = None
    # The processor admits from blocks held in process (its ``admission_leases``)
    admission_leases: bool = False
    # Load
    mode: str = "closed"
    levels: tuple[float, ...] = (1, 10, 50)
    requests: int | None = 10
    rounds: int = 3
    duration_s: float | None = None
    max_concurrency: int = 1000
    prompt_tokens: Lengths = field(default_factory=lambda: Lengths("fixed", 20))
    output_tokens: Lengths = field(default_factory=lambda: Lengths("fixed", 100))
    warmup_requests: int = 4
    timeout_s: float = 60.0
    ceiling: Ceiling | None = None
    # The request: chat or completions; ignore_eos asks for exactly max_tokens tokens
    api: str = "chat"
    ignore_eos: bool = True
    # Each level in this many rounds, the routes in turn (forward, then backward: ABBA…)
    # so a drift of the machine's load or of a shared backend hits every route alike;
    # None: 1, or DEFAULT_TARGET_ROUNDS with several targets.
    interleave: int | None = None
    # --target: already running endpoints, client-side figures only
    targets: tuple[Target, ...] = ()
    model: str = "gpt-4.1"

    @property
    def rounds_per_level(self) -> int:
        if self.interleave is not None:
            return self.interleave
        return DEFAULT_TARGET_ROUNDS if len(self.targets) > 1 else 1

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    @property
    def variants(self) -> tuple[Variant, ...]:
        windows = self.budget.windows if self.budget is not None else ("fixed",)
        return tuple(
            Variant(c, b, w) for w in windows for c in self.charge_modes for b in self.batch_tokens
        )

    def variant_of(self, route: str) -> Variant | None:
        """The processor variant a route of the results runs (None: not a processor route)."""
        return next((v for v in self.variants if self.variant_route(v) == route), None)

    @property
    def route_names(self) -> tuple[str, ...]:
        """Every route as it appears in the results (``processor`` once per variant)."""
        if self.targets:
            return tuple(t.name for t in self.targets)
        out: list[str] = []
        for route in self.routes:
            out += (
                [self.variant_route(v) for v in self.variants] if route == "processor" else [route]
            )
        return tuple(out)

    def variant_route(self, variant: Variant) -> str:
        """``processor`` when it runs with one configuration, else one name per variant."""
        return "processor" if len(self.variants) == 1 else variant.name

    def phase_requests(self, level: float) -> int | None:
        """Requests per route at ``level`` (None: the phase runs for ``duration_s``)."""
        if self.duration_s is not None:
            return None
        assert self.requests is not None
        if self.mode == "closed":
            return max(self.requests, self.rounds * int(level))
        return max(self.requests, math.ceil(self.rounds * level))

    def to_doc(self) -> dict[str, Any]:
        """The scenario as a file would say it (``scenario.yaml`` in the results)."""
        doc: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "simulator": {
                "profile": self.profile,
                "itl_ms": self.itl_ms,
                "itl_std_ms": self.itl_std_ms,
                "ttft_ms": self.ttft_ms,
                "tokens_per_chunk": self.tokens_per_chunk,
            },
            "routes": list(self.routes),
            "processor": {
                "charge_modes": list(self.charge_modes),
                "batch_tokens": list(self.batch_tokens),
                "budget": None if self.budget is None else self.budget.to_doc(),
                "admission_leases": self.admission_leases,
            },
            "load": {
                "mode": self.mode,
                "levels": [_number(x) for x in self.levels],
                "requests": self.requests,
                "rounds": self.rounds,
                "duration_s": self.duration_s,
                "max_concurrency": self.max_concurrency,
                "prompt_tokens": self.prompt_tokens.to_doc(),
                "output_tokens": self.output_tokens.to_doc(),
                "warmup_requests": self.warmup_requests,
                "timeout_s": self.timeout_s,
                "ceiling": None if self.ceiling is None else dataclasses.asdict(self.ceiling),
                "api": self.api,
                "ignore_eos": self.ignore_eos,
                "interleave": self.rounds_per_level,
            },
        }
        if self.targets:
            doc["targets"] = [t.to_doc() for t in self.targets]
            doc["model"] = self.model
        return doc


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


# --- parsing --------------------------------------------------------------------------------


def _mapping(value: object, key: str, allowed: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ScenarioError(key, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ScenarioError(
            f"{key}.{unknown[0]}" if key else unknown[0],
            f"unknown key (known: {', '.join(sorted(allowed))})",
        )
    return dict(value)


def _int(value: object, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ScenarioError(key, f"must be at least {minimum}, got {value}")
    return value


def _float(value: object, key: str, minimum: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(key, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (positive and value <= 0):
        bound = "greater than 0" if positive else f"at least {minimum:g}"
        raise ScenarioError(key, f"must be {bound}, got {value:g}")
    return value


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(key, f"must be true or false, got {value!r}")
    return value


def _str(value: object, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(key, f"must be a non-empty string, got {value!r}")
    return value


def _choice(value: object, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScenarioError(key, f"must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _list(value: object, key: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if not value:
            raise ScenarioError(key, "must not be empty")
        return list(value)
    return [value]  # one value stands for a list of one


def _lengths(value: object, key: str) -> Lengths:
    if isinstance(value, int) and not isinstance(value, bool):
        return Lengths("fixed", _int(value, key, 1))
    doc = _mapping(value, key, {"dist", "value", "min", "max", "mean", "std"})
    dist = _choice(doc.get("dist", "fixed"), f"{key}.dist", DISTRIBUTIONS)
    if dist == "fixed":
        return Lengths("fixed", _int(doc.get("value"), f"{key}.value", 1))
    if dist == "uniform":
        low = _int(doc.get("min"), f"{key}.min", 1)
        high = _int(doc.get("max"), f"{key}.max", 1)
        if high < low:
            raise ScenarioError(f"{key}.max", f"must be at least min ({low}), got {high}")
        return Lengths("uniform", low=low, high=high)
    mean = _float(doc.get("mean"), f"{key}.mean", positive=True)
    std = _float(doc.get("std", 0.0), f"{key}.std")
    return Lengths("normal", mean=mean, std=std)


def _budget(value: object) -> Budget:
    key = "processor.budget"
    budget = _mapping(value, key, {"tpm", "window_s", "window", "bucket_s"})
    if "tpm" not in budget:
        raise ScenarioError(f"{key}.tpm", "is required with a budget")
    window_s = _int(budget.get("window_s", 60), f"{key}.window_s", 1)
    windows = tuple(
        dict.fromkeys(
            _choice(w, f"{key}.window", WINDOWS)
            for w in _list(budget.get("window", "fixed"), f"{key}.window")
        )
    )
    bucket_s = budget.get("bucket_s")
    if bucket_s is not None:
        if "sliding" not in windows:
            raise ScenarioError(f"{key}.bucket_s", "only applies to window: sliding")
        bucket_s = _int(bucket_s, f"{key}.bucket_s", 1)
    out = Budget(_int(budget["tpm"], f"{key}.tpm", 1), window_s, windows, bucket_s)
    if "sliding" in windows:
        # The processor's own rules (extproc.config.limits.sliding), named here by our key.
        what = f"{out.bucket}" if bucket_s is not None else f"the default {out.bucket}"
        if window_s % out.bucket:
            raise ScenarioError(f"{key}.bucket_s", f"{what} does not divide window_s ({window_s})")
        if window_s // out.bucket > MAX_BUCKETS:
            raise ScenarioError(
                f"{key}.bucket_s",
                f"{window_s} s in buckets of {out.bucket} s is more than {MAX_BUCKETS} buckets",
            )
    return out


# ``run``: what a results folder's scenario.yaml adds (versions, machine); ignored, so that
# file can be run again as it is.
TOP_KEYS = {
    "name", "description", "seed", "simulator", "routes", "processor", "load", "target",
    "targets", "model", "run",
}  # fmt: skip


def parse_scenario(doc: object, base: Scenario | None = None) -> Scenario:
    """A validated scenario from a YAML document (keys not given keep ``base``'s values)."""
    s = base or Scenario()
    top = _mapping(doc, "", TOP_KEYS)
    changes: dict[str, Any] = {}
    if "name" in top:
        changes["name"] = _str(top["name"], "name")
    if "description" in top:
        changes["description"] = str(top["description"] or "")
    if "seed" in top:
        changes["seed"] = _int(top["seed"], "seed")
    sim = _mapping(
        top.get("simulator"),
        "simulator",
        {"profile", "itl_ms", "itl_std_ms", "ttft_ms", "tokens_per_chunk"},
    )
    if "profile" in sim:
        changes["profile"] = _str(sim["profile"], "simulator.profile")
    for name in ("itl_ms", "itl_std_ms", "ttft_ms"):
        if name in sim:
            changes[name] = _float(sim[name], f"simulator.{name}")
    if "tokens_per_chunk" in sim:
        changes["tokens_per_chunk"] = _int(sim["tokens_per_chunk"], "simulator.tokens_per_chunk", 1)
    if "routes" in top:
        routes = [_choice(r, "routes", ROUTES) for r in _list(top["routes"], "routes")]
        if len(set(routes)) != len(routes):
            raise ScenarioError("routes", f"lists a route twice: {routes}")
        changes["routes"] = tuple(routes)
    proc = _mapping(
        top.get("processor"),
        "processor",
        {"charge_modes", "batch_tokens", "budget", "admission_leases"},
    )
    if "charge_modes" in proc:
        changes["charge_modes"] = tuple(
            dict.fromkeys(
                _choice(c, "processor.charge_modes", CHARGE_MODES)
                for c in _list(proc["charge_modes"], "processor.charge_modes")
            )
        )
    if "batch_tokens" in proc:
        changes["batch_tokens"] = tuple(
            dict.fromkeys(
                _int(b, "processor.batch_tokens", 1)
                for b in _list(proc["batch_tokens"], "processor.batch_tokens")
            )
        )
    if "admission_leases" in proc:
        changes["admission_leases"] = _bool(proc["admission_leases"], "processor.admission_leases")
    if "budget" in proc:
        if proc["budget"] is None:
            changes["budget"] = None
        else:
            changes["budget"] = _budget(proc["budget"])
    load = _mapping(
        top.get("load"),
        "load",
        {
            "mode", "levels", "requests", "rounds", "duration_s", "max_concurrency",
            "prompt_tokens", "output_tokens", "warmup_requests", "timeout_s", "ceiling",
            "api", "ignore_eos", "interleave",
        },
    )  # fmt: skip
    if "api" in load:
        changes["api"] = _choice(load["api"], "load.api", APIS)
    if "ignore_eos" in load:
        changes["ignore_eos"] = _bool(load["ignore_eos"], "load.ignore_eos")
    if "interleave" in load:
        changes["interleave"] = (
            None if load["interleave"] is None else _int(load["interleave"], "load.interleave", 1)
        )
    if "mode" in load:
        changes["mode"] = _choice(load["mode"], "load.mode", LOAD_MODES)
    if "levels" in load:
        changes["levels"] = tuple(
            _number(_float(x, "load.levels", positive=True))
            for x in _list(load["levels"], "load.levels")
        )
    if "requests" in load:
        changes["requests"] = (
            None if load["requests"] is None else _int(load["requests"], "load.requests", 1)
        )
    if "rounds" in load:
        changes["rounds"] = _int(load["rounds"], "load.rounds", 0)
    if "duration_s" in load:
        changes["duration_s"] = (
            None
            if load["duration_s"] is None
            else _float(load["duration_s"], "load.duration_s", positive=True)
        )
    # One of the two bounds a phase: giving one replaces the other.
    if "duration_s" in load and "requests" not in load:
        changes["requests"] = None
    if "requests" in load and "duration_s" not in load:
        changes["duration_s"] = None
    if "max_concurrency" in load:
        changes["max_concurrency"] = _int(load["max_concurrency"], "load.max_concurrency", 1)
    for name in ("prompt_tokens", "output_tokens"):
        if name in load:
            changes[name] = _lengths(load[name], f"load.{name}")
    if "warmup_requests" in load:
        changes["warmup_requests"] = _int(load["warmup_requests"], "load.warmup_requests")
    if "timeout_s" in load:
        changes["timeout_s"] = _float(load["timeout_s"], "load.timeout_s", positive=True)
    if "ceiling" in load:
        if load["ceiling"] is None:
            changes["ceiling"] = None
        else:
            c = _mapping(
                load["ceiling"],
                "load.ceiling",
                {"route", "baseline", "e2el_p99_ratio", "cpu_share"},
            )
            default = Ceiling()
            changes["ceiling"] = Ceiling(
                _choice(c.get("route", default.route), "load.ceiling.route", ROUTES),
                _choice(c.get("baseline", default.baseline), "load.ceiling.baseline", ROUTES),
                _float(
                    c.get("e2el_p99_ratio", default.e2el_p99_ratio),
                    "load.ceiling.e2el_p99_ratio",
                    positive=True,
                ),
                _float(
                    c.get("cpu_share", default.cpu_share), "load.ceiling.cpu_share", positive=True
                ),
            )
    if "model" in top:
        changes["model"] = _str(top["model"], "model")
    if "target" in top and "targets" in top:
        raise ScenarioError("targets", "give target (one) or targets (a list), not both")
    if "target" in top:
        if top["target"] is None:
            changes["targets"] = ()
        else:
            target = _target(top["target"], "target")
            if target.model is not None:  # a lone target's model is the run's
                changes["model"] = target.model
                target = dataclasses.replace(target, model=None)
            changes["targets"] = _named([target])
    if "targets" in top:
        items = [] if top["targets"] is None else _list(top["targets"], "targets")
        targets = [_target(t, f"targets[{i}]") for i, t in enumerate(items)]
        changes["targets"] = _named(targets)
    return check(dataclasses.replace(s, **changes))


def _target(value: object, key: str) -> Target:
    doc = _mapping(value, key, {"name", "url", "model", "api_key"})
    if "url" not in doc:
        raise ScenarioError(f"{key}.url", "is required")
    return Target(
        url=_str(doc["url"], f"{key}.url"),
        name=_str(doc["name"], f"{key}.name") if "name" in doc else "",
        api_key=_str(doc["api_key"], f"{key}.api_key") if doc.get("api_key") is not None else None,
        model=_str(doc["model"], f"{key}.model") if doc.get("model") is not None else None,
    )


def _named(targets: list[Target]) -> tuple[Target, ...]:
    """Every target with a route name of its own: the one given, else ``target`` for a lone
    one, else its host:port."""
    out: list[Target] = []
    for t in targets:
        name = t.name or ("target" if len(targets) == 1 else t.url.split("://", 1)[-1])
        out.append(dataclasses.replace(t, name=name.rstrip("/")))
    names = [t.name for t in out]
    for name in names:
        if names.count(name) > 1:
            raise ScenarioError("targets", f"two targets are named {name!r}: name them (NAME=URL)")
    return tuple(out)


def check(s: Scenario) -> Scenario:
    """The rules between keys, after flags were applied too."""
    if s.mode == "closed":
        for level in s.levels:
            if not float(level).is_integer():
                raise ScenarioError("load.levels", f"closed-loop levels are stream counts: {level}")
            if level > s.max_concurrency:
                raise ScenarioError(
                    "load.levels", f"{level:g} is above load.max_concurrency ({s.max_concurrency})"
                )
    if s.requests is None and s.duration_s is None:
        raise ScenarioError("load.requests", "give load.requests or load.duration_s")
    if s.requests is not None and s.duration_s is not None:
        raise ScenarioError("load.duration_s", "give load.requests or load.duration_s, not both")
    if s.itl_std_ms > 0.3 * s.itl_ms + 1e-12:
        raise ScenarioError("simulator.itl_std_ms", "cannot be more than 30% of itl_ms")
    if s.budget is not None and s.targets:
        raise ScenarioError("processor.budget", "not with a target: its budgets are its own")
    if s.budget is not None and s.rounds_per_level > 1:
        raise ScenarioError(
            "load.interleave", "not with a budget: each round would take from the same windows"
        )
    if s.ceiling is not None and s.targets:
        raise ScenarioError(
            "load.ceiling", "not with a target: it compares the routes started here"
        )
    if s.admission_leases and s.targets:
        raise ScenarioError(
            "processor.admission_leases", "not with a target: no processor is started here"
        )
    if s.budget is not None and "processor" not in s.routes:
        raise ScenarioError("processor.budget", "needs the processor route in routes")
    if s.ceiling is not None:
        for key, route in (("route", s.ceiling.route), ("baseline", s.ceiling.baseline)):
            if route not in s.routes:
                raise ScenarioError(f"load.ceiling.{key}", f"{route!r} is not in routes")
        if s.ceiling.route == s.ceiling.baseline:
            raise ScenarioError("load.ceiling.baseline", "must differ from load.ceiling.route")
        if len(s.variants) != 1:
            raise ScenarioError("load.ceiling", "needs one processor configuration")
        if list(s.levels) != sorted(s.levels):
            raise ScenarioError("load.levels", "must rise for a ceiling search")
    if not s.targets:
        from loadlab.simulator import profile_path

        try:
            profile_path(s.profile)
        except FileNotFoundError:
            raise ScenarioError(
                "simulator.profile", f"{s.profile!r} is neither in simulator_profiles/ nor a file"
            ) from None
    for i, t in enumerate(s.targets):
        key = "target.url" if len(s.targets) == 1 else f"targets[{i}].url"
        if not t.url.startswith(TARGET_SCHEMES):
            raise ScenarioError(key, f"must be an http:// or https:// URL, got {t.url!r}")
        if urlsplit(t.url).hostname is None:
            raise ScenarioError(key, f"has no host: {t.url!r}")
    return s


def read_yaml(path: Path) -> object:
    """A scenario file's document ({} when empty); a one-line ScenarioError otherwise."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError("scenario", f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ScenarioError("scenario", f"{path} is not valid YAML{line}") from exc
    return doc if doc is not None else {}


def load_scenario(path: Path) -> Scenario:
    return parse_scenario(read_yaml(path))
