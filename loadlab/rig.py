"""The parts the gateway benchmarks start: processors, Envoy variants, their configs.

Everything listens on a free loopback port and is a ``ManagedProcess`` (stopped by PID), as
in the gateway tests; the pieces only benchmarks need (CPU pinning, a no-op processor, an
Envoy without ext_proc, an access log with upstream timings) live here; pinning and CPU
time in ``loadlab.machine``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from loadlab.gateway import (
    Envoy,
    Processor,
    grpc_serving,
    key_hash,
    write_config,
)
from loadlab.machine import pinned
from loadlab.procs import ManagedProcess, free_port, free_ports
from stack.envoy import EnvoyPorts, render_bootstrap

ROOT = Path(__file__).resolve().parents[1]
BENCH_TENANT = "bench"
BENCH_KEY = "sk-bench-tenant"
# Roomy: the benchmarks measure the processor's cost, never a refusal or a cut-off.
ROOMY = 10**12
MODEL = "gpt-4.1"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
MODELS: dict[str, Any] = {
    MODEL: {
        "aliases": ["gpt-4.1-2025-04-14", "my-gpt-alias"],
        "tokenizer": "o200k_base",
        "max_tokens": 8192,
        "default_max_tokens": 256,
    }
}
# Envoy access-log line per request: its x-request-id, when Envoy started receiving it
# (wall clock, µs) and how long until the request was fully written upstream (µs). The
# sum is the moment the simulator got the request, on the client's clock.
FILE_ACCESS_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
ACCESS_LOG_FORMAT = (
    "%REQ(X-REQUEST-ID)% %START_TIME(%s.%6f)% %COMMON_DURATION(DS_RX_BEG:US_TX_END:us)%\n"
)


def write_bench_config(path: Path, redis_url: str, batch_tokens: int = 32) -> Path:
    """One tenant on an incremental plan whose limits are never reached."""
    return write_config(
        path,
        {
            "redis_url": redis_url,
            "models": MODELS,
            "plans": {
                "roomy": {
                    "window_s": 3600,
                    "limits": {"*": {"rpm": ROOMY, "tpm": ROOMY}},
                    "charge_mode": "incremental",
                    "batch_tokens": batch_tokens,
                }
            },
            "tenants": {BENCH_TENANT: {"plan": "roomy", "key_sha256": [key_hash(BENCH_KEY)]}},
            "stream_idle_timeout_s": 120,
        },
    )


def start_billing_processor(
    config_path: Path,
    log_dir: Path,
    redis_url: str,
    cpus: str | None = None,
    loop: str | None = None,
    grpc_threads: str | None = None,
) -> Processor:
    prefix = pinned([], cpus)
    return Processor.start(
        config_path, log_dir, redis_url, prefix=prefix, loop=loop, grpc_threads=grpc_threads
    )


def start_noop_processor(
    log_dir: Path,
    cpus: str | None = None,
    loop: str | None = None,
    grpc_threads: str | None = None,
) -> tuple[ManagedProcess, int]:
    port = free_port()
    argv = [sys.executable, "-m", "loadlab.noop_processor", "--listen", f"127.0.0.1:{port}"]
    if loop is not None:
        argv += ["--loop", loop]
    if grpc_threads is not None:
        argv += ["--grpc-threads", grpc_threads]
    process = ManagedProcess(pinned(argv, cpus), log_dir / f"noop-{port}.log", cwd=ROOT)
    try:
        process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
    except BaseException:
        process.stop()
        raise
    return process, port


def bootstrap(
    ports: EnvoyPorts,
    processor_port: int | None,
    backend_port: int,
    access_log: Path,
    log_format: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The project's bootstrap, plus an access log (``log_format``, an Envoy
    ``SubstitutionFormatString``; None: ``ACCESS_LOG_FORMAT``); without ext_proc when no
    processor."""
    # Without a processor the ext_proc cluster still needs an endpoint to be valid YAML;
    # nothing ever connects to it once the filter is gone.
    doc = yaml.safe_load(render_bootstrap(ports, [processor_port or free_port()], [backend_port]))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if processor_port is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC_FILTER]
    hcm["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": FILE_ACCESS_LOG_TYPE,
                "path": str(access_log),
                "log_format": log_format
                or {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
            },
        }
    ]
    return doc


def start_envoy(
    log_dir: Path,
    processor_port: int | None,
    backend_port: int,
    name: str,
    log_format: dict[str, Any] | None = None,
    ext_proc: dict[str, Any] | None = None,
) -> tuple[Envoy, Path]:
    """An Envoy in front of ``backend_port``; returns it and its access-log path.

    ``ext_proc``: keys set over the ext_proc filter's config (a processing mode of its own,
    attributes), each ``processing_mode`` key over the project's."""
    ports = EnvoyPorts(*free_ports(2))
    access_log = log_dir / f"access-{name}.log"
    config_path = log_dir / f"envoy-{name}.yaml"
    doc = bootstrap(ports, processor_port, backend_port, access_log, log_format)
    if ext_proc is not None:
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        [wrapper] = [f for f in hcm["typed_config"]["http_filters"] if f["name"] == EXT_PROC_FILTER]
        config = wrapper["typed_config"]["extension_config"]["typed_config"]
        for key, value in ext_proc.items():
            if key == "processing_mode":
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    config_path.write_text(yaml.safe_dump(doc))
    # Access-log lines are read right after each run: flush them every 100 ms, not 10 s.
    envoy = Envoy.launch(
        config_path, ports, log_dir / f"envoy-{name}.log", "--file-flush-interval-msec", "100"
    )
    return envoy, access_log


def upstream_sent_at(
    access_log: Path, request_ids: Collection[str], timeout_s: float = 5.0
) -> dict[str, float]:
    """x-request-id → wall-clock time Envoy finished writing the request upstream (s).

    Envoy flushes access logs about once a second, so this waits (up to ``timeout_s``)
    until every one of ``request_ids`` has its line.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        out = _read_access_log(access_log)
        if all(rid in out for rid in request_ids) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _read_access_log(access_log: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    if not access_log.exists():
        return out
    for line in access_log.read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[2].isdigit():
            continue  # a request that never reached the upstream ("-")
        out[parts[0]] = float(parts[1]) + int(parts[2]) / 1e6
    return out
