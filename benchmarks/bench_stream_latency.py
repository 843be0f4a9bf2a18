"""Per-chunk latency the gateway adds to a stream: Envoy alone, + no-op FDX, + billing.

Four paths to one llmsim with a fixed inter-token latency (ITL, no jitter), side by side in
one run, at 1, 50 and 200 concurrent streams:

    direct         client → simulator
    envoy          client → Envoy (ext_proc filter removed) → simulator
    envoy+noop     client → Envoy + benchmarks/noop_processor.py → simulator
    envoy+billing  client → Envoy + our processor (incremental, batch 32, Redis) → simulator

How a chunk's latency is measured without a send stamp in the chunk: the simulator paces
events by deadline, so token event i leaves at ``T0 + i × ITL`` where T0 is when it got
the request. The client notes each event's arrival; its *lateness* is
``arrival − anchor − i × ITL``, where the anchor is the moment the simulator was sent the
request — the client's own send time when direct, and Envoy's "request fully written
upstream" time (from its access log: start time + DS_RX_BEG→US_TX_END) otherwise. The
request path (admission included) is therefore *not* in the figure; it is shown apart.
Lateness holds the same simulator-side costs on every path, so a path's *added* latency is
its lateness percentile minus the direct path's (p50 − p50, p99 − p99). All clocks are
the machine's wall clock, read by this process and by Envoy.

    .venv/bin/python benchmarks/bench_stream_latency.py [--quick] [--itl-ms 10] [--tokens 100]

Target (issue 5): billing's added latency ≤ 1.25 × the no-op processor's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import fmt, percentile, ratio, table
from benchmarks.rig import (
    BENCH_KEY,
    MODEL,
    start_billing_processor,
    start_envoy,
    start_noop_processor,
    upstream_sent_at,
    write_bench_config,
)
from benchmarks.timed_sse_client import TimedStream, chat_request, timed_stream
from tests.support.redis_server import RedisServer
from tests.support.simulator import Simulator

TARGET_RATIO = 1.25
PATHS = ("direct", "envoy", "envoy+noop", "envoy+billing")
MESSAGES = [{"role": "user", "content": "Write a long story about token budgets."}]


@dataclass
class Route:
    """One way from the client to the simulator."""

    name: str
    port: int
    access_log: Path | None  # None: the client talks to the simulator itself


@dataclass
class LevelResult:
    streams: int
    path: str
    lateness_us: list[float] = field(default_factory=list)
    request_path_us: list[float] = field(default_factory=list)
    failed: int = 0
    chunks: int = 0


def stream_payload(tokens: int) -> dict:
    return {
        "model": MODEL,
        "stream": True,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "ignore_eos": True,  # exactly `tokens` token events, one per ITL
    }


async def run_level(
    route: Route, streams: int, rounds: int, tokens: int, itl_s: float, tag: str
) -> list[TimedStream]:
    """``streams`` clients, each running ``rounds`` streams back to back."""
    payload = stream_payload(tokens)
    rng = random.Random(streams)
    results: list[TimedStream] = []

    async def client(index: int) -> None:
        # Spread the starts over one ITL: real streams don't emit in lockstep.
        await asyncio.sleep(rng.uniform(0, itl_s))
        for r in range(rounds):
            rid = f"{tag}-{route.name}-{streams}-{index}-{r}"
            request = chat_request("/v1/chat/completions", payload, rid, BENCH_KEY)
            results.append(await timed_stream(route.port, request, rid))

    await asyncio.gather(*(client(i) for i in range(streams)))
    return results


def measure(
    route: Route, results: list[TimedStream], streams: int, tokens: int, itl_s: float
) -> LevelResult:
    anchors: dict[str, float] = {}
    if route.access_log is not None:
        anchors = upstream_sent_at(route.access_log, [r.request_id for r in results])
    level = LevelResult(streams, route.name)
    for stream in results:
        ok = stream.status == 200 and stream.complete and len(stream.arrivals) == tokens
        anchor = stream.sent_at if route.access_log is None else anchors.get(stream.request_id)
        if not ok or anchor is None:
            level.failed += 1
            continue
        level.request_path_us.append((anchor - stream.sent_at) * 1e6)
        for i, arrived in enumerate(stream.arrivals):
            level.lateness_us.append((arrived - anchor - i * itl_s) * 1e6)
        level.chunks += len(stream.arrivals)
    return level


def report(levels: list[LevelResult], itl_ms: float, tokens: int) -> None:
    print(
        f"\nPer-chunk latency, simulator ITL {itl_ms:g} ms (no jitter), {tokens} token events "
        "per stream. Lateness = arrival − (simulator got the request + i × ITL);\n"
        "added = lateness percentile − the direct path's at the same concurrency. µs.\n"
    )
    rows = []
    by_key = {(lv.streams, lv.path): lv for lv in levels}
    for lv in levels:
        base = by_key[(lv.streams, "direct")]
        p50, p99 = percentile(lv.lateness_us, 50), percentile(lv.lateness_us, 99)
        b50, b99 = percentile(base.lateness_us, 50), percentile(base.lateness_us, 99)
        request_path = fmt(percentile(lv.request_path_us, 50), 0) if lv.path != "direct" else "-"
        rows.append(
            [
                str(lv.streams), lv.path, f"{lv.chunks:,}", str(lv.failed),
                fmt(p50, 0), fmt(p99, 0),
                fmt(p50 - b50, 0) if lv.path != "direct" else "-",
                fmt(p99 - b99, 0) if lv.path != "direct" else "-",
                request_path,
            ]
        )  # fmt: skip
    print(
        table(
            [
                "streams", "path", "chunks", "failed", "lateness p50", "lateness p99",
                "added p50", "added p99", "request path p50",
            ],
            rows,
        )
    )  # fmt: skip
    print(f"\nBilling vs no-op processor, added latency (target ≤ {TARGET_RATIO}×):\n")
    ratio_rows = []
    for streams in sorted({lv.streams for lv in levels}):
        direct, plain = by_key[(streams, "direct")], by_key[(streams, "envoy")]
        noop, billing = by_key[(streams, "envoy+noop")], by_key[(streams, "envoy+billing")]
        cells = [str(streams)]
        for p in (50, 99):
            base = percentile(direct.lateness_us, p)
            added_noop = percentile(noop.lateness_us, p) - base
            added_billing = percentile(billing.lateness_us, p) - base
            # Also against Envoy alone: what the processor hop itself costs.
            hop_noop = percentile(noop.lateness_us, p) - percentile(plain.lateness_us, p)
            hop_billing = percentile(billing.lateness_us, p) - percentile(plain.lateness_us, p)
            r = ratio(added_billing, added_noop)
            cells += [
                fmt(added_noop, 0), fmt(added_billing, 0), fmt(r, 2) + "×",
                fmt(ratio(hop_billing, hop_noop), 2) + "×",
            ]  # fmt: skip
        ratio_rows.append(cells)
    print(
        table(
            [
                "streams",
                "noop +p50", "billing +p50", "ratio p50", "hop ratio p50",
                "noop +p99", "billing +p99", "ratio p99", "hop ratio p99",
            ],
            ratio_rows,
        )
    )  # fmt: skip
    print(
        "\n(+pNN: added vs direct, µs. 'hop ratio' compares lateness minus Envoy-alone's, "
        "i.e. the processor hop only.)"
    )


async def run_all(
    routes: list[Route], levels: list[int], rounds: dict[int, int], tokens: int, itl_s: float
) -> list[LevelResult]:
    """Round by round, every route in turn: a change in the machine's other load while a
    level runs then hits all four routes alike instead of whichever ran at that moment."""
    tag = uuid.uuid4().hex[:8]
    for route in routes:  # warm connection pools, tokenizers, Redis scripts
        await run_level(route, 4, 1, 8, itl_s, f"{tag}-warm")
    out: list[LevelResult] = []
    for streams in levels:
        started = time.monotonic()
        gathered: dict[str, list[TimedStream]] = {route.name: [] for route in routes}
        for r in range(rounds[streams]):
            for route in routes:
                gathered[route.name] += await run_level(
                    route, streams, 1, tokens, itl_s, f"{tag}-r{r}"
                )
        for route in routes:
            level = measure(route, gathered[route.name], streams, tokens, itl_s)
            out.append(level)
        print(
            f"  {streams:>3} streams: {rounds[streams]} round(s) × {len(routes)} routes in "
            f"{time.monotonic() - started:5.1f}s, failed "
            + ", ".join(f"{lv.path} {lv.failed}" for lv in out[-len(routes) :]),
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter streams")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="simulator inter-token latency")
    parser.add_argument("--tokens", type=int, default=100, help="token events per stream")
    parser.add_argument("--levels", default="1,50,200", help="concurrent streams, comma-separated")
    args = parser.parse_args()
    tokens = 40 if args.quick else args.tokens
    levels = [int(x) for x in args.levels.split(",")]
    # Enough streams per level for a stable p99 without a long run.
    rounds = {n: (3 if args.quick else 8) if n == 1 else (1 if args.quick else 2) for n in levels}
    itl_s = args.itl_ms / 1000

    workdir = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    stoppers: list[Callable[[], int]] = []  # stop by PID, newest first
    try:
        redis = RedisServer.start(workdir / "redis")
        stoppers.append(redis.stop)
        sim = Simulator(
            "fast.yaml",
            "--inter-token-latency", f"{args.itl_ms}ms",
            "--inter-token-latency-std-dev", "0ms",
            "--time-to-first-token", "0ms",
            log_dir=workdir,
        )  # fmt: skip
        stoppers.append(sim.stop)
        noop, noop_port = start_noop_processor(workdir)
        stoppers.append(noop.stop)
        config = write_bench_config(workdir / "quota.yaml", redis.url, batch_tokens=32)
        billing = start_billing_processor(config, workdir, redis.url)
        stoppers.append(billing.stop)
        routes = [Route("direct", sim.port, None)]
        for name, processor_port in (
            ("envoy", None),
            ("envoy+noop", noop_port),
            ("envoy+billing", billing.port),
        ):
            envoy, access_log = start_envoy(
                workdir, processor_port, sim.port, name.replace("+", "-")
            )
            stoppers.append(envoy.stop)
            routes.append(Route(name, envoy.ports.listen, access_log))
        print(
            f"stream latency benchmark: levels {levels}, ITL {args.itl_ms:g} ms, "
            f"{tokens} tokens/stream, load average {os.getloadavg()[0]:.1f}, logs in {workdir}",
            flush=True,
        )
        results = asyncio.run(run_all(routes, levels, rounds, tokens, itl_s))
        metrics = billing.metrics()
        report(results, args.itl_ms, tokens)
        events = metrics.get("extproc_events_total", 0)
        waited = metrics.get("extproc_events_waited_total", 0)
        print(
            f"\nbilling processor during the run: {int(events):,} events, "
            f"{int(waited):,} waited on Redis ({fmt(100 * ratio(waited, events), 3)}%), "
            f"{int(metrics.get('extproc_cutoffs_total', 0))} cut-offs; "
            f"load average at the end {os.getloadavg()[0]:.1f}"
        )
    finally:
        for stop in reversed(stoppers):
            stop()


if __name__ == "__main__":
    main()
