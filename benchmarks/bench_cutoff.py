"""How fast a budget cut-off stops the model: client end of stream → simulator abort.

One gateway (Envoy + billing processor + redis-server) in front of a simulator that is still
generating (inter-token latency 4 ms, far more tokens asked than the budget allows). Each
run gives a fresh tenant a 300-token budget, streams until the gateway ends the response,
then polls the simulator's /metrics until its `abort` count rises. The figure is the time
from the client reading the end of the response to the abort being visible.

    .venv/bin/python benchmarks/bench_cutoff.py [--runs 20]

Target (issue 5): the simulator reports the request aborted within 50 ms of the cut-off.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab.figures import fmt, percentile, verdict
from loadlab.gateway import http_get, key_hash, start_gateway, write_config
from loadlab.procs import StopStack
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import stream_http1

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 50.0


def tenant_key(name: str) -> str:
    return f"sk-bench-{name}"


def aborts(sim: Simulator) -> int:
    _, text = http_get(sim.url("/metrics"))
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finish_reason="abort"' in line
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-cutoff-"))
    tenants = {
        f"cut{i}": {"limits": {"*": {"tpm": 300}}, "batch_tokens": 32, "window_s": 3600}
        for i in range(args.runs)
    }
    delays: list[float] = []
    with StopStack() as stops:
        redis = stops.push(RedisServer.start(workdir / "redis"))
        sim = stops.push(
            Simulator(
                ROOT / "simulator_profiles" / "fast.yaml",
                "--inter-token-latency",
                "4ms",
                log_dir=workdir,
            )
        )
        config = write_config(
            workdir / "quota.yaml",
            {
                "redis_url": redis.url,
                "models": {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}},
                "plans": tenants,  # a plan per tenant, of its name
                "tenants": {
                    name: {"plan": name, "key_sha256": [key_hash(tenant_key(name))]}
                    for name in tenants
                },
            },
        )
        gateway = stops.push(start_gateway(config, workdir, [sim.port]))
        request = {
            "model": "gpt-4.1",
            "stream": True,
            "max_tokens": 3000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on and on"}],
        }
        for i in range(args.runs):
            before = aborts(sim)
            result = asyncio.run(
                stream_http1(
                    gateway.base_url + "/v1/chat/completions", tenant_key(f"cut{i}"), request
                )
            )
            ended = time.perf_counter()
            if result.error is None:
                raise SystemExit(f"run {i}: the stream was not cut off")
            while aborts(sim) == before:
                if time.perf_counter() - ended > 5:
                    raise SystemExit(f"run {i}: no abort within 5 s")
            delays.append((time.perf_counter() - ended) * 1000)
    p50, p99 = percentile(delays, 50), percentile(delays, 99)
    print(
        f"cut-off → simulator abort over {args.runs} runs: p50 {fmt(p50, 2)} ms, "
        f"p99 {fmt(p99, 2)} ms, max {fmt(max(delays), 2)} ms "
        f"(includes one /metrics poll, ~1 ms)"
    )
    print(f"target ≤ {TARGET_MS:.0f} ms: {verdict(max(delays) <= TARGET_MS)}")


if __name__ == "__main__":
    main()
