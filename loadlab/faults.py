"""The parts of a chaos run and the faults applied to them by PID.

Redis, the simulator (with the scenario's failure injection and ``ext-`` chaos keys), N
processors sharing the Redis, one Envoy health-checking them all. Every fault acts on a PID
and is recorded with its wall-clock start and end: ``redis_pause`` (SIGSTOP … SIGCONT),
``redis_kill`` (SIGKILL; restarted on the same port, empty, after ``for``), ``redis_restart``
(SIGTERM, at once again on the same port), ``processor_kill`` / ``processor_term`` (SIGKILL /
SIGTERM one of N; restarted on its port after ``for`` if given), ``envoy_restart`` (stopped,
started again on its ports after ``for``). With ``processor.workers`` > 1 each processor is
a ``serve --workers N`` supervisor and ``processor_kill`` SIGKILLs one worker (its supervisor
replaces it); with ``redis.mode: cluster`` Redis is a real cluster with a replica per master
and ``redis_kill`` SIGKILLs one master for good (its replica takes over). ``stop`` ends
every process still running, newest first, however the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadlab.chaos_scenario import ChaosScenario, Fault
from loadlab.gateway import Envoy, Processor, Supervisor, http_get, key_hash, write_config
from loadlab.machine import status_kib
from loadlab.metrics import parse_metrics
from loadlab.procs import ManagedProcess
from loadlab.redis_cluster import RedisClusterSet, wait_for
from loadlab.redis_server import RedisServer
from loadlab.rig import MODELS
from loadlab.simulator import Simulator
from stack.envoy import ProcessorHealthCheck

# Envoy drops a processor after two failed checks half a second apart; a processor told to
# stop keeps serving for that long (its drain delay), so a SIGTERM costs no request.
HEALTH = ProcessorHealthCheck(interval_s=0.5, unhealthy_threshold=2)


# How long a worker kill with ``min_open`` waits past its ``at`` for the streams it needs.
MIN_OPEN_WAIT_S = 30.0


def _metrics_of(port: int) -> dict[str, float]:
    """A processor's (or worker's) /metrics; empty when it is not answering."""
    try:
        _, text = http_get(f"http://127.0.0.1:{port}/metrics", 0.5)
    except OSError:
        return {}
    return parse_metrics(text)


def worker_open(sup: Supervisor, worker: int) -> int:
    """Streams a worker admitted and has not settled, from its /metrics (0: not answering)."""
    m = _metrics_of(sup.metrics_port + worker)
    return int(m.get("extproc_requests_admitted_total", 0) - m.get("extproc_settlements_total", 0))


def blocks_held(port: int) -> int:
    """Admission blocks a processor took and has not returned, from its /metrics."""
    m = _metrics_of(port)
    taken = m.get('extproc_admission_blocks_total{result="taken"}', 0)
    return int(taken - m.get('extproc_admission_blocks_total{result="returned"}', 0))


def tenant_name(i: int) -> str:
    return f"chaos-{i}"


def tenant_api_key(i: int) -> str:
    return f"sk-chaos-tenant-{i}"


def processor_config(
    path: Path, s: ChaosScenario, redis_url: str, tenants: list[str] | None = None
) -> Path:
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
                name: {"plan": "chaos", "key_sha256": [key_hash(tenant_api_key(i))]}
                for i, name in enumerate(tenants or [tenant_name(i) for i in range(s.tenants)])
            },
            "stream_idle_timeout_s": s.stream_idle_timeout_s,
            "heartbeat_ttl_s": s.heartbeat_ttl_s,
            "orphan_sweep_s": s.orphan_sweep_s,
            "quota_timeout_ms": 500,
            **(
                {
                    "admission_leases": {
                        "enabled": True,
                        "fraction": s.admission_lease_fraction,
                        "idle_ms": s.admission_lease_idle_ms,
                    }
                }
                if s.admission_lease_fraction
                else {}
            ),
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
        self.cluster: RedisClusterSet | None = None
        # Tenant i's name; on a cluster chosen so that the masters take turns (tenant i on
        # master i % masters, the masters in slot order).
        self.tenants = [tenant_name(i) for i in range(scenario.tenants)]
        self.tenant_master: dict[str, int] = {}  # tenant → master index (a cluster)
        self.masters: list[int] = []  # master ports in slot order, as at the start
        self.shard_nodes: list[list[int]] = []  # each shard's nodes, the master now first
        self.sim: Simulator | None = None
        self.processors: list[Processor | Supervisor | None] = []
        self.envoy: Envoy | None = None
        self.config: Path | None = None
        self.applied: list[Applied] = []
        self.killed_at: list[float] = []  # wall clock of each processor SIGKILL
        self.killed_pids: list[int] = []  # the pid each SIGKILL was sent to
        self.killed_masters: list[tuple[int, float]] = []  # (master index, wall clock)
        self.failovers: list[dict[str, Any]] = []
        # One kill of a master at a time (its rejoin included): a second kill of the same
        # slots waits until the node that took them has a replica again.
        self._master_locks: dict[int, threading.Lock] = {}
        self.replaced: list[dict[str, Any]] = []  # a supervisor's worker replaced
        self._lock = threading.Lock()  # a fault replaces a part while stop() may run
        self._everything: list[ManagedProcess] = []  # every process ever started, in order
        self.stopping = False
        self.abort = threading.Event()  # the run is ending: a fault cuts its wait short

    @property
    def redis_url(self) -> str:
        if self.cluster is not None:
            return self.cluster.url
        assert self.redis is not None
        return self.redis.url

    def cluster_shards(self) -> list[list[int]]:
        """Each shard's nodes, its master now first, then its replicas: as at the start, but
        a killed master's successor moved to the front (none: a single Redis)."""
        with self._lock:
            return [list(nodes) for nodes in self.shard_nodes]

    def cluster_ports(self) -> list[int]:
        """Every node of the cluster (none: a single Redis)."""
        return [n.port for n in self.cluster.nodes] if self.cluster is not None else []

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
        if s.redis_mode == "cluster":
            self._start_cluster()
        else:
            self.redis = RedisServer.start(self.workdir / "redis")
            self._keep(self.redis.process)
        self.sim = Simulator(s.profile, *simulator_args(s), log_dir=self.workdir)
        self._keep(self.sim.process)
        self.config = processor_config(self.workdir / "quota.yaml", s, self.redis_url, self.tenants)
        for _ in range(s.processors):
            p = self._processor()
            self.processors.append(p)
        self.envoy = Envoy.start(
            self.workdir,
            [p.port for p in self.processors if p is not None],
            [self.sim.port],
            health_check=HEALTH,
            stream_per_processor_connection=s.workers > 1,
        )
        self._keep(self.envoy.process)

    def _start_cluster(self) -> None:
        s = self.s
        self.cluster = RedisClusterSet.start(self.workdir / "cluster", masters=s.masters)
        for node in self.cluster.nodes:
            self._keep(node.process)
        self.cluster.wait_replicas_synced()
        with self._lock:
            self.shard_nodes = [[m, *r] for m, r in sorted(self.cluster.topology().items())]
        by_port = self.cluster.tenants_on_masters(
            per_master=-(-s.tenants // s.masters), stem="chaos-"
        )
        self.masters = self.slot_order()
        names = []
        for i in range(s.tenants):
            master = i % s.masters
            names.append(by_port[self.masters[master]][i // s.masters])
            self.tenant_master[names[-1]] = master
        self.tenants = names

    def slot_order(self) -> list[int]:
        """The live masters' ports, ordered by the first slot each serves."""
        assert self.cluster is not None
        node = self.cluster.live_nodes()[0]
        shards = node.client().execute_command("CLUSTER SLOTS")
        firsts: dict[int, int] = {}
        for start, _end, master, *_ in shards:
            port = int(master[1])
            firsts[port] = min(firsts.get(port, start), start)
        return sorted(firsts, key=firsts.__getitem__)

    def _processor(self, port: int | None = None) -> Processor | Supervisor:
        assert self.config is not None
        p: Processor | Supervisor
        if self.s.workers > 1:
            p = Supervisor.start(
                self.config,
                self.workdir,
                self.s.workers,
                self.redis_url,
                port=port,
                drain_delay_s=HEALTH.drain_delay_s,
            )
        else:
            p = Processor.start(
                self.config,
                self.workdir,
                self.redis_url,
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
        """The processes that serve streams: each processor, or each worker of one."""
        pids: list[int] = []
        for p in self.processors:
            if isinstance(p, Supervisor):
                pids += sorted(p.worker_pids().values())
            elif p is not None:
                pids.append(p.process.pid)
        return pids

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            everything = list(self._everything)
        # A supervisor drains its workers on SIGTERM; any it left (it was SIGKILLed after
        # its stop timed out) are SIGKILLed below, by the pids it had.
        workers = [pid for p in self.processors if isinstance(p, Supervisor) for pid in
                   p.worker_pids().values()]  # fmt: skip
        for process in reversed(everything):
            with contextlib.suppress(OSError):
                if process.proc.poll() is None:
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, signal.SIGCONT)  # a paused Redis can't stop
                process.stop()
        for pid in workers:
            with contextlib.suppress(OSError):
                # Still that worker (its pid not reused): our config on its command line.
                if str(self.config).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)

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
        if f.master is not None:
            self._master_kill(f.master, f.for_s)
            return
        self._redis_down(f, signal.SIGKILL, "redis_kill", f.for_s)

    def _master_kill(self, index: int, down_s: float) -> None:
        """SIGKILL master ``index`` (the master of the index-th slot range at the start, or
        whoever took it over since); its replica takes over once the others vote it failed
        (cluster-node-timeout 1 s, then ~1-2 s). The fault ends when every live node agrees
        on the new master. With ``down_s``, the killed node is started again that long
        after and rejoins as the new master's replica: empty, it must not serve a stale
        slot (the invariants check that no budget was given twice)."""
        assert self.cluster is not None
        with self._master_locks.setdefault(index, threading.Lock()):
            self._kill_master(index, down_s)

    def _kill_master(self, index: int, down_s: float) -> None:
        assert self.cluster is not None
        port = self.masters[index]
        node = self.cluster.node(port)
        a = self._record("redis_kill", f"master {index} port {port} pid {node.process.pid}")
        self.killed_masters.append((index, a.started_s))
        node.kill()
        try:
            self.cluster.wait_master_changed(port, timeout_s=60)
        finally:
            a.ended_s = time.time()
        new = next((m for m in self.cluster.topology() if m not in self.masters), None)
        a.note = f"failed over to replica port {new}" if new else "failed over"
        failover: dict[str, Any] = {"master": index, "old_port": port, "new_port": new}
        self.failovers.append(failover)
        if new is None:
            return
        self.masters[index] = new  # a later kill of this index kills the one serving it now
        with self._lock:
            for nodes in self.shard_nodes:
                if new in nodes:  # read first from now on; the killed node after it
                    nodes.remove(new)
                    nodes.insert(0, new)
        if not down_s:
            return
        self._sleep(down_s)
        if self.ending:
            return
        self._keep(node.restart())
        self.cluster.wait_rejoined(port, new)
        failover["rejoined_as_replica"] = True
        a.note += f"; port {port} back {down_s:g}s later as its replica"

    def _redis_restart(self, f: Fault) -> None:
        self._redis_down(f, signal.SIGTERM, "redis_restart", f.for_s)

    def _wait_for_at_least(self, wanted: int, count: Callable[[], int]) -> int:
        """Polls ``count`` from the fault's ``at`` until it reaches ``wanted`` (at most
        MIN_OPEN_WAIT_S, or until the run ends); what it last read."""
        deadline = time.monotonic() + MIN_OPEN_WAIT_S
        held = 0
        while time.monotonic() < deadline and not self.ending:
            held = count()
            if held >= wanted:
                break
            time.sleep(0.02)
        return held

    def _processor_down(self, f: Fault, sig: int, kind: str) -> None:
        p = self.processors[f.index]
        if p is None:
            self._record(kind, f"processor {f.index}", note="already down").ended_s = time.time()
            return
        note = ""
        if f.min_blocks:
            port = p.metrics_port
            note = f"holding {self._wait_for_at_least(f.min_blocks, lambda: blocks_held(port))}"
            note += " admission blocks"
        a = self._record(kind, f"processor {f.index} pid {p.process.pid}", note=note)
        if sig == signal.SIGKILL:
            self.killed_at.append(a.started_s)
            self.killed_pids.append(p.process.pid)
        p.process.signal(sig)
        p.process.proc.wait(30)
        p.stop()
        self.processors[f.index] = None
        if f.for_s:
            self._sleep(f.for_s)
            if not self.ending:
                self.processors[f.index] = self._processor(port=p.port)
                restarted = self.processors[f.index]
                assert restarted is not None
                a.note = ", ".join(
                    filter(None, [note, f"restarted as pid {restarted.process.pid}"])
                )
        a.ended_s = time.time()

    def _processor_kill(self, f: Fault) -> None:
        if f.worker is not None:
            self._worker_kill(f)
            return
        self._processor_down(f, signal.SIGKILL, "processor_kill")

    def _worker_kill(self, f: Fault) -> None:
        """SIGKILL worker ``f.worker`` of processor ``f.index``; its supervisor starts a new
        one on the same port: the fault ends once that one answers /metrics."""
        assert f.worker is not None
        p = self.processors[f.index]
        target = f"processor {f.index} worker {f.worker}"
        if not isinstance(p, Supervisor):
            self._record("processor_kill", target, note="no supervisor").ended_s = time.time()
            return
        worker = f.worker
        waited = ""
        if f.min_open:
            held = self._wait_for_at_least(f.min_open, lambda: worker_open(p, worker))
            waited = f"holding {held} open streams; "
        if f.min_blocks:
            port = p.metrics_port + worker
            held = self._wait_for_at_least(f.min_blocks, lambda: blocks_held(port))
            waited += f"holding {held} admission blocks; "
        pid = p.worker_pids().get(worker)
        if pid is None:
            self._record("processor_kill", target, note="already down").ended_s = time.time()
            return
        a = self._record("processor_kill", f"{target} pid {pid}")
        self.killed_at.append(a.started_s)
        self.killed_pids.append(pid)
        os.kill(pid, signal.SIGKILL)
        try:

            def replaced() -> int:
                q = p.worker_pids().get(worker)
                return q if q not in (None, pid) and p.answers(worker) else 0

            new = wait_for(
                replaced,
                f"worker {worker} replaced",
                timeout_s=90,
            )
        except TimeoutError as exc:
            a.note = f"not replaced: {exc}"
        else:
            a.note = f"{waited}replaced by pid {new}"
            self.replaced.append(
                {"processor": f.index, "worker": worker, "killed_pid": pid, "new_pid": new}
            )
        a.ended_s = time.time()

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
