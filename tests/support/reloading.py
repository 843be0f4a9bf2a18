"""Helpers for configuration-reload tests: a processor started with reload flags, a minimal
ext_proc client that asks it to admit one request, and a ConfigMap-like directory."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from loadlab.gateway import Processor, grpc_serving
from loadlab.procs import ManagedProcess, free_ports

ROOT = Path(__file__).resolve().parents[2]
ADMITTED = 200


def start_processor(
    config_path: Path,
    log_dir: Path,
    *,
    poll_s: float = 0.0,
    redis_url: str | None = None,
    extra: Sequence[str] = (),
) -> Processor:
    """``extproc serve`` on free ports, logging at info (``config_reloaded`` lines); no
    overrides but the addresses, so its hash is ``check-config``'s (set ``drain_delay_s: 0``
    in the file for a quick stop)."""
    port, metrics_port = free_ports(2)
    argv = [
        sys.executable, "-m", "extproc", "serve",
        "--config", str(config_path),
        "--listen", f"127.0.0.1:{port}",
        "--metrics-listen", f"127.0.0.1:{metrics_port}",
        "--log-level", "info",
        "--config-poll-s", str(poll_s),
        *extra,
    ]  # fmt: skip
    if redis_url:
        argv += ["--redis-url", redis_url]
    process = ManagedProcess(argv, log_dir / f"extproc-{port}.log", cwd=ROOT)
    process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
    return Processor(process, port, metrics_port)


def _headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        )
    )


def admit(port: int, api_key: str, model: str = "gpt-4.1") -> tuple[int, dict[str, Any]]:
    """Ask the processor to admit one chat request, as Envoy would (headers, then the body,
    then end of stream: the request is settled having delivered nothing).

    (200, the headers it sets upstream) when it was admitted; else the status and the JSON
    body of its local reply.
    """
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    requests = [
        pb.ProcessingRequest(
            request_headers=_headers(
                {
                    ":method": "POST",
                    ":path": "/v1/chat/completions",
                    "authorization": f"Bearer {api_key}",
                    "content-type": "application/json",
                }
            )
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(requests), timeout=30))
    for reply in replies:
        if reply.HasField("immediate_response"):
            return reply.immediate_response.status.code, orjson.loads(reply.immediate_response.body)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    mutation = replies[1].request_body.response.header_mutation
    return ADMITTED, {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def metric(processor: Processor, name: str) -> float:
    return processor.metrics().get(f"extproc_{name}", 0.0)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll an observable state; the deadline is generous, the condition is the assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def records(processor: Processor, event: str) -> list[dict[str, Any]]:
    return [r for r in processor.log_records() if r.get("event") == event]


class ConfigMapDir:
    """A directory laid out as the kubelet writes a mounted ConfigMap: ``quota.yaml`` ->
    ``..data/quota.yaml``, ``..data`` -> a timestamped directory; an update writes a new
    directory and renames a new ``..data`` symlink over the old one (one atomic step)."""

    def __init__(self, root: Path, doc: dict[str, Any]) -> None:
        self.root = root
        self.generation = 0
        root.mkdir(parents=True, exist_ok=True)
        self._write_generation(doc)
        (root / "quota.yaml").symlink_to("..data/quota.yaml")

    @property
    def path(self) -> Path:
        return self.root / "quota.yaml"

    def _write_generation(self, doc: dict[str, Any]) -> None:
        self.generation += 1
        target = self.root / f"..2026_12_01_{self.generation:04d}"
        target.mkdir()
        (target / "quota.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(target.name)
        os.replace(tmp, self.root / "..data")

    def update(self, doc: dict[str, Any]) -> None:
        self._write_generation(doc)
