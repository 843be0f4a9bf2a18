"""TTFT at one stream, hop by hop: what each ext_proc phase adds, by Envoy's own clock.

Issue 24's target 4 is "TTFT added at 1 stream ≤ Envoy alone + 1 ms while the tenant has
room". This splits that figure by phase. Five routes over one llmsim (no TTFT of its own,
8-token answers) are run one request at a time, in alternating rounds (ABCD, DCBA, …), so
a change in the machine's load hits every route alike:

* ``envoy``: Envoy without ext_proc, the baseline;
* ``noop``: Envoy + the no-op FDX processor (``loadlab.noop_processor``): the grpc.aio floor;
* ``billing``: Envoy + this processor on a real redis-server (one admit round trip);
* ``leases``: the same with ``admission_leases`` on (admitted from a block held in process);
* ``noop-body-only``: the no-op with both header phases skipped (``SKIP``), what a processor
  reads of them given as attributes on the body messages instead (the path, the method and
  the API key; the status): what two round trips fewer would buy.

Per route: time to the first body byte (TTFB) at the client, p50 over the rounds, and what
it adds over ``envoy``; and Envoy's own per-phase latency of the ext_proc stream from its
access log (``%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:...)%``): request headers
(the first message, which opens the gRPC stream), request body (admission), response
headers (``noop-body-only``: the body alone, which opens the stream). ``--pin CPU`` runs
the processors alone on that CPU and everything else (this client, Envoy, llmsim, Redis) on
the others: a sidecar with a core of its own.

    .venv/bin/python benchmarks/bench_ttft_hops.py [--requests 300] [--rounds 4] [--pin 1]

About a minute on 2 cores. The figure is the p50 of ``leases`` minus ``envoy``; the
per-phase columns say where it goes.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
import yaml

from loadlab.figures import table
from loadlab.gateway import Processor, write_config
from loadlab.machine import pin_self, pinned
from loadlab.procs import StopStack
from loadlab.redis_server import RedisServer
from loadlab.rig import (
    BENCH_KEY,
    EXT_PROC_FILTER,
    MODEL,
    start_envoy,
    start_noop_processor,
    write_bench_config,
)
from loadlab.simulator import Simulator

ROUTES = ("envoy", "noop", "billing", "leases", "noop-body-only")
PHASES = {
    "request headers": "request_header_latency_us",
    "request body": "request_body_total_latency_us",
    "response headers": "response_header_latency_us",
}
# Both header phases skipped; what the processor needs of them rides on the body messages.
BODY_ONLY = {
    "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
    "request_attributes": [
        "request.path", "request.method", "request.headers['authorization']",
    ],
    "response_attributes": ["response.code"],
}  # fmt: skip
WARM_UP = 30  # requests per route before the rounds: connections, caches, the tenant's keys


@dataclass
class Route:
    name: str
    port: int
    access_log: Path
    ttfb_ms: list[float] = field(default_factory=list)
    sent: int = 0  # requests whose access-log lines are wanted (warm-up excluded)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=300, help="per route, over all rounds")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    p.add_argument("--pin", help="a CPU for the processors alone (the rest run elsewhere)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


# One JSON access-log line per request: the ext_proc filter's own timings.
PHASE_LOG = {
    "json_format": {
        **{key: f"%FILTER_STATE({EXT_PROC_FILTER}:FIELD:{key})%" for key in PHASES.values()},
        "status": "%RESPONSE_CODE%",
    }
}


def one_request(conn: http.client.HTTPConnection, body: bytes) -> float:
    """Time to the first byte of the response body (ms); reads the rest."""
    started = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        body,
        {"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"},
    )
    response = conn.getresponse()
    response.read(1)
    first = time.perf_counter()
    response.read()
    if response.status != 200:
        raise SystemExit(f"bench_ttft_hops: HTTP {response.status}")
    return (first - started) * 1e3


def phase_medians(route: Route) -> dict[str, float | None]:
    deadline = time.monotonic() + 5
    while True:
        lines = route.access_log.read_text().splitlines() if route.access_log.exists() else []
        if len(lines) >= route.sent + WARM_UP or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    records = [orjson.loads(line) for line in lines[WARM_UP:]]
    out: dict[str, float | None] = {}
    for phase, key in PHASES.items():
        values = [int(r[key]) for r in records if str(r.get(key, "-")).isdigit()]
        out[phase] = statistics.median(values) / 1e3 if values else None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin is not None:
        rest = [c for c in cpus if c != int(args.pin)]
        if not rest:
            raise SystemExit("bench_ttft_hops: --pin needs a second CPU for everything else")
        pin_self(",".join(map(str, rest)))  # children inherit it: Envoy, llmsim, Redis
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello to the gateway."}],
        }
    )
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ttft-hops-") as tmp, StopStack() as stops:
        logs = Path(tmp)
        redis = stops.push(RedisServer.start(logs / "redis"))
        url = f"redis://127.0.0.1:{redis.port}/0"
        plain = write_bench_config(logs / "billing.yaml", url)
        doc = yaml.safe_load(plain.read_text())
        leased = write_config(logs / "leases.yaml", {**doc, "admission_leases": {"enabled": True}})
        # No TTFT of its own and 1 ms per token: what is measured is the gateway's hop.
        no_ttft = ("--time-to-first-token", "0ms", "--inter-token-latency", "1ms")
        sim = stops.push(Simulator("fast.yaml", *no_ttft, log_dir=logs))
        noop, noop_port = start_noop_processor(logs, args.pin)
        stops.push(noop)
        prefix = pinned([], args.pin)
        billing = stops.push(Processor.start(plain, logs, url, prefix=prefix))
        leases = stops.push(Processor.start(leased, logs, url, prefix=prefix))
        routes: list[Route] = []
        ports = (None, noop_port, billing.port, leases.port, noop_port)
        for name, port in zip(ROUTES, ports, strict=True):
            ext_proc = BODY_ONLY if name == "noop-body-only" else None
            envoy, access_log = start_envoy(logs, port, sim.port, name, PHASE_LOG, ext_proc)
            stops.push(envoy)
            routes.append(Route(name, envoy.ports.listen, access_log))
        conns = {r.name: http.client.HTTPConnection("127.0.0.1", r.port) for r in routes}
        for r in routes:
            for _ in range(WARM_UP):
                one_request(conns[r.name], body)
        per_round = max(1, args.requests // args.rounds)
        for i in range(args.rounds):
            for r in routes if i % 2 == 0 else routes[::-1]:
                for _ in range(per_round):
                    r.ttfb_ms.append(one_request(conns[r.name], body))
                r.sent += per_round
        for c in conns.values():
            c.close()
        base = statistics.median(routes[0].ttfb_ms)
        rows = []
        summary: dict[str, Any] = {}
        for r in routes:
            p50 = statistics.median(r.ttfb_ms)
            phases = phase_medians(r) if r.name != "envoy" else dict.fromkeys(PHASES)
            summary[r.name] = {
                "requests": len(r.ttfb_ms),
                "ttfb_p50_ms": p50,
                "added_ms": p50 - base,
                "phases_ms": phases,
            }
            rows.append(
                [
                    r.name,
                    f"{p50:.2f}",
                    "-" if r.name == "envoy" else f"{p50 - base:+.2f}",
                    *("-" if v is None else f"{v:.2f}" for v in phases.values()),
                ]
            )
        # What the leases route measures: admissions from a block, no round trip.
        summary["leases"]["local_admissions"] = leases.metrics().get(
            "extproc_local_admissions_total", 0
        )
    where = f"processors alone on CPU {args.pin}" if args.pin is not None else "unpinned"
    print(
        f"TTFT hops at 1 stream: {args.rounds} rounds, {per_round} requests per route a round,"
        f" {where}; load average at start {load[0]:.2f}"
    )
    print(
        table(
            ["route", "TTFB p50 ms", "added ms", *(f"{p} ms (Envoy)" for p in PHASES)],
            rows,
        )
    )
    added = summary["leases"]["added_ms"]
    verdict = "met" if added <= 1.0 else "MISSED"
    print(f"TTFT added with admission leases ≤ Envoy alone + 1 ms: {verdict} ({added:+.2f} ms)")
    print(f"the no-op's own hop: {summary['noop']['added_ms']:+.2f} ms")
    print(f"… without its header phases: {summary['noop-body-only']['added_ms']:+.2f} ms")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps({"pin": args.pin, "load": load, "routes": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
