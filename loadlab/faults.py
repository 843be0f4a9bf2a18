"""The parts of a chaos run and the faults applied to them by PID.

Redis, the simulator (with the scenario's failure injection and ``ext-`` chaos keys), N
processors sharing the Redis, one Envoy health-checking them all. Every fault acts on a PID
and is recorded with its wall-clock start and end: ``redis_pause`` (SIGSTOP … SIGCONT),
``redis_kill`` (SIGKILL; restarted on the same port, empty, after ``for``), ``redis_restart``
(SIGTERM, at once again on the same port), ``processor_kill`` / ``processor_term`` (SIGKILL /
SIGTERM one of N; restarted on its port after ``for`` if given), ``envoy_restart`` (stopped,
started again on its ports after ``for``). ``stop`` ends every process still running, newest
first, however the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadlab.chaos_scenario import ChaosScenario, Fault
from loadlab.gateway import Envoy, Processor, key_hash, write_config
from loadlab.machine import status_kib
from loadlab.procs import ManagedProcess
from loadlab.redis_server import RedisServer
from loadlab.rig import MODELS
from loadlab.simulator import Simulator
from stack.envoy import ProcessorHealthCheck

# Envoy drops a processor after two failed checks half a second apart; a processor told to
# stop keeps serving for that long (its drain delay), so a SIGTERM costs no request.
HEALTH = ProcessorHealthCheck(interval_s=0.5, unhealthy_threshold=2)


def tenant_name(i: int) -> str:
    return f"chaos-{i}"


def tenant_api_key(i: int) -> str:
    return f"sk-chaos-tenant-{i}"


def processor_config(path: Path, s: ChaosScenario, redis_url: str) -> Path:
    plan = {
        "window_s": s.window_s,
        "limits": {"*": {"tpm": s.tpm}},
        "charge_mode": s.charge_mode,
        "batch_tokens": s.batch_tokens,
        "on_backend_failure": "closed",
    }
    return write_config(
        path,
        {
            "redis_url": redis_url,
            "models": MODELS,
            "plans": {"chaos": plan},
            "tenants": {
                tenant_name(i): {"plan": "chaos", "key_sha256": [key_hash(tenant_api_key(i))]}
                for i in range(s.tenants)
            },
            "stream_idle_timeout_s": s.stream_idle_timeout_s,
            "heartbeat_ttl_s": s.heartbeat_ttl_s,
            "orphan_sweep_s": s.orphan_sweep_s,
            "quota_timeout_ms": 500,
        },
    )


def simulator_args(s: ChaosScenario) -> list[str]:
    args = [
        "--inter-token-latency",
        f"{s.itl_ms}ms",
        "--time-to-first-token",
        f"{s.ttft_ms}ms",
        "--max-num-seqs",
        str(max(256, s.max_concurrency)),
        "--seed",
        str(s.seed),
        "--ext-disconnect-rate",
        f"{s.disconnect_rate:g}",
        "--ext-stall-rate",
        f"{s.stall_rate:g}",
        "--ext-stall-duration",
        f"{s.stall_s:g}s",
        "--ext-malformed-event-rate",
        f"{s.malformed_rate:g}",
        "--ext-split-writes-rate",
        f"{s.split_writes_rate:g}",
        "--failure-injection-rate",
        f"{s.failure_injection_rate:g}",
    ]
    if s.failure_injection_rate:
        args += ["--failure-types", *s.failure_types]
    return args


def usage(pid: int) -> dict[str, int] | None:
    """RSS (KiB) and open fds of a live process, from /proc."""
    try:
        return {"rss_kib": status_kib(pid, default=0), "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:
        return None


@dataclass
class Applied:
    kind: str
    target: str
    started_s: float  # wall clock
    ended_s: float | None = None
    note: str = ""

    def to_doc(self, origin: float) -> dict[str, Any]:
        return {
            "fault": self.kind,
            "target": self.target,
            "at_s": round(self.started_s - origin, 3),
            "until_s": None if self.ended_s is None else round(self.ended_s - origin, 3),
            "note": self.note,
        }


class ChaosParts:
    def __init__(self, scenario: ChaosScenario, workdir: Path) -> None:
        self.s = scenario
        self.workdir = workdir
        self.redis: RedisServer | None = None
        self.sim: Simulator | None = None
        self.processors: list[Processor | None] = []
        self.envoy: Envoy | None = None
        self.config: Path | None = None
        self.applied: list[Applied] = []
        self.killed_at: list[float] = []  # wall clock of each processor SIGKILL
        self._lock = threading.Lock()  # a fault replaces a part while stop() may run
        self._everything: list[ManagedProcess] = []  # every process ever started, in order
        self.stopping = False
        self.abort = threading.Event()  # the run is ending: a fault cuts its wait short

    @property
    def redis_url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    @property
    def port(self) -> int:
        assert self.envoy is not None
        return self.envoy.ports.listen

    def _keep(self, process: ManagedProcess) -> None:
        with self._lock:
            self._everything.append(process)
            stopping = self.stopping
        if stopping:  # stop() ran while this one was starting: it is stopped here
            process.stop()
            raise RuntimeError("stopping")

    def start(self) -> None:
        s = self.s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer.start(self.workdir / "redis")
        self._keep(self.redis.process)
        self.sim = Simulator(s.profile, *simulator_args(s), log_dir=self.workdir)
        self._keep(self.sim.process)
        self.config = processor_config(self.workdir / "quota.yaml", s, self.redis.url)
        for _ in range(s.processors):
            p = self._processor()
            self.processors.append(p)
        self.envoy = Envoy.start(
            self.workdir,
            [p.port for p in self.processors if p is not None],
            [self.sim.port],
            health_check=HEALTH,
        )
        self._keep(self.envoy.process)

    def _processor(self, port: int | None = None) -> Processor:
        assert self.config is not None and self.redis is not None
        p = Processor.start(
            self.config,
            self.workdir,
            self.redis.url,
            port=port,
            drain_delay_s=HEALTH.drain_delay_s,
            log_level="info",
        )
        self._keep(p.process)
        return p

    @property
    def ending(self) -> bool:
        return self.stopping or self.abort.is_set()

    def processor_pids(self) -> list[int]:
        return [p.process.pid for p in self.processors if p is not None]

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            everything = list(self._everything)
        for process in reversed(everything):
            with contextlib.suppress(OSError):
                if process.proc.poll() is None:
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, signal.SIGCONT)  # a paused Redis can't stop
                process.stop()

    # --- faults -----------------------------------------------------------------------

    def apply(self, fault: Fault) -> Applied:
        """Apply one fault (blocking for its ``for``); runs in a thread of its own."""
        getattr(self, f"_{fault.kind}")(fault)
        return self.applied[-1]

    def _record(self, kind: str, target: str, note: str = "") -> Applied:
        a = Applied(kind, target, time.time(), note=note)
        self.applied.append(a)
        return a

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.ending:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _redis_pause(self, f: Fault) -> None:
        assert self.redis is not None
        a = self._record("redis_pause", f"redis pid {self.redis.pid}")
        self.redis.process.signal(signal.SIGSTOP)
        try:
            self._sleep(f.for_s)
        finally:
            self.redis.process.signal(signal.SIGCONT)
            a.ended_s = time.time()

    def _redis_down(self, f: Fault, sig: int, kind: str, down_s: float) -> None:
        assert self.redis is not None
        old = self.redis
        a = self._record(kind, f"redis pid {old.pid}")
        old.process.signal(sig)
        old.process.proc.wait(10)
        old.stop()
        self._sleep(down_s)
        if not self.ending:
            self.redis = RedisServer.start(self.workdir / "redis", port=old.port)
            self._keep(self.redis.process)
            a.note = f"restarted empty as pid {self.redis.pid}"
        a.ended_s = time.time()

    def _redis_kill(self, f: Fault) -> None:
        self._redis_down(f, signal.SIGKILL, "redis_kill", f.for_s)

    def _redis_restart(self, f: Fault) -> None:
        self._redis_down(f, signal.SIGTERM, "redis_restart", f.for_s)

    def _processor_down(self, f: Fault, sig: int, kind: str) -> None:
        p = self.processors[f.index]
        if p is None:
            self._record(kind, f"processor {f.index}", note="already down").ended_s = time.time()
            return
        a = self._record(kind, f"processor {f.index} pid {p.process.pid}")
        if sig == signal.SIGKILL:
            self.killed_at.append(a.started_s)
        p.process.signal(sig)
        p.process.proc.wait(30)
        p.stop()
        self.processors[f.index] = None
        if f.for_s:
            self._sleep(f.for_s)
            if not self.ending:
                self.processors[f.index] = self._processor(port=p.port)
                a.note = f"restarted as pid {self.processors[f.index].process.pid}"  # type: ignore[union-attr]
        a.ended_s = time.time()

    def _processor_kill(self, f: Fault) -> None:
        self._processor_down(f, signal.SIGKILL, "processor_kill")

    def _processor_term(self, f: Fault) -> None:
        self._processor_down(f, signal.SIGTERM, "processor_term")

    def _envoy_restart(self, f: Fault) -> None:
        assert self.envoy is not None
        old = self.envoy
        a = self._record("envoy_restart", f"envoy pid {old.process.pid}")
        old.stop()
        self._sleep(f.for_s)
        if not self.ending:
            log = self.workdir / f"envoy-{old.ports.listen}-{len(self.applied)}.log"
            self.envoy = Envoy.launch(old.config_path, old.ports, log)
            self._keep(self.envoy.process)
            a.note = f"restarted as pid {self.envoy.process.pid}"
        a.ended_s = time.time()
