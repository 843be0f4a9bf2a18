"""The parts a run starts — Redis, the simulator, processors, one Envoy per route — and the
routes a client takes to the simulator through them.

Everything listens on a free loopback port and is stopped by PID, newest first, however the
run ends (``Parts`` is a context manager; a part that fails to start stops itself).
``extproc chaos`` starts its own (``loadlab.faults``): N processors, faults by PID.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadlab.gateway import Processor, key_hash, write_config
from loadlab.procs import StopsOnExit, StopStack
from loadlab.redis_server import RedisServer
from loadlab.rig import MODELS, ROOMY, start_envoy, start_noop_processor
from loadlab.scenario import Scenario, Target, Variant
from loadlab.simulator import Simulator

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Route:
    """One way from the client to a model server, and the PIDs whose CPU it uses."""

    name: str
    host: str
    port: int
    path: str = CHAT_PATH
    # API key per level index, the warm-up's last ([]: none)
    keys: list[str] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)  # the keys' tenants, when known
    pids: dict[str, int] = field(default_factory=dict)  # role → PID
    tls: bool = False  # https
    # The simulator started here: its token events are counted against what was asked
    # (tokens_per_chunk); a target's answers are taken as they come.
    exact_lengths: bool = True

    def api_key(self, level_index: int) -> str | None:
        return self.keys[level_index] if self.keys else None


def tenant_id(v_index: int, level_index: int) -> str:
    return f"t{v_index}-{level_index}"


def tenant_key(variant: Variant, level_index: int) -> str:
    """A tenant per processor variant and level: each phase starts with a whole budget."""
    digest = hashlib.sha256(f"{variant.name}/{level_index}".encode()).hexdigest()[:12]
    return f"sk-bench-{digest}"


def processor_config(path: Path, scenario: Scenario, redis_url: str) -> Path:
    plans: dict[str, Any] = {}
    tenants: dict[str, Any] = {}
    budget = scenario.budget
    for v_index, variant in enumerate(scenario.variants):
        plan = f"p{v_index}"
        plans[plan] = {
            "window_s": budget.window_s if budget else 3600,
            "limits": {"*": {"rpm": ROOMY, "tpm": budget.tpm if budget else ROOMY}},
            "charge_mode": variant.charge_mode,
            "batch_tokens": variant.batch_tokens,
        }
        if budget is not None and variant.window == "sliding":
            plans[plan] |= {"window": "sliding", "bucket_s": budget.bucket}
        for l_index in range(len(scenario.levels) + 1):  # the last one: warm-up requests
            key = tenant_key(variant, l_index)
            tenants[tenant_id(v_index, l_index)] = {"plan": plan, "key_sha256": [key_hash(key)]}
    doc: dict[str, Any] = {
        "redis_url": redis_url,
        "models": MODELS,
        "plans": plans,
        "tenants": tenants,
        "stream_idle_timeout_s": 120,
        "refund_wait_ms": 0,  # a refusal is a figure here, not something to wait out
    }
    if scenario.admission_leases:
        doc["admission_leases"] = {"enabled": True}
    return write_config(path, doc)


def simulator_args(scenario: Scenario) -> list[str]:
    return [
        "--inter-token-latency", f"{scenario.itl_ms}ms",
        "--inter-token-latency-std-dev", f"{scenario.itl_std_ms}ms",
        "--time-to-first-token", f"{scenario.ttft_ms}ms",
        "--time-to-first-token-std-dev", "0ms",
        "--ext-tokens-per-chunk", str(scenario.tokens_per_chunk),
        "--max-num-seqs", str(scenario.max_concurrency),
        "--ext-stamp-events", "true",
    ]  # fmt: skip


def target_path(url: str, api: str) -> str:
    """The request path of a target URL: a full endpoint path as it is, else the API's path
    under it (``/v1`` added unless the URL ends with it); a query string stays."""
    parts = urlsplit(url)
    base = parts.path.rstrip("/")
    endpoint = "/chat/completions" if api == "chat" else "/completions"
    if not base.endswith(("/chat/completions", "/completions")):
        base += endpoint if base.endswith("/v1") else "/v1" + endpoint
    return base + (f"?{parts.query}" if parts.query else "")


def target_route(target: Target, scenario: Scenario) -> Route:
    """An already running endpoint of ``--target``: nothing started, client-side only."""
    url = urlsplit(target.url)
    tls = url.scheme == "https"
    keys = [target.api_key] * (len(scenario.levels) + 1) if target.api_key else []
    return Route(
        target.name,
        url.hostname or "127.0.0.1",
        url.port or (443 if tls else 80),
        target_path(target.url, scenario.api),
        keys,
        tls=tls,
        exact_lengths=False,
    )


class Parts(StopsOnExit):
    """The started parts of one run; ``with Parts(...) as parts:`` stops them all by PID."""

    def __init__(self, scenario: Scenario, workdir: Path | None = None) -> None:
        self.scenario = scenario
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="loadlab-"))
        self.routes: list[Route] = []
        self.redis_url = ""
        self.processor: Processor | None = None
        self._stops = StopStack()

    @property
    def pids(self) -> list[int]:
        return sorted({pid for r in self.routes for pid in r.pids.values()} - {os.getpid()})

    def stop(self) -> None:
        self._stops.stop()

    def start(self) -> list[Route]:
        s = self.scenario
        if s.targets:
            self.routes = [target_route(t, s) for t in s.targets]
            return self.routes
        self.workdir.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        sim = Simulator(s.profile, *simulator_args(s), log_dir=self.workdir)
        self._stops.push(sim)
        common = {"client": me, "simulator": sim.pid}
        routes: list[Route] = []
        for name in s.routes:
            if name == "direct":
                routes.append(Route("direct", "127.0.0.1", sim.port, s.path, pids=dict(common)))
            elif name == "envoy":
                envoy, _ = start_envoy(self.workdir, None, sim.port, "envoy")
                self._stops.push(envoy)
                pids = {**common, "envoy": envoy.process.pid}
                routes.append(Route("envoy", "127.0.0.1", envoy.ports.listen, s.path, pids=pids))
            elif name == "noop":
                noop, noop_port = start_noop_processor(self.workdir)
                self._stops.push(noop)
                envoy, _ = start_envoy(self.workdir, noop_port, sim.port, "noop")
                self._stops.push(envoy)
                pids = {**common, "envoy": envoy.process.pid, "processor": noop.pid}
                routes.append(Route("noop", "127.0.0.1", envoy.ports.listen, s.path, pids=pids))
            else:
                routes += self._processor_routes(sim, common)
        self.routes = routes
        return routes

    def _processor_routes(self, sim: Simulator, common: dict[str, int]) -> list[Route]:
        s = self.scenario
        if shutil.which("redis-server") is not None:
            redis = RedisServer.start(self.workdir / "redis")
            self._stops.push(redis)
            self.redis_url = redis.url
        else:
            self.redis_url = "memory://"  # one processor: the in-process backend is exact
        config = processor_config(self.workdir / "quota.yaml", s, self.redis_url)
        processor = Processor.start(config, self.workdir, self.redis_url)
        self._stops.push(processor)
        self.processor = processor
        envoy, _ = start_envoy(self.workdir, processor.port, sim.port, "processor")
        self._stops.push(envoy)
        pids = {**common, "envoy": envoy.process.pid, "processor": processor.process.pid}
        return [
            Route(
                s.variant_route(v),
                "127.0.0.1",
                envoy.ports.listen,
                s.path,
                keys=[tenant_key(v, i) for i in range(len(s.levels) + 1)],
                tenants=[tenant_id(v_index, i) for i in range(len(s.levels) + 1)],
                pids=dict(pids),
            )
            for v_index, v in enumerate(s.variants)
        ]
