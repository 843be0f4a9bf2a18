"""Client processes that play Envoy on a processor's gRPC Process stream: the per-chunk load
of the gRPC-level benchmarks (processor throughput, workers, observability).

Each client process (spawned: grpc must not cross a fork) runs ``streams`` streams, one
after another on each: request headers with a valid key, the request body (admission, Redis
included), response headers 200 text/event-stream, then one FDX response body message per
token and a last message with the finish event, the usage event and ``[DONE]``. Every
message is answered before the window lets the next one go (at most ``window`` unanswered,
as Envoy sends ahead), so the processor is kept busy by the number of streams. A phase
reads the messages sent and the processor's CPU time over a measured interval.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from typing import Any

from loadlab import wire
from loadlab.figures import ratio
from loadlab.machine import context_switches, cpu_seconds, pin_self
from loadlab.rig import BENCH_KEY

BATCH = 32  # the lease batch the benchmarks' processors are configured with


def load_arguments(parser: argparse.ArgumentParser, clients: str = "client processes") -> None:
    """The load's flags, alike in every benchmark that runs ``run_phase``."""
    parser.add_argument("--quick", action="store_true", help="shorter measurement")
    parser.add_argument("--clients", type=int, default=2, help=clients)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams per client")
    parser.add_argument("--tokens", type=int, default=256, help="token chunks per response")
    parser.add_argument(
        "--window", type=int, default=4, help="unanswered body messages per stream (FDX)"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measured interval")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")


def load_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed flags, ``--quick`` applied (4 s measured after 2 s)."""
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup = 4.0, 2.0
    return args


def cores() -> tuple[str | None, str | None]:
    """The processor's core and the clients': 0 and 1 when there are two, else unpinned."""
    return ("0", "1") if (os.cpu_count() or 1) >= 2 else (None, None)


def all_settled(metrics: dict[str, float]) -> bool:
    """Every admitted request settled (the processor's counters)."""
    settled = metrics.get("extproc_settlements_total", 0)
    return settled >= metrics.get("extproc_requests_admitted_total", 0)


# -- client process --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientPlan:
    port: int
    index: int
    streams: int
    tokens: int
    window: int
    tag: str
    cpus: str | None


async def _drive(plan: ClientPlan, sent: Any, stop: Any) -> tuple[int, int, float]:
    import grpc

    exchange = wire.Exchange(wire.PROMPT, plan.tokens)
    chunk = exchange.chunk
    tail = exchange.tail(plan.tokens)
    requests = errors = 0

    async with grpc.aio.insecure_channel(f"127.0.0.1:{plan.port}") as channel:
        process = channel.stream_stream(wire.PROCESS_METHOD)

        async def body_messages(call: Any) -> None:
            """FDX: send ahead of the replies, at most ``window`` unanswered, like Envoy."""
            window = asyncio.Semaphore(plan.window)

            async def replies() -> None:
                for _ in range(plan.tokens + 1):
                    await call.read()
                    window.release()
                    sent[plan.index] += 1

            reader = asyncio.create_task(replies())
            for message in itertools.chain(itertools.repeat(chunk, plan.tokens), (tail,)):
                await window.acquire()
                await call.write(message)
            await reader

        async def one_request(rid: str) -> bool:
            call = process()
            if not await wire.open_stream(call, exchange, BENCH_KEY, rid):
                return False
            await body_messages(call)
            await call.done_writing()
            await call.code()  # the processor ended the stream: settlement is spawned
            return True

        async def stream_loop(worker: int) -> None:
            nonlocal requests, errors
            n = 0
            while not stop.value:
                ok = await one_request(f"{plan.tag}-{plan.index}-{worker}-{n}")
                n += 1
                requests += ok
                errors += not ok

        await asyncio.gather(*(stream_loop(w) for w in range(plan.streams)))
    return requests, errors, time.process_time()


def client_main(plan: ClientPlan, sent: Any, stop: Any, results: Any) -> None:
    pin_self(plan.cpus)
    results.put(asyncio.run(_drive(plan, sent, stop)))


# -- one measured phase ------------------------------------------------------------------------


@dataclass
class Phase:
    processor: str
    messages: int
    seconds: float
    cpu_s: float
    requests: int
    errors: int
    client_cpu_s: float  # all client processes, whole phase
    switches: int = 0  # the processor's context switches, all threads, while measured

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds

    @property
    def switches_per_message(self) -> float:
        return ratio(self.switches, self.messages)

    @property
    def per_cpu_s(self) -> float:
        return ratio(self.messages, self.cpu_s)


def run_phase(
    name: str, port: int, pid: int, args: argparse.Namespace, client_cpus: str | None
) -> Phase:
    """``args.clients`` client processes against the processor at ``port`` (process ``pid``):
    ``args.warmup`` s, then the messages and the processor's CPU over ``args.seconds``."""
    ctx = mp.get_context("spawn")
    sent: SynchronizedArray = ctx.Array("q", args.clients, lock=False)  # type: ignore[assignment]
    stop = ctx.Value("b", 0, lock=False)
    results = ctx.Queue()
    tag = f"{name}-{uuid.uuid4().hex[:8]}"
    plans = [
        ClientPlan(port, i, args.streams, args.tokens, args.window, tag, client_cpus)
        for i in range(args.clients)
    ]
    clients = [ctx.Process(target=client_main, args=(p, sent, stop, results)) for p in plans]
    for c in clients:
        c.start()
    try:
        time.sleep(args.warmup)  # spawn, connect, first admissions, tokenizer warm
        m0, c0, t0, s0 = sum(sent), cpu_seconds(pid), time.monotonic(), context_switches(pid)
        time.sleep(args.seconds)
        m1, c1, t1, s1 = sum(sent), cpu_seconds(pid), time.monotonic(), context_switches(pid)
    finally:
        stop.value = 1
    for c in clients:
        c.join(120)
    if any(c.exitcode != 0 for c in clients):
        raise SystemExit(f"a client process failed against the {name} processor (see above)")
    outcomes = [results.get(timeout=5) for _ in clients]
    return Phase(
        name,
        m1 - m0,
        t1 - t0,
        c1 - c0,
        sum(r for r, _, _ in outcomes),
        sum(e for _, e, _ in outcomes),
        sum(c for _, _, c in outcomes),
        s1 - s0,
    )


def merged(phases: list[Phase]) -> Phase:
    """Rounds of one processor as one phase (sums)."""
    return Phase(
        phases[0].processor,
        sum(p.messages for p in phases),
        sum(p.seconds for p in phases),
        sum(p.cpu_s for p in phases),
        sum(p.requests for p in phases),
        sum(p.errors for p in phases),
        sum(p.client_cpu_s for p in phases),
        sum(p.switches for p in phases),
    )
