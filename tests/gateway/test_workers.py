"""`extproc serve --workers N`: N processes on consecutive ports, balanced by Envoy."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import openai

from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.support.gateway import ROOT, Envoy, grpc_serving, http_get
from tests.support.procs import ManagedProcess, free_port_run
from tests.support.redis_server import RedisServer
from tests.support.simulator import Simulator


def admitted(metrics_port: int) -> int:
    _, text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    line = next(x for x in text.splitlines() if x.startswith("extproc_admitted_total "))
    return int(float(line.split()[1]))


def test_two_workers_share_the_streams_of_one_envoy_and_stop_together(
    tmp_path: Path, redis_server: RedisServer, simulators: list[Simulator]
) -> None:
    tenants = {"workers": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1000}}}}
    config = write_processor_config(tmp_path / "quota.yaml", tenants, redis_url=redis_server.url)
    port, metrics = free_port_run(2), free_port_run(2)
    parent = ManagedProcess(
        [
            sys.executable, "-m", "extproc", "serve", "--config", str(config),
            "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}",
            "--workers", "2", "--log-level", "warning",
        ],
        tmp_path / "workers.log",
        cwd=ROOT,
    )  # fmt: skip
    envoy = None
    try:
        parent.wait_ready(lambda: grpc_serving(port) and grpc_serving(port + 1), timeout_s=30)
        envoy = Envoy.start(tmp_path, [port, port + 1], [s.port for s in simulators])
        client = openai.OpenAI(
            base_url=envoy.base_url + "/v1", api_key=tenant_key("workers"), max_retries=0
        )
        for _ in range(20):
            client.chat.completions.create(
                model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        counts = [admitted(metrics), admitted(metrics + 1)]
        assert sum(counts) == 20
        assert min(counts) > 0, counts
        parent.signal(signal.SIGTERM)
        assert parent.proc.wait(30) == 0
        assert not grpc_serving(port) and not grpc_serving(port + 1)
    finally:
        if envoy is not None:
            envoy.stop()
        parent.stop()
