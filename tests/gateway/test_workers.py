"""`extproc serve --workers N`: N processes on ONE port (SO_REUSEPORT) behind one endpoint.

Real parts only: the supervisor and its workers as processes, redis-server, the simulator
and Envoy with a processor cluster of a single endpoint. The kernel spreads connections,
not streams, and Envoy keeps one long-lived HTTP/2 connection per worker thread to the
processor, so the tests' Envoy retires each processor connection after one stream
(``max_requests_per_connection: 1``): each request's stream then lands on a worker the
kernel picks, and with 20 requests both workers take some unless the kernel picked one
worker 20 times in a row (2 in a million). Which worker took a stream is read from each
worker's own /metrics port. Nothing waits on a duration: every wait is on a condition.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
import yaml

from extproc.app.workers import FIRST_RESTART_DELAY_S, MAX_QUICK_DEATHS, MAX_RESTART_DELAY_S
from loadlab.gateway import ROOT, Envoy, grpc_serving, http_get, wait_until
from loadlab.metrics import parse_metrics
from loadlab.procs import (
    ManagedProcess,
    child_pids_by_metrics_port,
    free_port,
    free_port_run,
    free_ports,
)
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from stack.envoy import EnvoyPorts, render_bootstrap
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.threads import grpc_thread_policies

WORKERS = 2
TENANTS = {
    "workers": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100_000}}},
    "workers-rpm": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 10, "tpm": 1_000_000}}},
    "workers-restart": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100_000}}},
}
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
READY_S = 60  # a worker warms its tokenizers first: slow on a loaded 2-core machine


@dataclass
class Workers:
    """A running supervisor: its gRPC port and the first of its workers' metrics ports."""

    process: ManagedProcess
    port: int
    metrics: int

    def metrics_port(self, worker: int) -> int:
        return self.metrics + worker

    def pids(self) -> dict[int, int]:
        """Worker index → pid of the live workers."""
        return child_pids_by_metrics_port(self.process.pid, self.metrics)

    def counter(self, worker: int, name: str) -> int:
        """One counter of one worker; summed over labels (``extproc_requests_refused_total{…}``)."""
        _, text = http_get(f"http://127.0.0.1:{self.metrics_port(worker)}/metrics")
        return int(parse_metrics(text).get(name, 0))

    def answers(self, worker: int) -> bool:
        try:
            http_get(f"http://127.0.0.1:{self.metrics_port(worker)}/metrics", 0.5)
            return True
        except OSError:
            return False

    def ready(self) -> bool:
        """Every worker is up: /metrics starts after the worker's gRPC server serves."""
        return len(self.pids()) == WORKERS and all(self.answers(i) for i in range(WORKERS))

    def stop(self) -> None:
        """By PID: the supervisor (it drains its workers), then any worker left behind."""
        left = self.pids()
        self.process.stop(timeout_s=30)
        for pid in left.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def serve_argv(
    config: Path, port: int, metrics: int | None, workers: int = WORKERS, *extra: str
) -> list[str]:
    argv = [
        sys.executable, "-m", "extproc", "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--workers", str(workers),
        "--drain-delay-s", "0", "--log-level", "info", *extra,
    ]  # fmt: skip
    if metrics is not None:
        argv += ["--metrics-listen", f"127.0.0.1:{metrics}"]
    return argv


def start_workers(config: Path, log_dir: Path, *extra: str) -> Workers:
    """``extra``: more ``serve`` options (e.g. ``--worker-timeout-s``)."""
    port, metrics = free_port(), free_port_run(WORKERS)
    process = ManagedProcess(
        serve_argv(config, port, metrics, WORKERS, *extra),
        log_dir / f"workers-{port}.log",
        cwd=ROOT,
    )
    workers = Workers(process, port, metrics)
    try:
        process.wait_ready(workers.ready, timeout_s=READY_S)
    except BaseException:
        workers.stop()
        raise
    return workers


def start_envoy_one_endpoint(log_dir: Path, processor_port: int, backends: list[int]) -> Envoy:
    """The shipped bootstrap with ONE processor endpoint, each processor connection retired
    after one stream so the kernel picks a worker per stream."""
    ports = EnvoyPorts(*free_ports(2))
    doc = yaml.safe_load(render_bootstrap(ports, [processor_port], backends))
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "quota_extproc")
    options = cluster["typed_extension_protocol_options"][HTTP_OPTIONS]
    options["common_http_protocol_options"] = {"max_requests_per_connection": 1}
    path = log_dir / f"envoy-{ports.listen}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return Envoy.launch(path, ports, log_dir / f"envoy-{ports.listen}.log")


@dataclass
class Stack:
    workers: Workers
    envoy: Envoy

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.envoy.base_url + "/v1", api_key=tenant_key(tenant), max_retries=0
        )

    def admitted(self) -> list[int]:
        return [self.workers.counter(i, "extproc_requests_admitted_total") for i in range(WORKERS)]

    def refused(self) -> list[int]:
        return [self.workers.counter(i, "extproc_requests_refused_total") for i in range(WORKERS)]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    simulators: list[Simulator],
) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("workers")
    config = write_processor_config(log_dir / "quota.yaml", TENANTS, redis_url=redis_server.url)
    workers = start_workers(config, log_dir, "--grpc-threads", "batch")
    try:
        envoy = start_envoy_one_endpoint(log_dir, workers.port, [s.port for s in simulators])
    except BaseException:
        workers.stop()
        raise
    yield Stack(workers, envoy)
    envoy.stop()
    workers.stop()


def chat(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


def test_one_envoy_endpoint_spreads_streams_over_both_workers(stack: Stack) -> None:
    _, clusters = http_get(f"http://127.0.0.1:{stack.envoy.ports.admin}/clusters")
    hosts = {
        line.split("::")[1]
        for line in clusters.splitlines()
        if line.startswith("quota_extproc::") and "::cx_total::" in line
    }
    assert hosts == {f"127.0.0.1:{stack.workers.port}"}
    before = stack.admitted()
    client = stack.client("workers")
    for _ in range(20):
        chat(client)
    took = [after - b for after, b in zip(stack.admitted(), before, strict=True)]
    assert sum(took) == 20
    assert min(took) > 0, took


def test_every_worker_runs_grpc_threads_as_batch_and_its_loop_thread_as_ordinary(
    stack: Stack,
) -> None:
    """The supervisor's ``--grpc-threads`` (``batch`` here, not the default on several CPUs)
    reaches each worker it starts."""
    pids = stack.workers.pids()
    assert len(pids) == WORKERS
    for pid in pids.values():
        assert grpc_thread_policies(pid) == {os.SCHED_BATCH}
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER  # the event loop's thread


def test_workers_charge_one_redis_counter_so_a_limit_is_not_multiplied(
    stack: Stack, redis_client: redis.Redis
) -> None:
    before = stack.admitted()
    refused_before = stack.refused()
    client = stack.client("workers-rpm")
    admitted_tokens, refused = 0, 0
    for _ in range(16):
        try:
            usage = chat(client).usage
            assert usage is not None
            admitted_tokens += usage.prompt_tokens + usage.completion_tokens
        except openai.RateLimitError as exc:
            assert exc.code == "rpm_limit_exceeded"
            refused += 1
    took = [after - b for after, b in zip(stack.admitted(), before, strict=True)]
    refusals = [after - b for after, b in zip(stack.refused(), refused_before, strict=True)]
    # rpm 10 for the tenant, whichever worker admits: 10 admitted of 16, not 10 per worker.
    assert (sum(took), refused) == (10, 6)
    assert all(took[i] + refusals[i] > 0 for i in range(WORKERS)), (took, refusals)
    assert sum(refusals) == 6
    # rpm_counts: attempts (the default): all 16 attempts, on either worker, are in it.
    assert counter_value(redis_client, "workers-rpm", "rpm", "gpt-4.1") == 16
    assert wait_until(
        lambda: counter_value(redis_client, "workers-rpm", "tpm", "gpt-4.1") == admitted_tokens,
        timeout_s=15,
    ), (counter_value(redis_client, "workers-rpm", "tpm", "gpt-4.1"), admitted_tokens)


def test_a_sigkilled_worker_is_restarted_and_the_port_keeps_serving(stack: Stack) -> None:
    workers = stack.workers
    old = workers.pids()
    assert len(old) == WORKERS
    os.kill(old[0], signal.SIGKILL)
    assert wait_until(lambda: workers.pids().get(0) not in (None, old[0]), timeout_s=READY_S)
    new = workers.pids()
    assert new[1] == old[1]  # the other worker was left alone
    assert wait_until(lambda: workers.answers(0), timeout_s=READY_S), workers.process.log_text()
    client = stack.client("workers-restart")
    before = stack.admitted()  # the new worker counts from 0
    for _ in range(20):
        chat(client)
    took = [after - b for after, b in zip(stack.admitted(), before, strict=True)]
    assert sum(took) == 20
    assert took[0] > 0, took  # the restarted worker is listening on the shared port again
    assert f'"pid":{old[0]}' in workers.process.log_text()  # the death was logged, with the pid
    assert '"event":"worker_died"' in workers.process.log_text()


def test_sigterm_stops_every_worker_and_the_supervisor_exits_0(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = write_processor_config(tmp_path / "quota.yaml", TENANTS, redis_url=redis_server.url)
    workers = start_workers(config, tmp_path)
    try:
        pids = workers.pids()
        workers.process.signal(signal.SIGTERM)
        assert workers.process.proc.wait(READY_S) == 0, workers.process.log_text()[-3000:]
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
        assert not grpc_serving(workers.port)
        # Each worker drained and logged its own `stopped` record.
        assert workers.process.log_text().count('"event":"stopped"') == WORKERS
    finally:
        workers.stop()


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def exit_of(argv: list[str], log_path: Path, timeout_s: float = READY_S) -> tuple[int, str]:
    """Run a serve command that must exit by itself: its exit code and output."""
    process = ManagedProcess(argv, log_path, cwd=ROOT)
    try:
        code = process.proc.wait(timeout_s)
    finally:
        process.stop()
    return code, log_path.read_text()


def test_memory_backend_with_two_workers_is_refused_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    config = write_processor_config(tmp_path / "quota.yaml", TENANTS)  # memory://
    port = free_port()
    code, text = exit_of(serve_argv(config, port, None), tmp_path / "refused.log")
    assert code == 2
    assert "memory://" in text and "each worker would count alone" in text, text
    assert "worker_started" not in text


def test_listen_port_0_with_two_workers_is_refused(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = write_processor_config(tmp_path / "quota.yaml", TENANTS, redis_url=redis_server.url)
    code, text = exit_of(serve_argv(config, 0, None), tmp_path / "refused.log")
    assert code == 2
    assert "port 0" in text and "fixed port" in text, text
    assert "worker_started" not in text


def test_a_worker_that_dies_at_start_is_restarted_with_doubling_delays_then_given_up(
    tmp_path: Path,
) -> None:
    # Nothing listens on the Redis port: each worker exits 1 at start (its backend does not
    # answer), as a worker with a broken environment would, over and over.
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    config = write_processor_config(tmp_path / "quota.yaml", TENANTS, redis_url=dead_redis)
    log_path = tmp_path / "crashing.log"
    code, text = exit_of(serve_argv(config, free_port(), None), log_path, timeout_s=600)
    records = [r for r in map(_record, text.splitlines()) if r]
    assert code == 1, text[-3000:]
    gave_up = [r for r in records if r.get("event") == "worker_keeps_dying"]
    assert len(gave_up) == 1, text[-3000:]
    worker = gave_up[0]["worker"]
    starts = [r for r in records if r.get("event") == "worker_started"]
    assert len([r for r in starts if r["worker"] == worker]) == MAX_QUICK_DEATHS + 1
    most = MAX_QUICK_DEATHS + 1
    assert all(len([r for r in starts if r["worker"] == i]) <= most for i in range(WORKERS))
    delays = [
        r["restart_in_s"]
        for r in records
        if r.get("event") == "worker_died" and r["worker"] == worker
    ]
    doubling = [FIRST_RESTART_DELAY_S * 2**n for n in range(MAX_QUICK_DEATHS)]
    assert delays == [min(MAX_RESTART_DELAY_S, d) for d in doubling]


def test_every_log_record_of_a_worker_carries_its_index(stack: Stack) -> None:
    records = [r for r in map(_record, stack.workers.process.log_text().splitlines()) if r]
    serving = [r for r in records if r.get("event") == "serving"]
    assert {r["worker"] for r in serving} == set(range(WORKERS))  # (a restart serves again)
    # Every record but the supervisor's about all workers (workers_*) names its worker.
    assert all("worker" in r for r in records if not r.get("event", "").startswith("workers_"))


def test_a_negative_worker_timeout_is_refused(tmp_path: Path, redis_server: RedisServer) -> None:
    config = write_processor_config(tmp_path / "quota.yaml", TENANTS, redis_url=redis_server.url)
    argv = serve_argv(config, free_port(), None, WORKERS, "--worker-timeout-s", "-1")
    code, text = exit_of(argv, tmp_path / "refused.log")
    assert code == 2 and "--worker-timeout-s must be >= 0" in text, text
    assert "worker_started" not in text
