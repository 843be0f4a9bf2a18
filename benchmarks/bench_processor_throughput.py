"""Body messages per second through ONE processor process with billing on, vs a no-op one.

Client processes (``loadlab.grpc_load``) play Envoy on the gRPC Process stream: request
headers with a valid key, the request body (admission, Redis included), response headers
200 text/event-stream, then one FDX response body message per token (one SSE chat chunk
``" word"`` each) and a last message with the finish event, the usage event and
``[DONE]``. Many streams run at once, each message answered before the stream sends its
next (as an upstream paced by token generation would), so the processor is kept busy by
the number of streams.

The processor is pinned to core 0 and the clients to core 1 (``taskset``) so the client
never takes the processor's core. Figures: messages/s on the wall clock, the processor's
CPU use, messages per processor CPU-second (what one core sustains, whatever else the
machine is running) and the processor's context switches per message (all its threads);
then from the billing processor's /metrics, Redis round trips per
request and the share of SSE events that had to wait for a lease batch from Redis.

    .venv/bin/python benchmarks/bench_processor_throughput.py [--quick] [--clients 2]
        [--streams 64] [--tokens 256] [--seconds 8] [--loops uvloop,asyncio]
        [--grpc-threads batch,normal]

``--loops``: the event loops to run both processors on (``extproc serve --loop``);
``--grpc-threads``: the scheduling of their gRPC threads (``extproc serve --grpc-threads``);
default serve's. Every combination is a setup; with more than one, every processor of every
setup runs in each round, and the setups are compared processor by processor (msg per
CPU-second, the rounds' median ratio against the first setup).

Targets: billing ≥ 0.90× the no-op's body messages per processor CPU-second (issue 10;
no-op and billing phases alternate ``--rounds`` times, the ratio is the rounds' median);
≥ 20,000 body messages/s on one core (issue 5); round trips per request
≤ ⌈output/batch⌉ + 2; events that waited on Redis < 1%.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.app.loop import DEFAULT_LOOP, LOOPS
from extproc.app.sched import DEFAULT_GRPC_THREADS, GRPC_THREADS
from loadlab.figures import fmt, ratio, table, verdict
from loadlab.gateway import wait_until
from loadlab.grpc_load import (
    BATCH,
    Phase,
    all_settled,
    cores,
    load_args,
    load_arguments,
    merged,
    run_phase,
)
from loadlab.procs import StopStack
from loadlab.redis_server import RedisServer
from loadlab.rig import start_billing_processor, start_noop_processor, write_bench_config

TARGET_MESSAGES_PER_S = 20_000
TARGET_RATIO = 0.90  # issue 10: billing ≥ 0.90× the no-op's body messages per CPU-second
TARGET_WAITED_SHARE = 0.01

LEASE_REFUSALS = 'extproc_lease_batches_total{result="refused"}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    load_arguments(parser)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="no-op and billing phases alternate this many times; the ratio is their median",
    )
    parser.add_argument(
        "--loops",
        default=DEFAULT_LOOP,
        help=f"comma-separated event loops of both processors ({', '.join(LOOPS)}); "
        "several: compared side by side, round by round",
    )
    parser.add_argument(
        "--grpc-threads",
        default=DEFAULT_GRPC_THREADS,
        help=f"comma-separated scheduling of both processors' gRPC threads "
        f"({', '.join(GRPC_THREADS)}); several: compared side by side, round by round",
    )
    args = load_args(parser)
    loops = _names(parser, "--loops", args.loops, LOOPS)
    policies = _names(parser, "--grpc-threads", args.grpc_threads, GRPC_THREADS)
    several = len(loops) * len(policies) > 1
    setups = {  # label: (loop, gRPC threads)
        (f"{loop}, {policy} gRPC threads" if several else loop): (loop, policy)
        for loop in loops
        for policy in policies
    }
    server_cpus, client_cpus = cores()

    workdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    with StopStack() as stops:
        redis = stops.push(RedisServer.start(workdir / "redis"))
        config = write_bench_config(workdir / "quota.yaml", redis.url, batch_tokens=BATCH)
        targets = []  # (setup, processor name, port, pid)
        billings = {}
        for label, (loop, policy) in setups.items():
            noop, noop_port = start_noop_processor(workdir, server_cpus, loop, policy)
            stops.push(noop)
            billing = stops.push(
                start_billing_processor(config, workdir, redis.url, server_cpus, loop, policy)
            )
            billings[label] = billing
            targets += [
                (label, "noop", noop_port, noop.pid),
                (label, "billing", billing.port, billing.process.pid),
            ]
        print(
            f"processor throughput: {args.clients} client processes × {args.streams} streams, "
            f"{args.tokens} token chunks per response, batch {BATCH}, processor on core "
            f"{server_cpus}, clients on core {client_cpus}, setups {'; '.join(setups)}; load "
            f"average {os.getloadavg()[0]:.1f}; logs in {workdir}",
            flush=True,
        )
        # Alternating rounds: a change in the machine's other load hits both processors
        # (and every setup) alike instead of whichever ran at that moment.
        by_setup: dict[str, list[tuple[Phase, Phase]]] = {label: [] for label in setups}
        for r in range(args.rounds):
            done: dict[tuple[str, str], Phase] = {}
            for label, name, port, pid in targets:
                phase = done[label, name] = run_phase(name, port, pid, args, client_cpus)
                shown = f"{name} ({label})" if several else name
                print(f"  round {r + 1} {shown}: {phase.per_s:,.0f} msg/s", flush=True)
            for label in setups:
                by_setup[label].append((done[label, "noop"], done[label, "billing"]))
        # Every stream ended: wait for the spawned settlements, then read the counters.
        metrics = {}
        for label, billing in billings.items():
            wait_until(lambda b=billing: all_settled(b.metrics()), timeout_s=15)
            metrics[label] = billing.metrics()
    for label in setups:
        if several:
            print(f"\n=== {label}")
        report(by_setup[label], metrics[label], args.tokens)
    if several:
        compare_setups(by_setup)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


def _names(
    parser: argparse.ArgumentParser, flag: str, value: str, known: tuple[str, ...]
) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names or any(name not in known for name in names):
        parser.error(f"{flag}: names among {', '.join(known)}")
    return names


def compare_setups(by_setup: dict[str, list[tuple[Phase, Phase]]]) -> None:
    """Each processor's msg per CPU-second in every setup, against the first setup's."""
    first, *others = by_setup
    rows = []
    for index, name in enumerate(("noop", "billing")):
        base = merged([pair[index] for pair in by_setup[first]])
        rows.append(
            [name, first, fmt(base.per_cpu_s, 0), fmt(base.switches_per_message, 2), "", ""]
        )
        for setup in others:
            phases = [pair[index] for pair in by_setup[setup]]
            per_round = [
                ratio(p.per_cpu_s, q[index].per_cpu_s)
                for p, q in zip(phases, by_setup[first], strict=True)
            ]
            rows.append(
                [
                    name,
                    setup,
                    fmt(merged(phases).per_cpu_s, 0),
                    fmt(merged(phases).switches_per_message, 2),
                    fmt(statistics.median(per_round), 2) + "×",
                    ", ".join(f"{x:.2f}" for x in per_round),
                ]
            )
    print(f"\nsetups side by side (ratio: against {first}, per round and the median)")
    header = ["processor", "setup", "msg per CPU-s", "switches/msg", "median ratio", "rounds"]
    print(table(header, rows))


def report(rounds: list[tuple[Phase, Phase]], metrics: dict[str, float], tokens: int) -> None:
    per_round = [ratio(b.per_cpu_s, n.per_cpu_s) for n, b in rounds]
    print("\nbilling/noop msg per CPU-s by round: " + ", ".join(f"{r:.2f}×" for r in per_round))
    print(
        f"median {statistics.median(per_round):.2f}× (target ≥ {TARGET_RATIO:.2f}×: "
        f"{verdict(statistics.median(per_round) >= TARGET_RATIO)})"
    )
    noop = merged([n for n, _ in rounds])
    billing = merged([b for _, b in rounds])
    phases = [noop, billing]
    rows = [
        [
            p.processor,
            fmt(p.per_s, 0),
            fmt(100 * p.cpu_s / p.seconds, 0) + "%",
            fmt(p.per_cpu_s, 0),
            fmt(p.switches_per_message, 2),
            fmt(p.client_cpu_s, 1),
            f"{p.requests:,}",
            str(p.errors),
        ]
        for p in phases
    ]
    rows.append(
        [
            "billing/noop",
            fmt(ratio(billing.per_s, noop.per_s), 2) + "×",
            "",
            fmt(ratio(billing.per_cpu_s, noop.per_cpu_s), 2) + "×",
            "",
            "",
            "",
            "",
        ]
    )
    print()
    print(
        table(
            [
                "processor",
                "body msg/s",
                "proc CPU",
                "msg per CPU-s",
                "switches/msg",
                "client CPU-s",
                "requests",
                "errors",
            ],
            rows,
        )
    )
    for p in phases:
        if p.cpu_s / p.seconds < 0.9:
            print(
                f"note: the {p.processor} processor used {100 * p.cpu_s / p.seconds:.0f}% of "
                "its core: the clients (or other load on the machine) set the pace, and msg "
                "per CPU-s understates what a saturated core does (no batching of wake-ups)."
            )
    print(
        f"\nbilling: {fmt(billing.per_cpu_s, 0)} msg per processor CPU-second, "
        f"{fmt(billing.per_s, 0)} msg/s wall — target ≥ {TARGET_MESSAGES_PER_S:,}/s on one "
        f"core: {verdict(billing.per_cpu_s >= TARGET_MESSAGES_PER_S)} (per CPU-second)"
    )
    admitted = metrics.get("extproc_requests_admitted_total", 0)
    trips = metrics.get("extproc_quota_round_trips_total", 0)
    events = metrics.get("extproc_sse_events_total", 0)
    waited = metrics.get("extproc_events_waited_total", 0)
    bound = math.ceil(tokens / BATCH) + 2
    per_request = ratio(trips, admitted)
    print(
        table(
            ["billing processor (whole run)", "measured", "target", ""],
            [
                [
                    "Redis round trips per request",
                    fmt(per_request, 2),
                    f"≤ {bound} (⌈{tokens}/{BATCH}⌉+2)",
                    verdict(per_request <= bound),
                ],
                [
                    "events that waited on Redis",
                    f"{fmt(100 * ratio(waited, events), 3)}% ({int(waited):,}/{int(events):,})",
                    f"< {100 * TARGET_WAITED_SHARE:g}%",
                    verdict(ratio(waited, events) < TARGET_WAITED_SHARE),
                ],
                [
                    "requests admitted / lease refusals / cut-offs",
                    f"{int(admitted):,} / {int(metrics.get(LEASE_REFUSALS, 0))}"
                    f" / {int(metrics.get('extproc_cutoffs_total', 0))}",
                    "",
                    "",
                ],
            ],
        )
    )


if __name__ == "__main__":
    main()
