"""The gateway under test: the processor process(es) and Envoy in front of them."""

from __future__ import annotations

import hashlib
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

from stack.envoy import EnvoyPorts, envoy_argv, render_bootstrap
from tests.support.procs import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


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
    ) -> Processor:
        """``prefix`` runs the processor under a launcher (e.g. ``taskset -c 0``)."""
        port, metrics_port = free_port(), free_port()
        argv = [
            *prefix,
            sys.executable, "-m", "extproc", "serve",
            "--config", str(config_path),
            "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--log-level", "warning",
        ]  # fmt: skip
        if redis_url:
            argv += ["--redis-url", redis_url]
        process = ManagedProcess(argv, log_dir / f"extproc-{port}.log", cwd=ROOT)
        process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
        return cls(process, port, metrics_port)

    def metrics(self) -> dict[str, float]:
        _, text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
        return out

    def stop(self) -> int:
        return self.process.stop()


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
    ) -> Envoy:
        ports = EnvoyPorts(listen=free_port(), admin=free_port())
        config_path = log_dir / f"envoy-{ports.listen}.yaml"
        config_path.write_text(
            render_bootstrap(ports, processor_ports, backend_ports, buffer_limit_bytes)
        )
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

        process.wait_ready(ready, timeout_s=30)
        return cls(process, ports, config_path)

    def stop(self) -> int:
        return self.process.stop()


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
