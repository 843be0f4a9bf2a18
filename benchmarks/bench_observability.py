"""What metrics and tracing cost per body message: the processor without them, with metrics
(tracing off, the default), and with tracing on, side by side in one run.

The per-chunk load of ``bench_processor_throughput`` (``loadlab.grpc_load``: Envoy's part, one
FDX body message per token, the processor pinned to core 0 and the clients to core 1)
against three processors:

* ``baseline``: the processor before metrics and tracing existed (``--baseline-ref``, by
  default the commit before they landed), checked out into a temporary git worktree;
* ``metrics``: this checkout, tracing off;
* ``tracing``: this checkout with ``OTEL_TRACES_EXPORTER=otlp`` exporting every span to a
  sink in this process (it answers 200 and counts requests; the SDK's batch exporter
  runs in the processor's own thread, so its cost is in the processor's CPU).

The phases alternate ``--rounds`` times; each figure is body messages per processor
CPU-second, and the ratios against ``baseline`` are the rounds' medians.

    .venv/bin/python benchmarks/bench_observability.py [--quick] [--rounds 3]
        [--baseline-ref 3b2c2bf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab.figures import fmt, ratio, table
from loadlab.gateway import grpc_serving
from loadlab.grpc_load import BATCH, Phase, cores, load_args, load_arguments, run_phase
from loadlab.machine import pinned
from loadlab.procs import ManagedProcess, StopStack, free_port
from loadlab.redis_server import RedisServer
from loadlab.rig import ROOT, write_bench_config

# The last commit before the processor had prometheus_client metrics and tracing.
BASELINE_REF = "3b2c2bf"


class Sink:
    """An OTLP/HTTP endpoint that reads and acknowledges every export."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers["Content-Length"])
                self.rfile.read(n)
                sink.requests += 1
                sink.bytes += n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_processor(
    cwd: Path, config: Path, log_dir: Path, cpus: str | None, env: dict[str, str] | None = None
) -> tuple[ManagedProcess, int]:
    port = free_port()
    argv = [
        sys.executable, "-m", "extproc", "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
    ]  # fmt: skip
    process = ManagedProcess(
        pinned(argv, cpus), log_dir / f"extproc-{cwd.name}-{port}.log", cwd=cwd, env=env
    )
    process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
    return process, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    load_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    args = load_args(parser)
    server_cpus, client_cpus = cores()

    workdir = Path(tempfile.mkdtemp(prefix="bench-observability-"))
    baseline_tree = workdir / "baseline"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline_tree),
         args.baseline_ref],
        check=True, capture_output=True,
    )  # fmt: skip
    with StopStack() as stops:
        stops.call(
            lambda: subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline_tree)],
                check=False,
                capture_output=True,
            )
        )
        sink = stops.push(Sink())
        redis = stops.push(RedisServer.start(workdir / "redis"))
        config = write_bench_config(workdir / "quota.yaml", redis.url, batch_tokens=BATCH)
        tracing_env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink.port}/v1/traces",
        }
        processors: list[tuple[str, ManagedProcess, int]] = []
        for name, cwd, env in (
            ("baseline", baseline_tree, None),
            ("metrics", ROOT, None),
            ("tracing", ROOT, tracing_env),
        ):
            process, port = start_processor(cwd, config, workdir, server_cpus, env)
            stops.push(process)
            processors.append((name, process, port))
        print(
            f"observability cost: {args.clients} clients × {args.streams} streams, "
            f"{args.tokens} chunks per response, batch {BATCH}; baseline = "
            f"{args.baseline_ref}; load average {os.getloadavg()[0]:.1f}; logs in {workdir}",
            flush=True,
        )
        rounds: list[dict[str, Phase]] = []
        for r in range(args.rounds):
            phases: dict[str, Phase] = {}
            for name, process, port in processors:
                phases[name] = run_phase(name, port, process.pid, args, client_cpus)
                print(
                    f"  round {r + 1} {name}: {phases[name].per_cpu_s:,.0f} msg per CPU-s",
                    flush=True,
                )
            rounds.append(phases)
    rows = []
    for name in ("baseline", "metrics", "tracing"):
        per_cpu = [r[name].per_cpu_s for r in rounds]
        ratios = [ratio(r[name].per_cpu_s, r["baseline"].per_cpu_s) for r in rounds]
        errors = sum(r[name].errors for r in rounds)
        rows.append(
            [
                name,
                fmt(statistics.median(per_cpu)),
                " / ".join(f"{x:.2f}" for x in ratios),
                f"{statistics.median(ratios):.2f}×",
                str(errors),
            ]
        )
    print()
    print(
        table(
            ["processor", "msg per CPU-s (median)", "ratio per round", "median ratio", "errors"],
            rows,
        )
    )
    print(f"\nspans exported to the sink: {sink.requests:,} requests, {sink.bytes:,} bytes")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
