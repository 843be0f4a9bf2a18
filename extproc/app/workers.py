"""``extproc serve --workers N``: N processor processes sharing ONE listening port.

One CPython process tops out at a few thousand ext_proc messages per second (grpc.aio's
own cost per message dominates), so a busy Envoy gets N workers. Each worker is a whole
processor (its own process, event loop, Redis connections, heartbeat and /metrics) and
binds the same ``--listen`` address with SO_REUSEPORT (grpc's ``grpc.so_reuseport``, on
by default in grpc core), so Envoy's processor cluster lists ONE endpoint and the kernel
hands each new connection to one of the workers. Workers share nothing but Redis, exactly
like replicas behind different Envoys, so ``memory://`` (one counter per process: every
limit × N) is refused, and so is port 0 (each worker would get a port of its own).

The kernel balances connections, not streams, and Envoy multiplexes every stream to the
processor on a few long-lived HTTP/2 connections (one per Envoy worker thread; more only
past the peer's concurrent-stream limit, 10000 here). Measured with Envoy 1.40 and two
workers: with the shipped cluster all 400 streams of a run went to one worker (one
connection); ``--concurrency 2`` opened two connections and both landed on the same worker
in both runs. The knob is the processor cluster's ``max_requests_per_connection`` (in
``common_http_protocol_options``): Envoy retires a connection after that many streams and
its successor lands on a worker the kernel picks. At 100, 400 streams split 200/200 (and
once 100/300 at one stream in flight) with the processor's CPU per request unchanged
(1.4–2.7 ms, as without it); at 1 (a connection per stream) the split is even stream by
stream but each request costs the processor ~1 ms more CPU. tests/gateway/test_workers.py
uses 1, so that 20 requests reach both workers.

Prometheus must scrape each worker (a scrape of a shared port would reach a random one),
so worker ``i`` serves /metrics on ``--metrics-listen`` port + ``i``.

The supervisor, like gunicorn's arbiter: SIGTERM/SIGINT are passed to every worker so
each drains as a lone processor does; SIGHUP is passed to every running worker, and each
reloads the configuration file on its own (each also polls the file); a worker that exits
while nobody asked it to is started again (logged), after a delay that doubles with each
death of a worker that had not yet run ``STABLE_S`` — and after ``MAX_QUICK_DEATHS`` such
deaths in a row the supervisor stops the others and exits 1 (a worker crashing at start
never spins). A clean stop exits 0.

A hung worker is replaced too. Each worker's event loop writes a byte to a pipe of its own
every ``beat_interval(timeout)`` once it serves (``beat_supervisor``); a worker whose pipe
stays silent ``--worker-timeout-s`` (10 s; SIGSTOPped, its loop blocked, deadlocked) or
that does not serve within ``START_TIMEOUT_S`` is SIGKILLed (logged ``worker_hung``) and
restarted like a dead one. Its clients' streams are cut (a hung loop answers nothing); its
open records are settled by a live peer from Redis (``extproc.quota.liveness.orphans``: within
``heartbeat_ttl_s`` + ``orphan_sweep_s`` of its last heartbeat, which stopped with its loop).

Each worker knows its index and the number of workers (``WorkerRole``): its log records
carry ``"worker": i``, and it takes ``1/N`` of each fail-open allowance
(``fail_open_fraction`` is per ``serve`` process, i.e. per host, whatever N).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

import structlog

log = structlog.get_logger("extproc.workers")

STABLE_S = 30.0  # a worker that ran this long before dying had started fine
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 8.0
MAX_QUICK_DEATHS = 5  # in a row, for one worker: 0.5 + 1 + 2 + 4 + 8 s of trying
TICK_S = 0.1  # how often the supervisor looks at its workers
PR_SET_PDEATHSIG = 1
WORKER_TIMEOUT_S = 10.0  # a serving worker silent this long is hung
START_TIMEOUT_S = 120.0  # a worker not serving after this long is hung (tokenizers load first)


def beat_interval(timeout_s: float) -> float:
    """Ten beats per timeout, at most one a second: a few late ones never look hung."""
    return min(1.0, timeout_s / 10)


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """What a worker is told by its supervisor (hidden ``serve`` options)."""

    index: int
    count: int
    beat_fd: int | None = None  # the pipe to write beats to (None: nobody watches)
    beat_interval_s: float = 1.0


async def beat_supervisor(role: WorkerRole) -> None:
    """Write one byte per interval to the supervisor's pipe, from the event loop: a loop that
    stops turning (SIGSTOP, a blocking call, a deadlock) stops the beats."""
    fd = role.beat_fd
    if fd is None:
        return
    os.set_blocking(fd, False)
    while True:
        # Full (the supervisor is behind) or closed (it is gone): nothing to do either way.
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(fd, b".")
        await asyncio.sleep(role.beat_interval_s)


def _port(address: str) -> int | None:
    _, _, port = address.rpartition(":")
    return int(port) if port.isdigit() else None


def _shift(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset}"


def refusal(workers: int, listen: str, redis_url: str, metrics: str | None) -> str | None:
    """Why ``workers`` > 1 workers can't run with these settings, or None if they can."""
    if redis_url.startswith("memory://"):
        return (
            f"--workers {workers} needs a shared quota backend, but redis_url is memory://: "
            f"each worker would count alone and every limit would be multiplied by {workers}. "
            "Set redis_url (or --redis-url) to a Redis, or run one worker."
        )
    if _port(listen) == 0:
        return (
            f"--workers {workers} share one listen port, but {listen} asks each worker for a "
            "port of its own (port 0): give --listen a fixed port."
        )
    if metrics is not None:
        first = _port(metrics)
        if first is None or first == 0 or first + workers - 1 > 65535:
            return (
                f"--metrics-listen {metrics} with --workers {workers}: worker i serves "
                "/metrics on that port + i, so it needs a fixed port with room for "
                f"{workers} consecutive ports."
            )
    return None


def worker_argv(argv: list[str], role: WorkerRole, listen: str, metrics: str | None) -> list[str]:
    """The serve command line of a worker: the shared gRPC port, its metrics port, its role."""
    out = [sys.executable, "-m", "extproc", "serve", *argv, "--workers", "1"]
    out += [
        "--listen",
        listen,
        "--worker-index",
        str(role.index),
        "--worker-count",
        str(role.count),
    ]
    if role.beat_fd is not None:
        out += ["--worker-beat-fd", str(role.beat_fd)]
        out += ["--worker-beat-interval-s", str(role.beat_interval_s)]
    if metrics:
        out += ["--metrics-listen", _shift(metrics, role.index)]
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM (drain) when the supervisor dies, even by SIGKILL;
    SIGHUP ignored (kept across exec) until the worker's reload handler replaces it, so a
    reload passed on to a worker still starting doesn't kill it."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class _Slot:
    index: int
    count: int
    argv: list[str]  # the shared serve options
    listen: str
    metrics: str | None
    timeout_s: float  # 0: no hang detection
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None  # None: start at the next look
    beats: int | None = None  # the read end of this worker's beat pipe
    beat_at: float | None = None  # the last beat seen (None: not serving yet)
    killed_hung: bool = False  # the last death was ours: it had gone silent

    def start(self) -> None:
        self.close_pipe()
        write_end = None
        if self.timeout_s > 0:
            self.beats, write_end = os.pipe()
            os.set_blocking(self.beats, False)
        role = WorkerRole(self.index, self.count, write_end, beat_interval(self.timeout_s or 10))
        argv = worker_argv(self.argv, role, self.listen, self.metrics)
        # Its own process group: a terminal's Ctrl-C reaches the supervisor only, which
        # passes it on once (a worker still starting, with no handler yet, dies of it —
        # holding no stream).
        try:
            self.proc = subprocess.Popen(
                argv,
                process_group=0,
                preexec_fn=_die_with_parent,
                pass_fds=() if write_end is None else (write_end,),
            )
        finally:
            if write_end is not None:
                os.close(write_end)  # the worker holds it now
        self.started_at = time.monotonic()
        self.beat_at = None
        self.killed_hung = False
        log.info("worker_started", worker=self.index, pid=self.proc.pid)

    def close_pipe(self) -> None:
        if self.beats is not None:
            os.close(self.beats)
            self.beats = None

    def check_beats(self, now: float) -> None:
        """Take the beats the worker wrote; SIGKILL it when it has gone silent too long."""
        if self.beats is None or self.proc is None or self.killed_hung:
            return
        with contextlib.suppress(BlockingIOError):
            while os.read(self.beats, 4096):
                self.beat_at = now
        if self.beat_at is None:
            silent, limit = now - self.started_at, max(START_TIMEOUT_S, self.timeout_s)
        else:
            silent, limit = now - self.beat_at, self.timeout_s
        if silent <= limit:
            return
        log.error(
            "worker_hung",
            worker=self.index,
            pid=self.proc.pid,
            silent_s=round(silent, 1),
            serving=self.beat_at is not None,
            detail="SIGKILL: its open records are settled by a peer",
        )
        self.killed_hung = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def _exit_code(code: int, forwarded: set[int]) -> int:
    # A worker killed by the very signal it was passed had not installed its handlers yet:
    # it was still starting, held no stream, and stopped as asked.
    if code < 0 and -code in forwarded:
        return 0
    return code if code >= 0 else 128 - code


def supervise(
    argv: list[str],
    workers: int,
    listen: str,
    metrics: str | None,
    timeout_s: float = WORKER_TIMEOUT_S,
) -> int:
    """Run ``workers`` workers until told to stop (SIGTERM/SIGINT); the exit code.
    ``timeout_s``: a serving worker silent that long is killed and replaced (0: never)."""
    slots = [_Slot(i, workers, argv, listen, metrics, timeout_s) for i in range(workers)]
    received: list[int] = []  # signals not yet passed on
    forwarded: set[int] = set()

    # The handler only notes the signal; the loop passes it on, so a worker being started
    # while it arrives is not missed.
    def note(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGHUP, note)
    log.info(
        "workers_starting",
        workers=workers,
        listen=listen,
        metrics=[_shift(metrics, i) for i in range(workers)] if metrics else None,
    )
    failed = False
    finals: dict[int, int] = {}  # worker -> exit code after the stop began
    while True:
        while received:
            signum = received.pop(0)
            if signum == signal.SIGHUP:  # a reload: every running worker, no stop
                pids = [s.proc.pid for s in slots if s.proc is not None and s.proc.poll() is None]
                log.info("workers_reloading", pids=pids)
                for slot in slots:
                    if slot.proc is not None and slot.proc.poll() is None:
                        slot.proc.send_signal(signum)
                continue
            if not forwarded:
                log.info("workers_stopping", signal=signal.Signals(signum).name)
            forwarded.add(signum)
            for slot in slots:
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.send_signal(signum)
        stopping = bool(forwarded)
        now = time.monotonic()
        running = 0
        for slot in slots:
            if slot.proc is None:
                if not (stopping or failed) and (slot.restart_at is None or now >= slot.restart_at):
                    slot.start()
                    running += 1
                continue
            slot.check_beats(now)
            code = slot.proc.poll()
            if code is None:
                running += 1
                continue
            pid, slot.proc = slot.proc.pid, None
            slot.close_pipe()
            if stopping or failed:  # failed: another worker gave up in this same pass
                finals[slot.index] = _exit_code(code, forwarded)
                continue
            lived = now - slot.started_at
            slot.quick_deaths = slot.quick_deaths + 1 if lived < STABLE_S else 1
            if slot.quick_deaths > MAX_QUICK_DEATHS:
                log.error(
                    "worker_keeps_dying",
                    worker=slot.index,
                    pid=pid,
                    code=code,
                    deaths=MAX_QUICK_DEATHS + 1,
                    detail="giving up: stopping the other workers",
                )
                failed = True
                received.append(signal.SIGTERM)
                continue
            delay = min(MAX_RESTART_DELAY_S, FIRST_RESTART_DELAY_S * 2 ** (slot.quick_deaths - 1))
            slot.restart_at = now + delay
            log.warning(
                "worker_died",
                worker=slot.index,
                pid=pid,
                code=code,
                hung=slot.killed_hung,
                ran_s=round(lived, 1),
                restart_in_s=delay,
            )
        if stopping and running == 0:
            break
        time.sleep(TICK_S)

    # A worker waiting to be restarted when the stop came has no final code: its death was
    # already handled.
    code = 1 if failed else max(finals.values(), default=0, key=abs)
    log.info("workers_stopped", code=code, codes=[finals.get(i) for i in range(workers)])
    return code
