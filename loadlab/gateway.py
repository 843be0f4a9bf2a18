"""The gateway under test: the processor process(es) and Envoy in front of them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadlab.metrics import parse_metrics
from loadlab.procs import (
    ManagedProcess,
    child_pids_by_metrics_port,
    free_port,
    free_port_run,
    free_ports,
)
from stack.envoy import EnvoyPorts, ProcessorHealthCheck, envoy_argv, render_bootstrap

ROOT = Path(__file__).resolve().parents[1]
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """A plain GET for readiness and metrics checks: (status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_config(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def grpc_serving(port: int) -> bool:
    """The processor's standard gRPC health check answers SERVING."""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


PORT_ATTEMPTS = 3  # a picked port taken by another process before the processor binds it


@dataclass
class Processor:
    process: ManagedProcess
    port: int
    metrics_port: int

    @classmethod
    def start(
        cls,
        config_path: Path,
        log_dir: Path,
        redis_url: str | None = None,
        prefix: Sequence[str] = (),
        port: int | None = None,
        drain_delay_s: float | None = 0.0,
        log_level: str = "warning",
        env: dict[str, str] | None = None,
        loop: str | None = None,
        grpc_threads: str | None = None,
    ) -> Processor:
        """``prefix`` runs the processor under a launcher (e.g. ``taskset -c 0``).

        ``port``: a given gRPC port (a restarted processor takes its predecessor's place).
        ``drain_delay_s`` overrides the config's (None: keep it); 0 by default, so stopping a
        test's processor doesn't wait for health checkers. ``log_level="info"`` logs the
        final ``stopped`` record (see ``stopped_record``).
        """
        # A free port is free when picked, not when the processor binds it: another
        # process can take it meanwhile. Ports picked here are picked again then.
        for attempt in range(PORT_ATTEMPTS):
            try:
                return cls._start_once(
                    config_path,
                    log_dir,
                    redis_url,
                    prefix,
                    port,
                    drain_delay_s,
                    log_level,
                    env,
                    loop,
                    grpc_threads,
                )
            except RuntimeError as exc:
                text = str(exc).lower()
                taken = "address already in use" in text or "failed to bind" in text
                if port is not None or not taken or attempt == PORT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(
        cls,
        config_path: Path,
        log_dir: Path,
        redis_url: str | None,
        prefix: Sequence[str],
        port: int | None,
        drain_delay_s: float | None,
        log_level: str,
        env: dict[str, str] | None,
        loop: str | None,
        grpc_threads: str | None,
    ) -> Processor:
        if port is None:
            port, metrics_port = free_ports(2)
        else:
            metrics_port = next(p for p in free_ports(2) if p != port)
        argv = [
            *prefix,
            sys.executable, "-m", "extproc", "serve",
            "--config", str(config_path),
            "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--log-level", log_level,
        ]  # fmt: skip
        if redis_url:
            argv += ["--redis-url", redis_url]
        if drain_delay_s is not None:
            argv += ["--drain-delay-s", str(drain_delay_s)]
        if loop is not None:  # else serve's default
            argv += ["--loop", loop]
        if grpc_threads is not None:
            argv += ["--grpc-threads", grpc_threads]
        log_path = log_dir / f"extproc-{port}.log"
        for n in range(1, 100):
            if not log_path.exists():
                break
            log_path = log_dir / f"extproc-{port}-{n}.log"  # a restart keeps the old log
        process = ManagedProcess(argv, log_path, cwd=ROOT, env=env)
        try:
            process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
        except BaseException:  # also Ctrl-C while waiting: never leave it running
            process.stop()
            raise
        return cls(process, port, metrics_port)

    def metrics(self) -> dict[str, float]:
        _, text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return parse_metrics(text)

    def stop(self) -> int:
        return self.process.stop()

    def log_records(self) -> list[dict[str, Any]]:
        """The processor's JSON log records (structlog), in order."""
        records = []
        for line in self.process.log_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def stopped_record(self) -> dict[str, Any]:
        """The record an exited processor logs last (``log_level="info"``): its final
        ``admitted`` and ``settled`` (by reason) counters, which /metrics can't show once the
        process is gone."""
        found = [r for r in self.log_records() if r.get("event") == "stopped"]
        assert found, self.process.log_text()[-3000:]
        return found[-1]


@dataclass
class Supervisor:
    """``extproc serve --workers N`` on one port (SO_REUSEPORT): the supervisor process and
    its workers, worker ``i`` serving /metrics on ``metrics_port + i``."""

    process: ManagedProcess
    port: int
    metrics_port: int
    workers: int

    @classmethod
    def start(
        cls,
        config_path: Path,
        log_dir: Path,
        workers: int,
        redis_url: str | None = None,
        port: int | None = None,
        drain_delay_s: float = 0.0,
        log_level: str = "info",
        timeout_s: float = 90.0,
    ) -> Supervisor:
        """Ready once every worker serves gRPC and /metrics (a worker warms its tokenizers
        first: slow on a loaded machine, hence the generous ``timeout_s``)."""
        port = port or free_port()
        metrics_port = free_port_run(workers)
        argv = [
            sys.executable, "-m", "extproc", "serve",
            "--config", str(config_path),
            "--listen", f"127.0.0.1:{port}",
            "--workers", str(workers),
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--drain-delay-s", str(drain_delay_s),
            "--log-level", log_level,
        ]  # fmt: skip
        if redis_url:
            argv += ["--redis-url", redis_url]
        process = ManagedProcess(argv, log_dir / f"workers-{port}.log", cwd=ROOT)
        sup = cls(process, port, metrics_port, workers)
        try:
            process.wait_ready(sup.ready, timeout_s=timeout_s)
        except BaseException:
            sup.stop()
            raise
        return sup

    def worker_pids(self) -> dict[int, int]:
        """Worker index → pid of the live workers."""
        return child_pids_by_metrics_port(self.process.pid, self.metrics_port)

    def answers(self, worker: int) -> bool:
        try:
            http_get(f"http://127.0.0.1:{self.metrics_port + worker}/metrics", 0.5)
            return True
        except OSError:
            return False

    def ready(self) -> bool:
        return len(self.worker_pids()) == self.workers and all(
            self.answers(i) for i in range(self.workers)
        )

    def metrics(self) -> dict[str, float]:
        """Every live worker's metrics, summed (a worker that is not answering is left out)."""
        total: dict[str, float] = {}
        for i in range(self.workers):
            try:
                _, text = http_get(f"http://127.0.0.1:{self.metrics_port + i}/metrics")
            except OSError:
                continue
            for name, value in parse_metrics(text).items():
                total[name] = total.get(name, 0.0) + value
        return total

    def stop(self) -> int:
        """By PID: the supervisor (it drains its workers), then any worker left behind."""
        left = self.worker_pids()
        code = self.process.stop(timeout_s=30)
        for pid in left.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return code


@dataclass
class Envoy:
    process: ManagedProcess
    ports: EnvoyPorts
    config_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.listen}"

    @classmethod
    def start(
        cls,
        log_dir: Path,
        processor_ports: list[int],
        backend_ports: list[int],
        buffer_limit_bytes: int = (1 << 20) + 65536,
        health_check: ProcessorHealthCheck | None = None,
        stream_per_processor_connection: bool = False,
    ) -> Envoy:
        """``health_check``: the processors' health check (None: the shipped one).
        ``stream_per_processor_connection``: each processor connection is retired after one
        stream, so the kernel picks a worker of a ``serve --workers N`` port per stream
        (Envoy otherwise keeps one long-lived HTTP/2 connection per worker thread)."""
        ports = EnvoyPorts(*free_ports(2))
        config_path = log_dir / f"envoy-{ports.listen}.yaml"
        text = render_bootstrap(
            ports,
            processor_ports,
            backend_ports,
            buffer_limit_bytes,
            health_check or ProcessorHealthCheck(),
        )
        if stream_per_processor_connection:
            doc = yaml.safe_load(text)
            cluster = next(
                c for c in doc["static_resources"]["clusters"] if c["name"] == "quota_extproc"
            )
            options = cluster["typed_extension_protocol_options"][HTTP_OPTIONS]
            options["common_http_protocol_options"] = {"max_requests_per_connection": 1}
            text = yaml.safe_dump(doc)
        config_path.write_text(text)
        return cls.launch(config_path, ports, log_dir / f"envoy-{ports.listen}.log")

    @classmethod
    def launch(
        cls, config_path: Path, ports: EnvoyPorts, log_path: Path, *extra_args: str
    ) -> Envoy:
        """Start Envoy on a written bootstrap and wait until its admin says ready."""
        process = ManagedProcess(
            [*envoy_argv(config_path, base_id=ports.listen), *extra_args], log_path
        )

        def ready() -> bool:
            try:
                return http_get(f"http://127.0.0.1:{ports.admin}/ready", 0.5)[0] == 200
            except OSError:
                return False

        try:
            process.wait_ready(ready, timeout_s=30)
        except BaseException:
            process.stop()
            raise
        return cls(process, ports, config_path)

    def stop(self) -> int:
        return self.process.stop()

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges from the admin ``/stats`` page."""
        _, text = http_get(f"http://127.0.0.1:{self.ports.admin}/stats")
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def processor_health(self, port: int) -> str:
        """The health flags Envoy holds for one processor endpoint: ``healthy``, or e.g.
        ``/failed_active_hc`` (failed its health check), ``/failed_outlier_check``."""
        _, text = http_get(f"http://127.0.0.1:{self.ports.admin}/clusters")
        marker = f"quota_extproc::127.0.0.1:{port}::health_flags::"
        for line in text.splitlines():
            if line.startswith(marker):
                return line[len(marker) :]
        return ""


@dataclass
class Gateway:
    """Envoy + its processor(s); ``stop`` stops all by PID."""

    envoy: Envoy
    processors: list[Processor] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.envoy.base_url

    def stop(self) -> None:
        self.envoy.stop()
        for p in self.processors:
            p.stop()


def start_gateway(
    config_path: Path,
    log_dir: Path,
    backend_ports: list[int],
    redis_url: str | None = None,
    processors: int = 1,
) -> Gateway:
    started = [Processor.start(config_path, log_dir, redis_url) for _ in range(processors)]
    try:
        envoy = Envoy.start(log_dir, [p.port for p in started], backend_ports)
    except Exception:
        for p in started:
            p.stop()
        raise
    return Gateway(envoy, started)


def wait_until(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
