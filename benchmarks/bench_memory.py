"""Processor memory: RSS per 1,000 concurrent open streams, and its growth over a soak.

Part 1 (streams held open). A real redis-server, the billing processor (batch 32, roomy
budgets, Redis) and the no-op FDX processor, each pinned to core 0. Client processes
(spawned, on core 1: grpc must not cross a fork) play Envoy on the gRPC Process stream:
request headers with a valid key, the request body (admission), response headers 200
text/event-stream, a few FDX body messages (one SSE chat chunk ``" word"`` each, every one
answered before the next), and then keep the stream open mid-response, trickling one more
token every ``--trickle-s`` (±50 %) so that no idle watchdog fires. The processor's RSS
(VmRSS from /proc/PID/status, the median of 5 samples over 2 s once the level is reached)
is read at start, idle after a warm-up (a few hundred complete streams, so lazy
initialisation is not counted as per-stream memory), with 1,000 and 2,000 streams open at
once, and after every stream has been closed and settled. That is done twice (round 2
shows whether memory freed in round 1 is reused, i.e. stays bounded). Reported: RSS at
each point for no-op and billing side by side, and the slope in MiB per 1,000 streams.
``--gc-probe`` (a diagnostic, off by default) starts the processors with a sitecustomize
that runs ``gc.collect()`` on SIGUSR1 and glibc's ``malloc_trim(0)`` on SIGUSR2; after the
last round both are sent and RSS read after each, which tells uncollected garbage and free
heap that malloc keeps from memory still in use.

Part 2 (soak, the billing processor; ``--soak-target noop`` soaks the no-op one instead,
the baseline for drift that grpc.aio, CPython and glibc show without billing).
``--soak-streams`` slots (200) each run one stream after another: admission, then
``--soak-tokens`` (100) token messages ``--soak-itl-ms`` (100 ms) apart, the usage tail,
end. A share of streams belongs to a tenant whose TPM
budget is about half of what its streams ask for, so some are cut off by the budget
mid-stream and some refused (a refused slot backs off 2–8 s); another share is cancelled
by the client mid-response (Envoy's reset when the downstream goes away). After a warm-up,
RSS is sampled every ``--sample-s`` (10 s) for ``--soak-s`` (600 s; ``--quick``: 60 s).
Reported: the first and last samples, the max, the growth from the mean of the first
minute to the mean of the last minute (MiB and %), and the least-squares slope (KiB/min),
over the whole soak and over its second half; plus Redis' memory and key count (context,
not the processor). ``--tracemalloc FRAMES`` (a diagnostic: the processor then runs several
times slower) starts tracing the soaked processor's allocations just before the soak (by
signal, through the same sitecustomize), snapshots it after ``gc.collect()`` at the start
and the end of the series, and prints the allocation sites that grew most.

    .venv/bin/python benchmarks/bench_memory.py [--quick] [--soak-s 600] [--levels 1000,2000]
        [--rounds 2] [--soak-streams 200] [--soak-tokens 100] [--soak-itl-ms 100]
        [--no-levels | --no-soak] [--soak-target billing|noop] [--gc-probe]
        [--tracemalloc FRAMES]

Target (issue 10, item 7): bounded memory per stream and in total: the soak must be flat
(here: last-minute mean within 5 % of the first minute's).
"""

from __future__ import annotations

import argparse
import asyncio
import linecache
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab import wire
from loadlab.figures import fmt, ratio, table, verdict
from loadlab.gateway import key_hash, wait_until, write_config
from loadlab.grpc_load import BATCH, all_settled, cores
from loadlab.machine import cpu_seconds, pin_self, status_kib
from loadlab.procs import ManagedProcess, StopStack
from loadlab.redis_server import RedisServer
from loadlab.rig import (
    BENCH_KEY,
    ROOT,
    start_billing_processor,
    start_noop_processor,
    write_bench_config,
)

TIGHT_TENANT = "tight"
TIGHT_KEY = "sk-bench-tight"
TARGET_GROWTH = 0.05
MIB = 1024.0  # KiB per MiB
SOAK_WARMUP_S = 30.0
# Soak outcome counters, per client process, in this order.
OUTCOMES = ("completed", "cut", "refused", "cancelled", "errors", "messages")

LEASE_REFUSALS = 'extproc_lease_batches_total{result="refused"}'


# --gc-probe / --tracemalloc: a sitecustomize for the processors only, so the bench can ask
# one, by signal, to run the cyclic GC (SIGUSR1), to hand free heap back to the OS
# (SIGUSR2), to start tracemalloc (the first SIGHUP: start-up under tracemalloc is slower
# than the readiness wait, and only what is allocated later can be growth) or to dump a
# snapshot into $BENCH_PROBE_DIR (each later SIGHUP).
GC_PROBE = """\
import ctypes, gc, os, signal, sys, tracemalloc


def _collect(signum, frame):
    print(f"gc-probe: gc.collect() found {gc.collect()} objects", file=sys.stderr, flush=True)


def _trim(signum, frame):
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print("gc-probe: malloc_trim(0)", file=sys.stderr, flush=True)


def _snapshot(signum, frame):
    if not tracemalloc.is_tracing():  # the first SIGHUP: trace from now on
        tracemalloc.start(int(os.environ.get("BENCH_TRACEMALLOC", "1")))
        print("gc-probe: tracemalloc started", file=sys.stderr, flush=True)
        return
    gc.collect()
    directory = os.environ["BENCH_PROBE_DIR"]
    n = sum(name.endswith(".snap") for name in os.listdir(directory))
    tmp = os.path.join(directory, f"snap-{n}.tmp")
    tracemalloc.take_snapshot().dump(tmp)
    os.rename(tmp, os.path.join(directory, f"snap-{n}.snap"))
    current, peak = tracemalloc.get_traced_memory()
    print(f"gc-probe: snapshot {n}, traced {current} B (peak {peak})", file=sys.stderr, flush=True)


signal.signal(signal.SIGUSR1, _collect)
signal.signal(signal.SIGUSR2, _trim)
signal.signal(signal.SIGHUP, _snapshot)
"""


def snapshot(pid: int, directory: Path, n: int, timeout_s: float = 300.0) -> Path:
    """Have the processor dump tracemalloc snapshot ``n`` (SIGHUP) and wait for the file."""
    path = directory / f"snap-{n}.snap"
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no tracemalloc snapshot {path}")
        time.sleep(0.2)
    return path


def rss_kib(pid: int) -> int:
    """Resident set size of a process (VmRSS, KiB)."""
    return status_kib(pid, "VmRSS")


def hwm_kib(pid: int) -> int:
    """Peak resident set size so far (VmHWM, KiB)."""
    return status_kib(pid, "VmHWM")


def steady_rss(pid: int, settle_s: float = 2.0, samples: int = 5, every_s: float = 0.5) -> int:
    """Median VmRSS of ``samples`` reads ``every_s`` apart, after ``settle_s``."""
    time.sleep(settle_s)
    reads = []
    for _ in range(samples):
        reads.append(rss_kib(pid))
        time.sleep(every_s)
    return int(statistics.median(reads))


def mib(kib: float) -> str:
    return fmt(kib / MIB, 1)


# -- client processes (spawned: grpc must not cross a fork) -------------------------------


@dataclass(frozen=True)
class HoldPlan:
    port: int
    index: int
    pre_messages: int  # token messages before a stream counts as open mid-response
    trickle_s: float  # one more token per open stream about this often
    opening: int  # streams in admission at once, per client
    tag: str
    cpus: str | None


@dataclass(frozen=True)
class SoakPlan:
    port: int
    index: int
    slots: int
    tokens: int
    itl_s: float
    cut_share: float  # streams of the tenant with a tight budget
    cancel_share: float  # streams the client cancels mid-response
    tag: str
    cpus: str | None


def _ends_stream(raw: bytes) -> bool:
    """The processor's answer to a body message ends the client's response (a cut-off)."""
    body = wire.response(raw).response_body.response.body_mutation
    return body.HasField("streamed_response") and body.streamed_response.end_of_stream


async def _open(call: Any, w: wire.Exchange, key: str, rid: str) -> bool:
    """Headers, body (admission), response headers; False if admission refused."""
    if await wire.open_stream(call, w, key, rid):
        return True
    await call.code()
    return False


async def _hold(
    plan: HoldPlan, want: Any, ready: Any, closed: Any, errors: Any, gen: Any, stop: Any
) -> None:
    import grpc

    w = wire.Exchange(wire.PROMPT, max_tokens=1024)
    rng = random.Random(plan.index)
    opening = asyncio.Semaphore(plan.opening)
    i = plan.index

    async with grpc.aio.insecure_channel(f"127.0.0.1:{plan.port}") as channel:
        process = channel.stream_stream(wire.PROCESS_METHOD)

        async def one(rid: str, finish: asyncio.Event) -> None:
            call = process()
            sent = 0
            counted = False
            try:
                async with opening:
                    if not await _open(call, w, BENCH_KEY, rid):
                        errors[i] += 1
                        return
                    for _ in range(plan.pre_messages):
                        await call.write(w.chunk)
                        await call.read()
                        sent += 1
                ready[i] += 1
                counted = True
                while not finish.is_set():
                    try:
                        await asyncio.wait_for(
                            finish.wait(), plan.trickle_s * rng.uniform(0.5, 1.5)
                        )
                    except TimeoutError:
                        await call.write(w.chunk)
                        await call.read()
                        sent += 1
                await call.write(w.tail(sent))
                await call.read()
                await call.done_writing()
                await call.code()
                closed[i] += 1
            except Exception as exc:
                if errors[i] < 3:
                    print(f"hold client {i}: {rid}: {exc!r}", file=sys.stderr, flush=True)
                errors[i] += 1
                call.cancel()
            finally:
                if counted:
                    ready[i] -= 1

        tasks: set[asyncio.Task[None]] = set()
        finish = asyncio.Event()
        seen = 0
        n = 0
        while not stop.value:
            if gen.value > seen:
                seen = gen.value
                finish.set()
                await asyncio.gather(*list(tasks), return_exceptions=True)
                tasks.clear()
                finish = asyncio.Event()
                continue
            while len(tasks) < want[i]:
                task = asyncio.create_task(one(f"{plan.tag}-{i}-{n}", finish))
                n += 1
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.05)
        finish.set()
        await asyncio.gather(*list(tasks), return_exceptions=True)


def hold_main(
    plan: HoldPlan, want: Any, ready: Any, closed: Any, errors: Any, gen: Any, stop: Any
) -> None:
    pin_self(plan.cpus)
    asyncio.run(_hold(plan, want, ready, closed, errors, gen, stop))


async def _soak(plan: SoakPlan, counts: Any, stop: Any) -> None:
    import grpc

    w = wire.Exchange(wire.PROMPT, max_tokens=plan.tokens + 16)
    rng = random.Random(plan.tag + str(plan.index))
    base = plan.index * len(OUTCOMES)
    slot_of = {name: base + k for k, name in enumerate(OUTCOMES)}

    async with grpc.aio.insecure_channel(f"127.0.0.1:{plan.port}") as channel:
        process = channel.stream_stream(wire.PROCESS_METHOD)

        async def one(rid: str, key: str, cancel_at: int | None) -> str:
            call = process()
            try:
                if not await _open(call, w, key, rid):
                    return "refused"
                for n in range(plan.tokens):
                    await asyncio.sleep(plan.itl_s)
                    if n == cancel_at:
                        call.cancel()
                        return "cancelled"
                    await call.write(w.chunk)
                    reply = await call.read()
                    counts[slot_of["messages"]] += 1
                    if _ends_stream(reply):
                        await call.done_writing()
                        await call.code()
                        return "cut"
                await call.write(w.tail(plan.tokens))
                await call.read()
                counts[slot_of["messages"]] += 1
                await call.done_writing()
                await call.code()
                return "completed"
            except Exception as exc:
                call.cancel()
                if counts[slot_of["errors"]] < 3:
                    print(f"soak client {plan.index}: {rid}: {exc!r}", file=sys.stderr, flush=True)
                return "errors"

        async def slot(k: int) -> None:
            # Spread the starts over one stream's duration: a steady mix from the start.
            await asyncio.sleep(rng.uniform(0, plan.tokens * plan.itl_s))
            n = 0
            while not stop.value:
                tight = rng.random() < plan.cut_share
                cancel_at = (
                    rng.randrange(1, plan.tokens) if rng.random() < plan.cancel_share else None
                )
                outcome = await one(
                    f"{plan.tag}-{plan.index}-{k}-{n}",
                    TIGHT_KEY if tight else BENCH_KEY,
                    cancel_at,
                )
                n += 1
                counts[slot_of[outcome]] += 1
                if outcome == "refused":
                    await asyncio.sleep(rng.uniform(2.0, 8.0))

        await asyncio.gather(*(slot(k) for k in range(plan.slots)))


def soak_main(plan: SoakPlan, counts: Any, stop: Any) -> None:
    pin_self(plan.cpus)
    asyncio.run(_soak(plan, counts, stop))


# -- part 1: streams held open --------------------------------------------------------------


@dataclass
class Point:
    label: str
    kib: dict[str, int]  # processor name -> VmRSS


def _wait(cond: Callable[[], bool], what: str, timeout_s: float, clients: list[Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if any(c.exitcode not in (None, 0) for c in clients):
            raise SystemExit(f"a client process failed while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def hold_levels(
    name: str,
    port: int,
    pid: int,
    settled: Callable[[], bool],
    args: argparse.Namespace,
    client_cpus: str | None,
) -> tuple[list[tuple[str, int]], int]:
    """RSS of one processor: idle after warm-up, at each level, after close; each round."""
    ctx = mp.get_context("spawn")
    k = args.hold_clients
    want = ctx.Array("q", k, lock=False)
    ready = ctx.Array("q", k, lock=False)
    closed = ctx.Array("q", k, lock=False)
    errors = ctx.Array("q", k, lock=False)
    gen = ctx.Value("q", 0, lock=False)
    stop = ctx.Value("b", 0, lock=False)
    tag = f"{name}-{uuid.uuid4().hex[:8]}"
    plans = [
        HoldPlan(port, i, args.pre_messages, args.trickle_s, 32, tag, client_cpus) for i in range(k)
    ]
    clients = [
        ctx.Process(target=hold_main, args=(p, want, ready, closed, errors, gen, stop))
        for p in plans
    ]
    points: list[tuple[str, int]] = []
    started = time.monotonic()
    for c in clients:
        c.start()
    try:
        total_closed = 0

        def close_all(expected: int) -> None:
            nonlocal total_closed
            for i in range(k):
                want[i] = 0
            gen.value += 1
            total_closed += expected
            _wait(
                lambda: sum(closed) + sum(errors) >= total_closed and sum(ready) == 0,
                f"{name}: streams closed",
                120,
                clients,
            )
            _wait(settled, f"{name}: settlements", 60, clients)

        # Warm-up: complete streams through every code path once, none counted.
        for i in range(k):
            want[i] = args.warmup_streams // k
        _wait(lambda: sum(ready) >= args.warmup_streams // k * k, f"{name} warm-up", 120, clients)
        close_all(args.warmup_streams // k * k)
        points.append(("idle (after warm-up)", steady_rss(pid, settle_s=3.0)))
        for r in range(1, args.rounds + 1):
            for level in args.levels:
                for i in range(k):
                    want[i] = level // k
                target = level // k * k
                _wait(lambda t=target: sum(ready) >= t, f"{name}: {level} open", 300, clients)
                points.append((f"round {r}: {level:,} open", steady_rss(pid)))
                print(
                    f"  {name}: round {r}, {level:,} open: "
                    f"{mib(points[-1][1])} MiB ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
            close_all(max(args.levels) // k * k)
            points.append((f"round {r}: all closed", steady_rss(pid, settle_s=3.0)))
        if args.gc_probe:
            os.kill(pid, signal.SIGUSR1)  # gc.collect() in the processor (GC_PROBE)
            points.append(("  then gc.collect()", steady_rss(pid)))
            os.kill(pid, signal.SIGUSR2)  # malloc_trim(0)
            points.append(("  then malloc_trim(0)", steady_rss(pid)))
    finally:
        stop.value = 1
        gen.value += 1
        for c in clients:
            c.join(60)
        for c in clients:
            if c.is_alive():
                c.terminate()
                c.join(5)
    errs = sum(errors)
    return points, errs


# -- part 2: soak ---------------------------------------------------------------------------


@dataclass
class Soak:
    samples: list[tuple[float, int]]  # (seconds since the series started, VmRSS KiB)
    warmup_kib: int
    redis_before: tuple[int, int]  # used_memory bytes, keys
    redis_after: tuple[int, int]
    outcomes: dict[str, int]
    cpu_share: float
    seconds: float
    metrics: dict[str, float]
    hwm_kib: int


def redis_memory(client: redis.Redis) -> tuple[int, int]:
    return int(client.info("memory")["used_memory"]), int(client.dbsize())


def soak(
    port: int,
    pid: int,
    metrics: Callable[[], dict[str, float]],
    redis_client: redis.Redis,
    args: argparse.Namespace,
    cpus: str | None,
    probe: Callable[[int], Path] | None = None,
) -> Soak:
    """The soak against the processor at ``port`` (process ``pid``; ``metrics``: its
    counters, {} for the no-op one). ``probe(n)``: take tracemalloc snapshot ``n`` (0 at the
    start of the series, 1 at its end, both with the streams still running)."""
    ctx = mp.get_context("spawn")
    k = args.soak_clients
    counts = ctx.Array("q", k * len(OUTCOMES), lock=False)
    stop = ctx.Value("b", 0, lock=False)
    tag = f"soak-{uuid.uuid4().hex[:8]}"
    per = [args.soak_streams // k + (i < args.soak_streams % k) for i in range(k)]
    plans = [
        SoakPlan(
            port,
            i,
            per[i],
            args.soak_tokens,
            args.soak_itl_ms / 1000,
            args.cut_share,
            args.cancel_share,
            tag,
            cpus,
        )
        for i in range(k)
    ]
    clients = [ctx.Process(target=soak_main, args=(p, counts, stop)) for p in plans]
    redis_before = redis_memory(redis_client)
    for c in clients:
        c.start()
    samples: list[tuple[float, int]] = []
    try:
        time.sleep(SOAK_WARMUP_S)  # every slot started, the mix steady
        warmup_kib = rss_kib(pid)
        if probe is not None:
            probe(0)
        c0, t0 = cpu_seconds(pid), time.monotonic()
        for j in range(int(args.soak_s // args.sample_s) + 1):
            time.sleep(max(0.0, t0 + j * args.sample_s - time.monotonic()))
            samples.append((time.monotonic() - t0, rss_kib(pid)))
            if j % 6 == 0:
                print(
                    f"  soak t={samples[-1][0]:4.0f} s: {mib(samples[-1][1])} MiB, "
                    f"{sum(counts[i * len(OUTCOMES)] for i in range(k)):,} completed",
                    flush=True,
                )
            if any(c.exitcode not in (None, 0) for c in clients):
                raise SystemExit("a soak client process failed")
        c1, t1 = cpu_seconds(pid), time.monotonic()
        if probe is not None:
            probe(1)
    finally:
        stop.value = 1
        for c in clients:
            c.join(60)
        for c in clients:
            if c.is_alive():
                c.terminate()
                c.join(5)
    wait_until(lambda: all_settled(metrics()), timeout_s=30)
    outcomes = {
        name: sum(counts[j * len(OUTCOMES) + n] for j in range(k))
        for n, name in enumerate(OUTCOMES)
    }
    return Soak(
        samples,
        warmup_kib,
        redis_before,
        redis_memory(redis_client),
        outcomes,
        (c1 - c0) / (t1 - t0),
        t1 - t0,
        metrics(),
        hwm_kib(pid),
    )


def slope_kib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(samples) < 2:
        return float("nan")
    xs = [t / 60 for t, _ in samples]
    ys = [float(v) for _, v in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def tight_tpm(args: argparse.Namespace) -> int:
    """About half of what the tight tenant's streams ask per minute: some are cut."""
    duration_s = args.soak_tokens * args.soak_itl_ms / 1000 + 0.05
    streams_per_min = args.soak_streams * args.cut_share * 60 / duration_s
    return max(200, int(streams_per_min * (args.soak_tokens + 20) / 2))


def write_config_with_tight(path: Path, redis_url: str, tpm: int) -> Path:
    """The rig's bench config plus a tenant whose TPM budget runs out each window."""
    write_bench_config(path, redis_url, batch_tokens=BATCH)
    doc = yaml.safe_load(path.read_text())
    doc["plans"]["tight"] = {
        "window_s": 60,
        "limits": {"*": {"tpm": tpm}},
        "charge_mode": "incremental",
        "batch_tokens": BATCH,
    }
    doc["tenants"][TIGHT_TENANT] = {"plan": "tight", "key_sha256": [key_hash(TIGHT_KEY)]}
    return write_config(path, doc)


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="soak of 60 s")
    parser.add_argument("--levels", default="1000,2000", help="concurrent open streams")
    parser.add_argument("--rounds", type=int, default=2, help="open/close rounds per processor")
    parser.add_argument("--hold-clients", type=int, default=2, help="client processes (part 1)")
    parser.add_argument("--pre-messages", type=int, default=5, help="tokens before holding")
    parser.add_argument("--trickle-s", type=float, default=5.0, help="held streams: token every")
    parser.add_argument("--warmup-streams", type=int, default=200)
    parser.add_argument("--soak-s", type=float, default=None, help="600 (--quick: 60)")
    parser.add_argument("--soak-streams", type=int, default=200)
    parser.add_argument("--soak-clients", type=int, default=2)
    parser.add_argument("--soak-tokens", type=int, default=100)
    parser.add_argument("--soak-itl-ms", type=float, default=100.0)
    parser.add_argument("--cut-share", type=float, default=0.1, help="streams on a tight budget")
    parser.add_argument("--cancel-share", type=float, default=0.05, help="streams cancelled")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument(
        "--soak-target",
        choices=("billing", "noop"),
        default="billing",
        help="processor soaked (noop: the baseline, to tell grpc/allocator drift from ours)",
    )
    parser.add_argument("--no-levels", action="store_true", help="soak only")
    parser.add_argument("--no-soak", action="store_true", help="held streams only")
    parser.add_argument(
        "--gc-probe",
        action="store_true",
        help="diagnostic: after the last round, gc.collect() then malloc_trim(0) in each "
        "processor (by signal, via a sitecustomize) and RSS after each",
    )
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="diagnostic: trace the billing processor's allocations (FRAMES frames per trace) "
        "from just before the soak, snapshot it at the start and the end of the soak, print "
        "the top growth sites (RSS figures then include tracemalloc's own overhead)",
    )
    args = parser.parse_args()
    if args.soak_s is None:
        args.soak_s = 60.0 if args.quick else 600.0
    args.levels = sorted(int(x) for x in args.levels.split(","))
    server_cpus, client_cpus = cores()

    began = time.monotonic()
    load_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    tpm = tight_tpm(args)
    with StopStack() as stops:
        redis_server = stops.push(RedisServer.start(workdir / "redis"))
        redis_client = redis.Redis(host="127.0.0.1", port=redis_server.port)
        stops.call(redis_client.close)
        saved = {
            k: os.environ.get(k) for k in ("PYTHONPATH", "BENCH_PROBE_DIR", "BENCH_TRACEMALLOC")
        }
        probe_dir = workdir / "gc_probe"
        if args.gc_probe or args.tracemalloc:  # the processors inherit these; restored
            probe_dir.mkdir()  # before any client starts
            (probe_dir / "sitecustomize.py").write_text(GC_PROBE)
            path = os.pathsep.join(filter(None, [str(probe_dir), saved["PYTHONPATH"]]))
            os.environ["PYTHONPATH"] = path
            os.environ["BENCH_PROBE_DIR"] = str(probe_dir)
        if args.tracemalloc:
            os.environ["BENCH_TRACEMALLOC"] = str(args.tracemalloc)
        try:
            noop: ManagedProcess
            noop, noop_port = start_noop_processor(workdir, server_cpus)
            stops.push(noop)
            config = write_config_with_tight(workdir / "quota.yaml", redis_server.url, tpm)
            billing = start_billing_processor(config, workdir, redis_server.url, server_cpus)
            stops.push(billing)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        started = {"noop": rss_kib(noop.pid), "billing": rss_kib(billing.process.pid)}
        print(
            f"processor memory: levels {', '.join(f'{n:,}' for n in args.levels)} open streams "
            f"× {args.rounds} rounds ({args.hold_clients} client processes), then a "
            f"{args.soak_s:.0f} s soak of {args.soak_streams} streams × {args.soak_tokens} "
            f"tokens at {args.soak_itl_ms:g} ms; processor on core {server_cpus}, clients on "
            f"core {client_cpus}; load average {load_start[0]:.1f} / {load_start[1]:.1f} / "
            f"{load_start[2]:.1f}; logs in {workdir}",
            flush=True,
        )
        held: dict[str, list[tuple[str, int]]] = {}
        held_errors: dict[str, int] = {}
        hold_s = 0.0
        if not args.no_levels:
            t = time.monotonic()
            held["noop"], held_errors["noop"] = hold_levels(
                "noop", noop_port, noop.pid, lambda: True, args, client_cpus
            )
            held["billing"], held_errors["billing"] = hold_levels(
                "billing",
                billing.port,
                billing.process.pid,
                lambda: all_settled(billing.metrics()),
                args,
                client_cpus,
            )
            hold_s = time.monotonic() - t
            held_metrics = billing.metrics()
        # The soak is one processor's alone.
        if args.soak_target == "billing":
            noop.stop()
            port, pid, metrics = billing.port, billing.process.pid, billing.metrics
        else:
            billing.stop()
            port, pid, metrics = noop_port, noop.pid, dict
        result: Soak | None = None
        if not args.no_soak:
            print(
                f"soak against the {args.soak_target} processor; tight tenant tpm {tpm:,} per "
                "60 s window",
                flush=True,
            )
            before_soak = rss_kib(pid)
            probe = None
            if args.tracemalloc:
                os.kill(pid, signal.SIGHUP)  # start tracing, before the soak's warm-up
                probe = lambda n: snapshot(pid, probe_dir, n)  # noqa: E731
            result = soak(port, pid, metrics, redis_client, args, client_cpus, probe)
    if held:
        report_levels(started, held, held_errors, held_metrics, args, hold_s)
    if result is not None:
        report_soak(result, args, tpm, before_soak)
        if args.tracemalloc:
            report_tracemalloc(probe_dir / "snap-0.snap", probe_dir / "snap-1.snap")
    load_end = os.getloadavg()
    print(
        f"\nload average at the end: {load_end[0]:.1f} / {load_end[1]:.1f} / {load_end[2]:.1f}; "
        f"whole run {time.monotonic() - began:.0f} s"
    )


def report_levels(
    started: dict[str, int],
    held: dict[str, list[tuple[str, int]]],
    errors: dict[str, int],
    metrics: dict[str, float],
    args: argparse.Namespace,
    seconds: float,
) -> None:
    names = ("noop", "billing")
    labels = [label for label, _ in held["noop"]]
    at = {n: dict(held[n]) for n in names}
    rows = [["started (fresh process)", mib(started["noop"]), mib(started["billing"]), ""]]
    for label in labels:
        rows.append(
            [
                label,
                mib(at["noop"][label]),
                mib(at["billing"][label]),
                mib(at["billing"][label] - at["noop"][label]),
            ]
        )
    print(f"\nVmRSS (MiB), streams held open mid-response — part 1 took {seconds:.0f} s")
    print(table(["state", "no-op", "billing", "billing − no-op"], rows))

    lo, hi = args.levels[0], args.levels[-1]
    idle = "idle (after warm-up)"
    slope_rows = []
    spans = [
        (f"round 1: idle → {lo:,}", idle, f"round 1: {lo:,} open", lo),
        (f"round 1: idle → {hi:,}", idle, f"round 1: {hi:,} open", hi),
    ]
    # Later rounds start on memory the first one freed but kept: only their marginal slope.
    spans += [
        (f"round {r}: {lo:,} → {hi:,}", f"round {r}: {lo:,} open", f"round {r}: {hi:,} open",
         hi - lo)
        for r in range(1, args.rounds + 1)
    ]  # fmt: skip
    for title, a, b, n in spans:
        if n <= 0:
            continue
        per = {x: (at[x][b] - at[x][a]) * 1000 / n for x in names}
        slope_rows.append(
            [
                title,
                mib(per["noop"]),
                mib(per["billing"]),
                mib(per["billing"] - per["noop"]),
                fmt(per["billing"] / 1000, 1),
            ]
        )
    print("\nRSS per 1,000 open streams (MiB) — the slope between two points")
    print(
        table(["between", "no-op", "billing", "billing − no-op", "billing KiB/stream"], slope_rows)
    )
    last = f"round {args.rounds}: all closed"
    top = f"round {args.rounds}: {hi:,} open"
    for x in names:
        peak = max(v for _, v in held[x])
        print(
            f"{x}: after close {mib(at[x][last])} MiB vs idle {mib(at[x][idle])} MiB "
            f"(+{mib(at[x][last] - at[x][idle])}; peak {mib(peak)}); {hi:,} open, round "
            f"{args.rounds} − round 1: {mib(at[x][top] - at[x][f'round 1: {hi:,} open'])} MiB; "
            f"stream errors {errors[x]}"
        )
    print(
        "billing processor, part 1: admitted "
        f"{int(metrics.get('extproc_requests_admitted_total', 0)):,}, "
        f"settled {int(metrics.get('extproc_settlements_total', 0))}"
        f", cut-offs {int(metrics.get('extproc_cutoffs_total', 0))}"
    )


def settled_by_reason(metrics: dict[str, float]) -> dict[str, int]:
    """``extproc_settlements_total{reason="x"}`` counters as {x: n}."""
    prefix = 'extproc_settlements_total{reason="'
    return {k[len(prefix) : -2]: int(v) for k, v in sorted(metrics.items()) if k.startswith(prefix)}


def _mean_between(samples: list[tuple[float, int]], lo: float, hi: float) -> float:
    values = [v for t, v in samples if lo <= t <= hi]
    return statistics.fmean(values) if values else float("nan")


def report_soak(s: Soak, args: argparse.Namespace, tpm: int, before_kib: int) -> None:
    span = s.samples[-1][0] if s.samples else 0.0
    window = min(60.0, span / 4) if span < 240 else 60.0
    first = _mean_between(s.samples, 0.0, window)
    last = _mean_between(s.samples, span - window, span)
    growth = last - first
    half = [p for p in s.samples if p[0] >= span / 2]
    values = [v for _, v in s.samples]
    peak = max(values)
    peak_t = next(t for t, v in s.samples if v == peak)
    o = s.outcomes
    streams = o["completed"] + o["cut"] + o["cancelled"]
    m = s.metrics
    print(
        f"\nsoak, {args.soak_target} processor: {args.soak_streams} streams at once, "
        f"{args.soak_tokens} tokens at {args.soak_itl_ms:g} ms, {s.seconds:.0f} s after a "
        f"{SOAK_WARMUP_S:.0f} s warm-up, VmRSS every {args.sample_s:g} s "
        f"({len(s.samples)} samples); processor CPU {100 * s.cpu_share:.0f}% of core 0"
    )
    w = f"{window:.0f} s"
    rows = [
        ["before the soak (idle)", mib(before_kib), ""],
        [f"after the {SOAK_WARMUP_S:.0f} s warm-up", mib(s.warmup_kib), ""],
        [f"first sample (t = {s.samples[0][0]:.0f} s)", mib(s.samples[0][1]), ""],
        [f"last sample (t = {s.samples[-1][0]:.0f} s)", mib(s.samples[-1][1]), ""],
        [f"max (t = {peak_t:.0f} s)", mib(peak), ""],
        [f"mean of the first {w}", mib(first), ""],
        [f"mean of the last {w}", mib(last), ""],
        [
            "growth, last − first",
            f"{mib(growth)} ({fmt(100 * ratio(growth, first), 2)}%)",
            f"≤ {100 * TARGET_GROWTH:g}%: {verdict(ratio(growth, first) <= TARGET_GROWTH)}",
        ],
        ["slope, whole soak (KiB/min)", fmt(slope_kib_per_min(s.samples), 1), ""],
        ["slope, second half (KiB/min)", fmt(slope_kib_per_min(half), 1), ""],
        ["peak VmHWM, whole process life", mib(s.hwm_kib), ""],
    ]
    print(table(["VmRSS (MiB)", "measured", "target"], rows))
    print(
        f"streams: {streams:,} run ({o['completed']:,} completed, {o['cut']:,} cut by the "
        f"budget, {o['cancelled']:,} cancelled by the client), {o['refused']:,} refused "
        f"(tight tenant, tpm {tpm:,}), {o['errors']} errors; {o['messages']:,} body messages "
        f"({fmt(o['messages'] / (s.seconds + SOAK_WARMUP_S), 0)}/s)"
    )
    if m:  # the billing processor: its counters, and what Redis holds
        print(
            f"processor counters: admitted {int(m.get('extproc_requests_admitted_total', 0)):,}, "
            f"cut-offs {int(m.get('extproc_cutoffs_total', 0)):,}, lease refusals "
            f"{int(m.get(LEASE_REFUSALS, 0)):,}, settled "
            + ", ".join(f"{reason} {n:,}" for reason, n in settled_by_reason(m).items())
        )
        (b0, k0), (b1, k1) = s.redis_before, s.redis_after
        print(
            f"redis-server: used_memory {fmt(b0 / 2**20, 1)} → {fmt(b1 / 2**20, 1)} MiB, keys "
            f"{k0:,} → {k1:,} (request records live an hour by design)"
        )
    print("samples (s: MiB): " + ", ".join(f"{t:.0f}: {mib(v)}" for t, v in s.samples))


def short_path(filename: str) -> str:
    """A path relative to the checkout, or from site-packages on."""
    path = Path(filename)
    if path.is_relative_to(ROOT / ".venv") or not path.is_relative_to(ROOT):
        parts = path.parts
        cut = parts.index("site-packages") + 1 if "site-packages" in parts else -3
        return "/".join(parts[cut:])
    return str(path.relative_to(ROOT))


def report_tracemalloc(first: Path, last: Path, top: int = 15) -> None:
    """Allocation sites that grew most between two snapshots of the billing processor."""
    import tracemalloc

    ignore = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
        tracemalloc.Filter(False, "<unknown>"),
    ]
    a = tracemalloc.Snapshot.load(str(first)).filter_traces(ignore)
    b = tracemalloc.Snapshot.load(str(last)).filter_traces(ignore)
    total = sum(x.size for x in b.statistics("filename")) - sum(
        x.size for x in a.statistics("filename")
    )
    print(
        f"\ntracemalloc, soaked processor, soak end − soak start (after gc.collect()): "
        f"traced memory {fmt(total / 1024, 1)} KiB"
    )
    rows = []
    by_growth = sorted(b.compare_to(a, "lineno"), key=lambda x: x.size_diff, reverse=True)
    for stat in by_growth[:top]:
        frame = stat.traceback[0]
        where = f"{short_path(frame.filename)}:{frame.lineno}"
        rows.append(
            [
                where,
                fmt(stat.size_diff / 1024, 1),
                f"{stat.count_diff:+,}",
                fmt(stat.size / 1024, 1),
            ]
        )
    print(table(["site (file:line)", "Δ KiB", "Δ blocks", "KiB at end"], rows))
    growing = [s for s in b.compare_to(a, "traceback") if s.size_diff > 0][:3]
    for stat in growing:
        print(f"\n+{fmt(stat.size_diff / 1024, 1)} KiB ({stat.count_diff:+,} blocks) from:")
        frames = [f for f in reversed(stat.traceback) if "/asyncio/" not in f.filename]
        for f in frames[:8]:
            code = linecache.getline(f.filename, f.lineno).strip()
            print(f"    {short_path(f.filename)}:{f.lineno}  {code}")


if __name__ == "__main__":
    main()
