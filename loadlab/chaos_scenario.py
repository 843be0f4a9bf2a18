"""Chaos scenario files: steady load, budgets that run out, simulator failures, client
misbehaviour and a timeline of infrastructure faults, validated key by key.

Every mistake is a ``ScenarioError`` naming its dotted key (``faults[2].at``); the CLI prints
it on one line and exits 2, as ``extproc bench`` does.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadlab.scenario import (
    CHARGE_MODES,
    Lengths,
    ScenarioError,
    _choice,
    _float,
    _int,
    _lengths,
    _list,
    _mapping,
    _str,
    read_yaml,
)

REDIS_MODES = ("single", "cluster")
# On a cluster only a master's SIGKILL: its replica takes over, the others keep serving.
CLUSTER_FAULTS = ("redis_kill",)
FAULTS = (
    "redis_pause",
    "redis_kill",
    "redis_restart",
    "processor_kill",
    "processor_term",
    "envoy_restart",
)
# The failure types llm-d-inference-sim knows (``failure-types``).
FAILURE_TYPES = (
    "rate_limit",
    "invalid_api_key",
    "context_length",
    "server_error",
    "invalid_request",
    "model_not_found",
)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class Fault:
    """One fault on the timeline: at ``at_s`` into the load, for ``for_s`` (the down time
    of a kill before the restart; 0: a kill stays down, a pause is required to last). A
    killed cluster master restarted after ``for_s`` rejoins as a replica of its successor."""

    at_s: float
    kind: str
    for_s: float = 0.0
    index: int = 0  # which processor (processor_kill / processor_term)
    worker: int | None = None  # which worker of a ``--workers`` processor (processor_kill)
    master: int | None = None  # which cluster master, by slot range order (redis_kill)
    # A worker kill waits (from ``at``, up to MIN_OPEN_WAIT_S) until the worker holds this
    # many admitted, unsettled streams: the kill leaves records to settle, by construction.
    min_open: int = 0
    # A processor kill waits likewise until its target holds this many admission blocks
    # (``processor.admission_leases``): the kill leaves blocks for a peer to charge.
    min_blocks: int = 0

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"at": f"{self.at_s:g}s", "fault": self.kind}
        if self.for_s:
            doc["for"] = f"{self.for_s:g}s"
        if self.kind.startswith("processor_"):
            doc["processor"] = self.index
        if self.worker is not None:
            doc["worker"] = self.worker
        if self.master is not None:
            doc["master"] = self.master
        if self.min_open:
            doc["min_open"] = self.min_open
        if self.min_blocks:
            doc["min_blocks"] = self.min_blocks
        return doc


@dataclass(frozen=True)
class Burst:
    at_s: float
    requests: int


@dataclass(frozen=True)
class ChaosScenario:
    name: str = "chaos"
    description: str = ""
    seed: int = 1
    duration_s: float = 20.0
    # Simulator: the real llm-d-inference-sim failure keys and llmsim's ext- chaos keys
    profile: str = "fast.yaml"
    itl_ms: float = 5.0
    ttft_ms: float = 0.0
    failure_injection_rate: float = 0.0
    failure_types: tuple[str, ...] = ("rate_limit", "server_error")
    disconnect_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 2.0
    malformed_rate: float = 0.0
    split_writes_rate: float = 0.0
    # Redis: one server, or a real Redis Cluster of ``masters`` masters with one replica each
    redis_mode: str = "single"
    masters: int = 3
    # Processors
    processors: int = 2
    workers: int = 1  # 1: ``extproc serve``; more: ``serve --workers N`` (a supervisor)
    charge_mode: str = "incremental"
    batch_tokens: int = 16
    tpm: int = 6000
    window_s: int = 5
    tenants: int = 2
    stream_idle_timeout_s: float = 1.0
    heartbeat_ttl_s: int = 2
    orphan_sweep_s: float = 0.5
    # The processors' ``admission_leases`` (0: off): a block holds this share of each limit
    admission_lease_fraction: float = 0.0
    admission_lease_idle_ms: int = 1000
    # Load: Poisson arrivals at ``rate`` per second, at most ``max_concurrency`` in flight
    rate: float = 10.0
    max_concurrency: int = 64
    prompt_tokens: Lengths = field(default_factory=lambda: Lengths("fixed", 20))
    output_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", low=40, high=120))
    timeout_s: float = 20.0
    # Clients
    client_disconnect_rate: float = 0.0  # % of streams the client hangs up on mid-stream
    retries: int = 0  # on 429 / 503 / a failed connect, with exponential backoff
    backoff_s: float = 0.2
    bursts: tuple[Burst, ...] = ()
    faults: tuple[Fault, ...] = ()

    @property
    def spans(self) -> list[tuple[float, float, str]]:
        return [(f.at_s, f.at_s + f.for_s, f.kind) for f in self.faults]

    def to_doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "duration_s": self.duration_s,
            "simulator": {
                "profile": self.profile,
                "itl_ms": self.itl_ms,
                "ttft_ms": self.ttft_ms,
                "failure_injection_rate": self.failure_injection_rate,
                "failure_types": list(self.failure_types),
                "disconnect_rate": self.disconnect_rate,
                "stall_rate": self.stall_rate,
                "stall_s": self.stall_s,
                "malformed_rate": self.malformed_rate,
                "split_writes_rate": self.split_writes_rate,
            },
            "redis": (
                {"mode": self.redis_mode, "masters": self.masters, "replicas": 1}
                if self.redis_mode == "cluster"
                else {"mode": self.redis_mode}
            ),
            "processor": {
                "count": self.processors,
                "workers": self.workers,
                "charge_mode": self.charge_mode,
                "batch_tokens": self.batch_tokens,
                "budget": {"tpm": self.tpm, "window_s": self.window_s},
                "tenants": self.tenants,
                "stream_idle_timeout_s": self.stream_idle_timeout_s,
                "heartbeat_ttl_s": self.heartbeat_ttl_s,
                "orphan_sweep_s": self.orphan_sweep_s,
                **(
                    {
                        "admission_leases": {
                            "fraction": self.admission_lease_fraction,
                            "idle_ms": self.admission_lease_idle_ms,
                        }
                    }
                    if self.admission_lease_fraction
                    else {}
                ),
            },
            "load": {
                "rate": self.rate,
                "max_concurrency": self.max_concurrency,
                "prompt_tokens": self.prompt_tokens.to_doc(),
                "output_tokens": self.output_tokens.to_doc(),
                "timeout_s": self.timeout_s,
            },
            "clients": {
                "disconnect_rate": self.client_disconnect_rate,
                "retries": self.retries,
                "backoff_s": self.backoff_s,
                "bursts": [{"at": f"{b.at_s:g}s", "requests": b.requests} for b in self.bursts],
            },
            "faults": [f.to_doc() for f in self.faults],
        }


def _seconds(value: object, key: str) -> float:
    """``10s``, ``500ms``, or a plain number of seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _float(value, key)
    if isinstance(value, str) and (m := _DURATION.match(value)):
        number = float(m.group(1))
        return number / 1000 if m.group(2) == "ms" else number
    raise ScenarioError(key, f"must be a duration such as 10s or 500ms, got {value!r}")


def _rate(value: object, key: str) -> float:
    rate = _float(value, key)
    if rate > 100:
        raise ScenarioError(key, f"is a percentage (0-100), got {rate:g}")
    return rate


TOP_KEYS = {
    "name",
    "description",
    "seed",
    "duration_s",
    "simulator",
    "redis",
    "processor",
    "load",
    "clients",
    "faults",
    "run",
}


def parse_chaos(doc: object) -> ChaosScenario:
    s = ChaosScenario()
    top = _mapping(doc, "", TOP_KEYS)
    c: dict[str, Any] = {}
    if "name" in top:
        c["name"] = _str(top["name"], "name")
    if "description" in top:
        c["description"] = str(top["description"] or "")
    if "seed" in top:
        c["seed"] = _int(top["seed"], "seed")
    if "duration_s" in top:
        c["duration_s"] = _float(top["duration_s"], "duration_s", positive=True)
    sim = _mapping(
        top.get("simulator"),
        "simulator",
        {
            "profile",
            "itl_ms",
            "ttft_ms",
            "failure_injection_rate",
            "failure_types",
            "disconnect_rate",
            "stall_rate",
            "stall_s",
            "malformed_rate",
            "split_writes_rate",
        },
    )
    if "profile" in sim:
        c["profile"] = _str(sim["profile"], "simulator.profile")
    for name in ("itl_ms", "ttft_ms"):
        if name in sim:
            c[name] = _float(sim[name], f"simulator.{name}")
    for name in (
        "failure_injection_rate",
        "disconnect_rate",
        "stall_rate",
        "malformed_rate",
        "split_writes_rate",
    ):
        if name in sim:
            c[name] = _rate(sim[name], f"simulator.{name}")
    if "stall_s" in sim:
        c["stall_s"] = _seconds(sim["stall_s"], "simulator.stall_s")
    if "failure_types" in sim:
        c["failure_types"] = tuple(
            _choice(t, "simulator.failure_types", FAILURE_TYPES)
            for t in _list(sim["failure_types"], "simulator.failure_types")
        )
    red = _mapping(top.get("redis"), "redis", {"mode", "masters", "replicas"})
    if "mode" in red:
        c["redis_mode"] = _choice(red["mode"], "redis.mode", REDIS_MODES)
    if "masters" in red:
        c["masters"] = _int(red["masters"], "redis.masters", 3)
    if "replicas" in red and _int(red["replicas"], "redis.replicas") != 1:
        raise ScenarioError("redis.replicas", "must be 1: one replica per master takes over")
    if ("masters" in red or "replicas" in red) and c.get("redis_mode") != "cluster":
        raise ScenarioError("redis.masters", "only with mode: cluster")
    proc = _mapping(
        top.get("processor"),
        "processor",
        {
            "count",
            "workers",
            "charge_mode",
            "batch_tokens",
            "budget",
            "tenants",
            "stream_idle_timeout_s",
            "heartbeat_ttl_s",
            "orphan_sweep_s",
            "admission_leases",
        },
    )
    if "count" in proc:
        c["processors"] = _int(proc["count"], "processor.count", 1)
    if "workers" in proc:
        c["workers"] = _int(proc["workers"], "processor.workers", 1)
    if "charge_mode" in proc:
        c["charge_mode"] = _choice(proc["charge_mode"], "processor.charge_mode", CHARGE_MODES)
    if "batch_tokens" in proc:
        c["batch_tokens"] = _int(proc["batch_tokens"], "processor.batch_tokens", 1)
    if "tenants" in proc:
        c["tenants"] = _int(proc["tenants"], "processor.tenants", 1)
    if "budget" in proc:
        budget = _mapping(proc["budget"], "processor.budget", {"tpm", "window_s"})
        if "tpm" in budget:
            c["tpm"] = _int(budget["tpm"], "processor.budget.tpm", 1)
        if "window_s" in budget:
            c["window_s"] = _int(budget["window_s"], "processor.budget.window_s", 1)
    if "stream_idle_timeout_s" in proc:
        c["stream_idle_timeout_s"] = _float(
            proc["stream_idle_timeout_s"], "processor.stream_idle_timeout_s", positive=True
        )
    if "heartbeat_ttl_s" in proc:
        c["heartbeat_ttl_s"] = _int(proc["heartbeat_ttl_s"], "processor.heartbeat_ttl_s", 1)
    if "orphan_sweep_s" in proc:
        c["orphan_sweep_s"] = _float(proc["orphan_sweep_s"], "processor.orphan_sweep_s", 0.1)
    if "admission_leases" in proc:
        key = "processor.admission_leases"
        leases = _mapping(proc["admission_leases"], key, {"fraction", "idle_ms"})
        fraction = _float(leases.get("fraction", 0.05), f"{key}.fraction", positive=True)
        if fraction > 0.25:
            raise ScenarioError(f"{key}.fraction", f"must be at most 0.25, got {fraction:g}")
        c["admission_lease_fraction"] = fraction
        c["admission_lease_idle_ms"] = _int(leases.get("idle_ms", 1000), f"{key}.idle_ms", 10)
    load = _mapping(
        top.get("load"),
        "load",
        {"rate", "max_concurrency", "prompt_tokens", "output_tokens", "timeout_s"},
    )
    if "rate" in load:
        c["rate"] = _float(load["rate"], "load.rate", positive=True)
    if "max_concurrency" in load:
        c["max_concurrency"] = _int(load["max_concurrency"], "load.max_concurrency", 1)
    for name in ("prompt_tokens", "output_tokens"):
        if name in load:
            c[name] = _lengths(load[name], f"load.{name}")
    if "timeout_s" in load:
        c["timeout_s"] = _float(load["timeout_s"], "load.timeout_s", positive=True)
    clients = _mapping(
        top.get("clients"), "clients", {"disconnect_rate", "retries", "backoff_s", "bursts"}
    )
    if "disconnect_rate" in clients:
        c["client_disconnect_rate"] = _rate(clients["disconnect_rate"], "clients.disconnect_rate")
    if "retries" in clients:
        c["retries"] = _int(clients["retries"], "clients.retries")
    if "backoff_s" in clients:
        c["backoff_s"] = _seconds(clients["backoff_s"], "clients.backoff_s")
    if "bursts" in clients:
        bursts = []
        for i, b in enumerate(clients["bursts"] or []):
            key = f"clients.bursts[{i}]"
            bd = _mapping(b, key, {"at", "requests"})
            if "at" not in bd or "requests" not in bd:
                raise ScenarioError(key, "needs at and requests")
            bursts.append(
                Burst(_seconds(bd["at"], f"{key}.at"), _int(bd["requests"], f"{key}.requests", 1))
            )
        c["bursts"] = tuple(bursts)
    if "faults" in top:
        c["faults"] = tuple(_fault(f, f"faults[{i}]") for i, f in enumerate(top["faults"] or []))
    return check_chaos(dataclasses.replace(s, **c))


def _fault(value: object, key: str) -> Fault:
    doc = _mapping(
        value,
        key,
        {"at", "fault", "for", "processor", "worker", "master", "min_open", "min_blocks"},
    )
    if "at" not in doc:
        raise ScenarioError(f"{key}.at", "is required")
    if "fault" not in doc:
        raise ScenarioError(f"{key}.fault", "is required")
    kind = _choice(doc["fault"], f"{key}.fault", FAULTS)
    for_s = _seconds(doc["for"], f"{key}.for") if "for" in doc else 0.0
    if kind == "redis_pause" and for_s <= 0:
        raise ScenarioError(f"{key}.for", "a redis_pause needs a duration")
    index = doc.get("processor", 0)
    if "processor" in doc and not kind.startswith("processor_"):
        raise ScenarioError(f"{key}.processor", f"only for processor faults, not {kind}")
    worker = master = None
    if "worker" in doc:
        if kind != "processor_kill":
            raise ScenarioError(f"{key}.worker", f"only for processor_kill, not {kind}")
        worker = _int(doc["worker"], f"{key}.worker")
        if for_s:
            raise ScenarioError(f"{key}.for", "a killed worker is replaced by its supervisor")
    min_open = 0
    if "min_open" in doc:
        if worker is None:
            raise ScenarioError(f"{key}.min_open", "only for a processor_kill with worker")
        min_open = _int(doc["min_open"], f"{key}.min_open", 1)
    min_blocks = 0
    if "min_blocks" in doc:
        if kind != "processor_kill":
            raise ScenarioError(f"{key}.min_blocks", f"only for processor_kill, not {kind}")
        min_blocks = _int(doc["min_blocks"], f"{key}.min_blocks", 1)
    if "master" in doc:
        if kind != "redis_kill":
            raise ScenarioError(f"{key}.master", f"only for redis_kill, not {kind}")
        master = _int(doc["master"], f"{key}.master")
    return Fault(
        _seconds(doc["at"], f"{key}.at"),
        kind,
        for_s,
        _int(index, f"{key}.processor"),
        worker,
        master,
        min_open,
        min_blocks,
    )


def check_chaos(s: ChaosScenario) -> ChaosScenario:
    from loadlab.simulator import profile_path

    try:
        profile_path(s.profile)
    except FileNotFoundError:
        raise ScenarioError(
            "simulator.profile", f"{s.profile!r} is neither in simulator_profiles/ nor a file"
        ) from None
    if _compat_profile(s.profile):
        for name in ("disconnect_rate", "stall_rate", "malformed_rate", "split_writes_rate"):
            if getattr(s, name):
                raise ScenarioError(
                    f"simulator.{name}",
                    f"is an llmsim extension; {s.profile} answers as the real "
                    "llm-d-inference-sim, which has none (only failure_injection_rate)",
                )
    if s.failure_injection_rate and not s.failure_types:
        raise ScenarioError("simulator.failure_types", "must not be empty with a failure rate")
    for i, f in enumerate(s.faults):
        if f.at_s >= s.duration_s:
            raise ScenarioError(
                f"faults[{i}].at", f"{f.at_s:g}s is not before duration_s ({s.duration_s:g}s)"
            )
        if f.kind.startswith("processor_") and f.index >= s.processors:
            raise ScenarioError(
                f"faults[{i}].processor", f"{f.index} is not below processor.count ({s.processors})"
            )
        if f.kind == "processor_kill" and f.worker is None and s.workers > 1:
            raise ScenarioError(
                f"faults[{i}].worker", "a processor with workers is killed one worker at a time"
            )
        if f.min_blocks and not s.admission_lease_fraction:
            raise ScenarioError(
                f"faults[{i}].min_blocks", "needs processor.admission_leases: no blocks without"
            )
        if f.worker is not None and f.worker >= s.workers:
            raise ScenarioError(
                f"faults[{i}].worker", f"{f.worker} is not below processor.workers ({s.workers})"
            )
        if s.redis_mode == "cluster" and f.kind.startswith("redis_"):
            if f.kind not in CLUSTER_FAULTS or f.master is None:
                raise ScenarioError(
                    f"faults[{i}].fault", "on a cluster only redis_kill with master: <i>"
                )
            if f.master >= s.masters:
                raise ScenarioError(
                    f"faults[{i}].master", f"{f.master} is not below redis.masters ({s.masters})"
                )
        if f.master is not None and s.redis_mode != "cluster":
            raise ScenarioError(f"faults[{i}].master", "only with redis.mode: cluster")
    # A processor fault with nobody left to settle its orphans proves nothing.
    kills = [f for f in s.faults if f.kind == "processor_kill" and not f.for_s and f.worker is None]
    if kills and s.processors < 2:
        raise ScenarioError("processor.count", "a processor_kill needs a peer: at least 2")
    if s.redis_mode == "cluster" and s.tenants < s.masters:
        raise ScenarioError(
            "processor.tenants", f"{s.tenants} leaves a master idle: at least redis.masters"
        )
    for i, b in enumerate(s.bursts):
        if b.at_s >= s.duration_s:
            raise ScenarioError(f"clients.bursts[{i}].at", "is not before duration_s")
    return s


def _compat_profile(profile: str) -> bool:
    """The profile sets ``ext-compat``: llmsim then refuses its own chaos keys."""
    from loadlab.simulator import profile_path

    try:
        doc = yaml.safe_load(profile_path(profile).read_text())
    except (OSError, yaml.YAMLError):
        return False  # the simulator says what is wrong with it when it starts
    return isinstance(doc, dict) and bool(doc.get("ext-compat"))


def load_chaos(path: Path) -> ChaosScenario:
    return parse_chaos(read_yaml(path))
