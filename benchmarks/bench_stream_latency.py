"""What the gateway adds to a stream: Envoy alone, + no-op FDX, + billing, vs direct.

Four paths to one llmsim with a fixed inter-token latency (ITL, no jitter) and no
time-to-first-token of its own, side by side in one run, at 1, 10, 50 and 200 concurrent
streams (``--levels``):

    direct         client → simulator
    envoy          client → Envoy (ext_proc filter removed) → simulator
    envoy+noop     client → Envoy + benchmarks/noop_processor.py → simulator
    envoy+billing  client → Envoy + our processor (incremental, batch 32, Redis) → simulator

Each level runs in rounds, every route in turn within a round (``streams`` clients at once,
their starts spread over one ITL), so a change in the machine's other load hits all four
alike. A level has at least ``--min-streams`` streams per route (more rounds at low
concurrency) so the per-stream percentiles rest on enough samples. All clocks are the
machine's wall clock, read by this process and by Envoy; the client (a raw-socket HTTP/1.1
reader, ``timed_sse_client.py``) notes its send time right before the request's one write
and each token event's arrival in ``data_received``. Only streams that finished with every
token event count (``failed`` = the others: error status, cut short, timed out, or, on
an Envoy route, no access-log line).

Figures, each per route and level:

* **Per-chunk lateness and added latency** (µs). Without a send stamp in the chunk: the
  simulator paces events by deadline, so token event i leaves at ``T0 + i × ITL``, T0 being
  when it got the request. Lateness is ``arrival − anchor − i × ITL``, the anchor being the
  moment the simulator was sent the request — the client's send time when direct, Envoy's
  "request fully written upstream" time (access log: start time + DS_RX_BEG→US_TX_END)
  otherwise — so the request path is kept out of it. *Added* = lateness percentile minus
  the direct path's at the same level (p50 − p50, p99 − p99); the "hop ratio" uses
  lateness minus Envoy-alone's, i.e. the processor hop only. Target (issue 5): billing's
  added latency ≤ 1.25 × the no-op processor's.
* **Time to first token** (ms): first token event's arrival − the client's send time,
  p50/p99, and *TTFT added* = that percentile minus the direct route's (admission, the
  request and first-response path through Envoy and the processor). Compared: billing's
  added TTFT over the no-op's (ratio) and billing − Envoy alone (ms, what the processor
  costs the first token). *Request path p50* (ms): client send → Envoy finished writing
  the request upstream (access log), the request half of the TTFT.
* **Stream duration** (ms): last token event's arrival − send, p50/p99 (nominally
  ``(tokens − 1) × ITL`` plus TTFT); **inter-chunk gap**: ``arrival[i] − arrival[i−1]``
  pooled over every stream, p50/p99 (nominally one ITL; events read in one
  ``data_received`` count a 0 gap). Ratios to Envoy alone at the same level; target
  (issue 10): billing ≤ 1.1 × Envoy alone's, end-to-end p99 and gap p99 both.
* **CPU share**: CPU seconds (user + system, ``/proc/PID/stat``, all threads) used while
  the route's streams ran, over the wall time they ran, in % of one core — for this client
  process, the simulator, the route's Envoy and its processor (no-op or billing) — and the
  whole machine's busy share of all its cores (``/proc/stat``; other tenants' load
  included), so a saturated process or machine is visible next to the latencies.

``--find-ceiling`` runs, instead, only Envoy alone and Envoy + billing at rising levels
(``--ceiling-levels``, default 10, 25, 50, 75, 100, 150, 200, 300, 400) at the given ITL,
and stops at the first level where billing's end-to-end p99 passes 1.1 × Envoy alone's,
the billing processor's CPU share passes 90 % of one core, or a stream fails — each checked
twice (a level that trips is run once more and stops the search only if it trips again, so
a burst of other load on the shared machine doesn't end it). The ceiling is the last level
that passed, given as streams × chunks/s (chunks/s = streams / ITL), with what stopped it.

    .venv/bin/python benchmarks/bench_stream_latency.py [--quick] [--itl-ms 10] [--tokens 100]
        [--levels 1,10,50,200] [--min-streams 40]
    .venv/bin/python benchmarks/bench_stream_latency.py --find-ceiling [--itl-ms 10]
        [--ceiling-levels 10,25,50,75,100,150,200,300,400]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
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

from benchmarks.report import fmt, percentile, ratio, table, verdict
from loadlab.client import TimedStream, chat_request, timed_stream
from loadlab.redis_server import RedisServer
from loadlab.rig import (
    BENCH_KEY,
    MODEL,
    cpu_seconds,
    start_billing_processor,
    start_envoy,
    start_noop_processor,
    upstream_sent_at,
    write_bench_config,
)
from loadlab.simulator import Simulator

TARGET_RATIO = 1.25  # per-chunk added latency, billing / no-op (issue 5)
TARGET_SLOWDOWN = 1.1  # end-to-end p99 and gap p99, billing / Envoy alone (issue 10)
CEILING_CPU_SHARE = 0.90  # of one core: the billing processor counts as saturated past it
PATHS = ("direct", "envoy", "envoy+noop", "envoy+billing")
ROLES = ("client", "simulator", "envoy", "processor")
CEILING_LEVELS = "10,25,50,75,100,150,200,300,400"
MESSAGES = [{"role": "user", "content": "Write a long story about token budgets."}]


@dataclass
class Route:
    """One way from the client to the simulator, and the PIDs whose CPU it uses."""

    name: str
    port: int
    access_log: Path | None  # None: the client talks to the simulator itself
    pids: dict[str, int]  # role → PID: client and simulator always, envoy/processor if any


@dataclass
class Usage:
    """CPU used while one route's streams ran, summed over its rounds."""

    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # role → CPU seconds
    machine_busy: int = 0  # jiffies, all cores
    machine_total: int = 0

    def share(self, role: str) -> float:
        """CPU seconds per wall second (1.0 = one core); NaN if the route has no such part."""
        if role not in self.cpu_s:
            return math.nan
        return ratio(self.cpu_s[role], self.wall_s)

    def machine_share(self) -> float:
        return ratio(self.machine_busy, self.machine_total)


@dataclass
class LevelResult:
    streams: int
    path: str
    lateness_us: list[float] = field(default_factory=list)  # per chunk
    request_path_us: list[float] = field(default_factory=list)  # per stream
    ttft_us: list[float] = field(default_factory=list)  # per stream
    e2e_us: list[float] = field(default_factory=list)  # per stream
    gap_us: list[float] = field(default_factory=list)  # per chunk but the first
    failed: int = 0
    measured: int = 0  # streams that finished with every token event
    chunks: int = 0
    usage: Usage = field(default_factory=Usage)


def stream_payload(tokens: int) -> dict:
    return {
        "model": MODEL,
        "stream": True,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "ignore_eos": True,  # exactly `tokens` token events, one per ITL
    }


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait; guest time is already inside user
    return sum(values) - idle, sum(values)


def snapshot(pids: dict[str, int]) -> tuple[float, dict[str, float], tuple[int, int]]:
    return time.monotonic(), {r: cpu_seconds(p) for r, p in pids.items()}, machine_jiffies()


async def run_level(
    route: Route,
    streams: int,
    tokens: int,
    itl_s: float,
    tag: str,
    usage: Usage | None = None,
) -> list[TimedStream]:
    """``streams`` clients at once, one stream each; their CPU use is added to ``usage``."""
    payload = stream_payload(tokens)
    rng = random.Random(streams)
    timeout_s = 30 + 10 * tokens * itl_s
    results: list[TimedStream] = []

    async def client(index: int) -> None:
        # Spread the starts over one ITL: real streams don't emit in lockstep.
        await asyncio.sleep(rng.uniform(0, itl_s))
        rid = f"{tag}-{route.name}-{streams}-{index}"
        request = chat_request("/v1/chat/completions", payload, rid, BENCH_KEY)
        try:
            results.append(await timed_stream(route.port, request, rid, timeout_s))
        except OSError:
            results.append(TimedStream(rid))  # could not connect: a failed stream

    before = snapshot(route.pids)
    await asyncio.gather(*(client(i) for i in range(streams)))
    after = snapshot(route.pids)
    if usage is not None:
        usage.wall_s += after[0] - before[0]
        for role in route.pids:
            usage.cpu_s[role] = usage.cpu_s.get(role, 0.0) + after[1][role] - before[1][role]
        usage.machine_busy += after[2][0] - before[2][0]
        usage.machine_total += after[2][1] - before[2][1]
    return results


def measure(
    route: Route,
    results: list[TimedStream],
    streams: int,
    tokens: int,
    itl_s: float,
    usage: Usage,
) -> LevelResult:
    anchors: dict[str, float] = {}
    if route.access_log is not None:
        anchors = upstream_sent_at(route.access_log, [r.request_id for r in results])
    level = LevelResult(streams, route.name, usage=usage)
    for stream in results:
        ok = stream.status == 200 and stream.complete and len(stream.arrivals) == tokens
        anchor = stream.sent_at if route.access_log is None else anchors.get(stream.request_id)
        if not ok or anchor is None:
            level.failed += 1
            continue
        arrivals = stream.arrivals
        level.measured += 1
        level.request_path_us.append((anchor - stream.sent_at) * 1e6)
        level.ttft_us.append((arrivals[0] - stream.sent_at) * 1e6)
        level.e2e_us.append((arrivals[-1] - stream.sent_at) * 1e6)
        for i, arrived in enumerate(arrivals):
            level.lateness_us.append((arrived - anchor - i * itl_s) * 1e6)
        level.gap_us.extend((b - a) * 1e6 for a, b in itertools.pairwise(arrivals))
        level.chunks += len(arrivals)
    return level


async def run_rounds(
    routes: list[Route], streams: int, rounds: int, tokens: int, itl_s: float, tag: str
) -> list[LevelResult]:
    """``rounds`` rounds of ``streams`` streams, every route in turn within each round."""
    gathered: dict[str, list[TimedStream]] = {route.name: [] for route in routes}
    usage = {route.name: Usage() for route in routes}
    for r in range(rounds):
        for route in routes:
            gathered[route.name] += await run_level(
                route, streams, tokens, itl_s, f"{tag}-r{r}", usage[route.name]
            )
    return [
        measure(route, gathered[route.name], streams, tokens, itl_s, usage[route.name])
        for route in routes
    ]


async def warm(routes: list[Route], itl_s: float, tag: str) -> None:
    for route in routes:  # connection pools, tokenizers, Redis scripts
        await run_level(route, 4, 8, itl_s, f"{tag}-warm")


async def run_all(
    routes: list[Route],
    levels: list[int],
    rounds_for: Callable[[int], int],
    tokens: int,
    itl_s: float,
) -> list[LevelResult]:
    tag = uuid.uuid4().hex[:8]
    await warm(routes, itl_s, tag)
    out: list[LevelResult] = []
    for streams in levels:
        started = time.monotonic()
        rounds = rounds_for(streams)
        level = await run_rounds(routes, streams, rounds, tokens, itl_s, f"{tag}-{streams}")
        out += level
        print(
            f"  {streams:>3} streams: {rounds} round(s) × {len(routes)} routes in "
            f"{time.monotonic() - started:5.1f}s, failed "
            + ", ".join(f"{lv.path} {lv.failed}" for lv in level),
            flush=True,
        )
    return out


# ---------------------------------------------------------------------------- report


def ms(us: float, digits: int = 2) -> str:
    return fmt(us / 1000, digits)


def times(value: float) -> str:
    return fmt(value, 2) + "×"


def pct(share: float) -> str:
    return fmt(100 * share, 0) + "%"


def p(samples: list[float], q: float) -> float:
    return percentile(samples, q)


def report_chunks(by_key: dict[tuple[int, str], LevelResult], levels: list[int]) -> None:
    print(
        "\nPer-chunk latency. Lateness = arrival − (simulator got the request + i × ITL); "
        "added = lateness percentile − the direct path's at the same concurrency. µs.\n"
    )
    rows = []
    for streams in levels:
        base = by_key[(streams, "direct")]
        b50, b99 = p(base.lateness_us, 50), p(base.lateness_us, 99)
        for path in PATHS:
            lv = by_key[(streams, path)]
            p50, p99 = p(lv.lateness_us, 50), p(lv.lateness_us, 99)
            direct = path == "direct"
            rows.append(
                [
                    str(streams), path, f"{lv.chunks:,}", str(lv.failed),
                    fmt(p50, 0), fmt(p99, 0),
                    "-" if direct else fmt(p50 - b50, 0),
                    "-" if direct else fmt(p99 - b99, 0),
                ]
            )  # fmt: skip
    print(
        table(
            [
                "streams", "path", "chunks", "failed", "lateness p50", "lateness p99",
                "added p50", "added p99",
            ],
            rows,
        )
    )  # fmt: skip
    print(f"\nBilling vs no-op processor, per-chunk added latency (target ≤ {TARGET_RATIO}×):\n")
    ratio_rows = []
    for streams in levels:
        direct, plain = by_key[(streams, "direct")], by_key[(streams, "envoy")]
        noop, billing = by_key[(streams, "envoy+noop")], by_key[(streams, "envoy+billing")]
        cells = [str(streams)]
        for q in (50, 99):
            base = p(direct.lateness_us, q)
            added_noop = p(noop.lateness_us, q) - base
            added_billing = p(billing.lateness_us, q) - base
            # Also against Envoy alone: what the processor hop itself costs.
            hop_noop = p(noop.lateness_us, q) - p(plain.lateness_us, q)
            hop_billing = p(billing.lateness_us, q) - p(plain.lateness_us, q)
            cells += [
                fmt(added_noop, 0), fmt(added_billing, 0),
                times(ratio(added_billing, added_noop)), times(ratio(hop_billing, hop_noop)),
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


def report_ttft(by_key: dict[tuple[int, str], LevelResult], levels: list[int]) -> None:
    print(
        "\nTime to first token = first token event's arrival − client send; added = that "
        "percentile − the direct route's;\nrequest path = client send → Envoy finished "
        "writing the request upstream (access log). ms.\n"
    )
    rows = []
    for streams in levels:
        base = by_key[(streams, "direct")]
        b50, b99 = p(base.ttft_us, 50), p(base.ttft_us, 99)
        for path in PATHS:
            lv = by_key[(streams, path)]
            t50, t99 = p(lv.ttft_us, 50), p(lv.ttft_us, 99)
            direct = path == "direct"
            rows.append(
                [
                    str(streams), path, str(lv.measured), ms(t50), ms(t99),
                    "-" if direct else ms(t50 - b50),
                    "-" if direct else ms(t99 - b99),
                    "-" if direct else ms(p(lv.request_path_us, 50)),
                ]
            )  # fmt: skip
    print(
        table(
            [
                "streams", "path", "streams measured", "TTFT p50", "TTFT p99",
                "added p50", "added p99", "request path p50",
            ],
            rows,
        )
    )  # fmt: skip
    print("\nTTFT added over direct: billing vs no-op, and billing − Envoy alone (ms):\n")
    cmp_rows = []
    for streams in levels:
        direct, plain = by_key[(streams, "direct")], by_key[(streams, "envoy")]
        noop, billing = by_key[(streams, "envoy+noop")], by_key[(streams, "envoy+billing")]
        added = {
            lv.path: p(lv.ttft_us, 50) - p(direct.ttft_us, 50) for lv in (plain, noop, billing)
        }
        cmp_rows.append(
            [
                str(streams),
                ms(added["envoy"]), ms(added["envoy+noop"]), ms(added["envoy+billing"]),
                times(ratio(added["envoy+billing"], added["envoy+noop"])),
                ms(p(billing.ttft_us, 50) - p(plain.ttft_us, 50)),
                ms(p(billing.ttft_us, 99) - p(plain.ttft_us, 99)),
                ms(p(noop.ttft_us, 50) - p(plain.ttft_us, 50)),
            ]
        )  # fmt: skip
    print(
        table(
            [
                "streams", "envoy +p50", "noop +p50", "billing +p50", "billing/noop p50",
                "billing − envoy p50", "billing − envoy p99", "noop − envoy p50",
            ],
            cmp_rows,
        )
    )  # fmt: skip


def report_duration(by_key: dict[tuple[int, str], LevelResult], levels: list[int]) -> None:
    print(
        "\nStream duration = last token event's arrival − client send; gap = arrival[i] − "
        "arrival[i−1], all streams' chunks pooled. ms;\n÷ envoy: the same percentile over "
        "Envoy alone's at the same concurrency.\n"
    )
    rows = []
    for streams in levels:
        plain = by_key[(streams, "envoy")]
        for path in PATHS:
            lv = by_key[(streams, path)]
            rows.append(
                [
                    str(streams), path, ms(p(lv.e2e_us, 50), 1), ms(p(lv.e2e_us, 99), 1),
                    ms(p(lv.gap_us, 50)), ms(p(lv.gap_us, 99)),
                    times(ratio(p(lv.e2e_us, 99), p(plain.e2e_us, 99))),
                    times(ratio(p(lv.gap_us, 99), p(plain.gap_us, 99))),
                ]
            )  # fmt: skip
    print(
        table(
            [
                "streams", "path", "end-to-end p50", "end-to-end p99", "gap p50", "gap p99",
                "e2e p99 ÷ envoy", "gap p99 ÷ envoy",
            ],
            rows,
        )
    )  # fmt: skip
    print(f"\nStreams not slowed: billing and no-op ÷ Envoy alone (target ≤ {TARGET_SLOWDOWN}×):\n")
    cmp_rows = []
    for streams in levels:
        plain = by_key[(streams, "envoy")]
        noop, billing = by_key[(streams, "envoy+noop")], by_key[(streams, "envoy+billing")]

        def over(lv: LevelResult, attr: str, q: float, plain: LevelResult = plain) -> float:
            return ratio(p(getattr(lv, attr), q), p(getattr(plain, attr), q))

        e2e99, gap99 = over(billing, "e2e_us", 99), over(billing, "gap_us", 99)
        cmp_rows.append(
            [
                str(streams),
                times(over(billing, "e2e_us", 50)), times(e2e99), times(gap99),
                times(over(noop, "e2e_us", 99)), times(over(noop, "gap_us", 99)),
                verdict(e2e99 <= TARGET_SLOWDOWN and gap99 <= TARGET_SLOWDOWN),
            ]
        )  # fmt: skip
    print(
        table(
            [
                "streams", "billing e2e p50", "billing e2e p99", "billing gap p99",
                "noop e2e p99", "noop gap p99", "billing",
            ],
            cmp_rows,
        )
    )  # fmt: skip


def report_cpu(by_key: dict[tuple[int, str], LevelResult], levels: list[int]) -> None:
    cores = os.cpu_count() or 1
    print(
        "\nCPU share while each route's streams ran: CPU seconds / wall seconds, % of one "
        f"core; machine = busy share of all {cores} cores\n(other tenants' load included). "
        "processor = the no-op or the billing processor.\n"
    )
    rows = []
    for streams in levels:
        for path in PATHS:
            u = by_key[(streams, path)].usage
            rows.append(
                [str(streams), path, fmt(u.wall_s, 1)]
                + [pct(u.share(role)) if role in u.cpu_s else "-" for role in ROLES]
                + [pct(u.machine_share())]
            )
    print(table(["streams", "path", "wall s", *ROLES, "machine"], rows))


def report(levels: list[LevelResult], itl_ms: float, tokens: int) -> None:
    by_key = {(lv.streams, lv.path): lv for lv in levels}
    streams = sorted({lv.streams for lv in levels})
    print(
        f"\nSimulator ITL {itl_ms:g} ms (no jitter, no TTFT of its own), {tokens} token "
        "events per stream."
    )
    report_chunks(by_key, streams)
    report_ttft(by_key, streams)
    report_duration(by_key, streams)
    report_cpu(by_key, streams)


# --------------------------------------------------------------------------- ceiling


def trips(plain: LevelResult, billing: LevelResult) -> list[str]:
    """Why this level counts as saturated for the billing processor (empty: it doesn't)."""
    reasons = []
    if billing.failed or plain.failed:
        reasons.append(f"failed streams (billing {billing.failed}, envoy {plain.failed})")
    e2e = ratio(p(billing.e2e_us, 99), p(plain.e2e_us, 99))
    if not e2e <= TARGET_SLOWDOWN:
        reasons.append(f"billing e2e p99 {fmt(e2e)}× Envoy alone's > {TARGET_SLOWDOWN}×")
    cpu = billing.usage.share("processor")
    if cpu > CEILING_CPU_SHARE:
        reasons.append(f"billing processor CPU {pct(cpu)} of one core > {pct(CEILING_CPU_SHARE)}")
    return reasons


async def find_ceiling(
    routes: list[Route],
    levels: list[int],
    rounds_for: Callable[[int], int],
    tokens: int,
    itl_s: float,
) -> None:
    tag = uuid.uuid4().hex[:8]
    await warm(routes, itl_s, tag)
    rows = []
    passed: int | None = None
    stopped: tuple[int, list[str], float] | None = None
    for streams in levels:
        for attempt in (1, 2):
            started = time.monotonic()
            plain, billing = await run_rounds(
                routes, streams, rounds_for(streams), tokens, itl_s, f"{tag}-{streams}-{attempt}"
            )
            reasons = trips(plain, billing)
            rows.append(
                [
                    str(streams), fmt(streams / itl_s, 0), str(attempt),
                    str(billing.measured),
                    ms(p(plain.e2e_us, 99), 1), ms(p(billing.e2e_us, 99), 1),
                    times(ratio(p(billing.e2e_us, 99), p(plain.e2e_us, 99))),
                    times(ratio(p(billing.gap_us, 99), p(plain.gap_us, 99))),
                    pct(billing.usage.share("processor")), pct(billing.usage.share("envoy")),
                    pct(billing.usage.machine_share()),
                    "; ".join(reasons) or "unsaturated",
                ]
            )  # fmt: skip
            print(
                f"  {streams:>3} streams, attempt {attempt}: {time.monotonic() - started:5.1f}s, "
                + ("; ".join(reasons) or "unsaturated"),
                flush=True,
            )
            if not reasons:
                break
        if reasons:
            stopped = (streams, reasons, billing.usage.machine_share())
            break
        passed = streams
    print(
        f"\nCeiling of one billing processor, ITL {itl_s * 1000:g} ms, {tokens} token events "
        f"per stream: a level passes with billing's end-to-end p99 ≤ {TARGET_SLOWDOWN}× Envoy "
        f"alone's,\nthe billing processor under {pct(CEILING_CPU_SHARE)} of one core and no "
        "stream failed; a level that trips is run once more. ms; CPU in % of one core.\n"
    )
    print(
        table(
            [
                "streams", "chunks/s", "attempt", "streams measured", "envoy e2e p99",
                "billing e2e p99", "e2e ratio", "gap p99 ratio", "billing CPU",
                "its envoy CPU", "machine", "result",
            ],
            rows,
        )
    )  # fmt: skip
    if passed is None:
        head = f"below {levels[0]} streams"
    else:
        head = (
            f"{passed} streams × {fmt(1 / itl_s, 0)} chunks/s = {fmt(passed / itl_s, 0)} "
            "chunks/s through one billing processor, unsaturated"
        )
    if stopped is None:
        tail = f"not stopped up to {levels[-1]} streams (the highest level tried)"
    else:
        streams, reasons, machine = stopped
        tail = (
            f"stopped at {streams} streams by: {'; '.join(reasons)} "
            f"(machine {pct(machine)} busy then)"
        )
    print(f"\nCeiling: {head}; {tail}.")


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter streams")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="simulator inter-token latency")
    parser.add_argument("--tokens", type=int, default=100, help="token events per stream")
    parser.add_argument(
        "--levels", default="1,10,50,200", help="concurrent streams, comma-separated"
    )
    parser.add_argument(
        "--min-streams",
        type=int,
        default=40,
        help="streams per route and level at least (rounds are added at low concurrency)",
    )
    parser.add_argument(
        "--find-ceiling",
        action="store_true",
        help="only the ceiling search: Envoy alone vs Envoy + billing at rising levels",
    )
    parser.add_argument(
        "--ceiling-levels", default=CEILING_LEVELS, help="levels the ceiling search steps through"
    )
    args = parser.parse_args()
    tokens = 40 if args.quick else args.tokens
    chosen_levels = args.ceiling_levels if args.find_ceiling else args.levels
    levels = [int(x) for x in chosen_levels.split(",")]
    min_streams, min_rounds = (8, 1) if args.quick else (args.min_streams, 2)

    def rounds_for(streams: int) -> int:
        return max(min_rounds, math.ceil(min_streams / streams))

    itl_s = args.itl_ms / 1000
    wall_started = time.monotonic()

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
        common = {"client": os.getpid(), "simulator": sim.process.pid}
        routes = [Route("direct", sim.port, None, dict(common))]
        for name, processor_port, processor_pid in (
            ("envoy", None, None),
            ("envoy+noop", noop_port, noop.pid),
            ("envoy+billing", billing.port, billing.process.pid),
        ):
            envoy, access_log = start_envoy(
                workdir, processor_port, sim.port, name.replace("+", "-")
            )
            stoppers.append(envoy.stop)
            pids = {**common, "envoy": envoy.process.pid}
            if processor_pid is not None:
                pids["processor"] = processor_pid
            routes.append(Route(name, envoy.ports.listen, access_log, pids))
        mode = "ceiling search" if args.find_ceiling else "levels"
        print(
            f"stream latency benchmark: {mode} {levels}, ITL {args.itl_ms:g} ms, "
            f"{tokens} tokens/stream, ≥ {min_streams} streams per route and level, "
            f"load average {os.getloadavg()[0]:.1f}, logs in {workdir}",
            flush=True,
        )
        if args.find_ceiling:
            chosen = [r for r in routes if r.name in ("envoy", "envoy+billing")]
            asyncio.run(find_ceiling(chosen, levels, rounds_for, tokens, itl_s))
        else:
            results = asyncio.run(run_all(routes, levels, rounds_for, tokens, itl_s))
            report(results, args.itl_ms, tokens)
        metrics = billing.metrics()
        events = metrics.get("extproc_sse_events_total", 0)
        waited = metrics.get("extproc_events_waited_total", 0)
        print(
            f"\nbilling processor during the run: {int(events):,} events, "
            f"{int(waited):,} waited on Redis ({fmt(100 * ratio(waited, events), 3)}%), "
            f"{int(metrics.get('extproc_cutoffs_total', 0))} cut-offs; "
            f"load average at the end {os.getloadavg()[0]:.1f}; "
            f"run took {time.monotonic() - wall_started:.0f}s"
        )
    finally:
        for stop in reversed(stoppers):
            stop()


if __name__ == "__main__":
    main()
