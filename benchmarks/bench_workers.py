"""Body messages/s through ``extproc serve`` with 1 worker and with 2 workers on one port.

The clients are bench_processor_throughput.py's (``loadlab.grpc_load``: processes playing Envoy on
the gRPC Process stream, one FDX body message per token, billing on, a real redis-server),
run against a plain processor (``--workers 1``) and then against ``--workers 2``: two
worker processes sharing one port with SO_REUSEPORT, behind one supervisor.

The kernel hands each new connection to a worker by a hash of its addresses, and each
client process holds ONE connection, so two clients land on the same worker half the
time. Here a client whose connection went to a worker that already has its share is
stopped and started again (a new source port), until each worker has the same number of
clients — read from /proc (which worker process owns the server end of each client's
connection), never guessed. Envoy's equivalent is renewing its connections
(``max_requests_per_connection``, see extproc/app/workers.py).

Cores (the machine has 2, shared with the clients): 1 worker — the worker on core 0, the
clients on core 1, as bench_processor_throughput.py; 2 workers — worker 0 on core 0,
worker 1 on core 1 (every thread, ``sched_setaffinity`` once it is up), the clients free
on both cores, so they take CPU from the workers. The supervisor and redis-server are not
pinned. Reported: messages/s (wall), each part's CPU-seconds over the measured interval,
and messages per processor CPU-second (workers + supervisor), which compares the two
set-ups whatever the clients took.

    .venv/bin/python benchmarks/bench_workers.py [--quick] [--clients 2] [--streams 64]
        [--tokens 256] [--seconds 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab.figures import fmt, ratio, table
from loadlab.gateway import grpc_serving, http_get, wait_until
from loadlab.grpc_load import (
    BATCH,
    ClientPlan,
    all_settled,
    client_main,
    load_args,
    load_arguments,
)
from loadlab.machine import busy_jiffies, cpu_seconds, pinned
from loadlab.metrics import parse_metrics
from loadlab.procs import ManagedProcess, StopStack, free_port, free_port_run
from loadlab.redis_server import RedisServer
from loadlab.rig import ROOT, write_bench_config

MAX_REDIALS = 40  # clients restarted to balance connections, per phase


# -- which worker holds which client's connection (/proc) ---------------------------------


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def _tcp_rows() -> list[tuple[int, int, int]]:
    """(local port, remote port, inode) of every established loopback TCP socket."""
    rows = []
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table_path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01":  # ESTABLISHED
                rows.append(
                    (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), int(f[9]))
                )
    return rows


def connections(server_port: int, workers: list[int], clients: list[int]) -> dict[int, int]:
    """Client pid → index of the worker holding its connection to ``server_port``."""
    worker_of_inode = {i: w for w, pid in enumerate(workers) for i in _socket_inodes(pid)}
    client_of_inode = {i: pid for pid in clients for i in _socket_inodes(pid)}
    rows = _tcp_rows()
    worker_of_peer = {
        remote: worker_of_inode[inode]
        for local, remote, inode in rows
        if local == server_port and inode in worker_of_inode
    }
    return {
        client_of_inode[inode]: worker_of_peer[local]
        for local, remote, inode in rows
        if remote == server_port and inode in client_of_inode and local in worker_of_peer
    }


# -- processors ---------------------------------------------------------------------------


def pin_all_threads(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` on ``cpu`` (threads made later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def metrics_of(port: int) -> dict[str, float]:
    _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    return parse_metrics(text)


def answers(port: int) -> bool:
    try:
        http_get(f"http://127.0.0.1:{port}/metrics", 0.5)
        return True
    except OSError:
        return False


@dataclass
class Served:
    """``extproc serve --workers N``: the process started, its workers' pids and ports."""

    process: ManagedProcess
    port: int
    metrics: int
    workers: list[int]  # pids, by index (the process itself when N = 1)

    @property
    def processor_pids(self) -> list[int]:
        extra = [] if self.workers == [self.process.pid] else [self.process.pid]
        return [*self.workers, *extra]

    def worker_metrics(self) -> list[dict[str, float]]:
        return [metrics_of(self.metrics + i) for i in range(len(self.workers))]


def serve(config: Path, redis_url: str, workers: int, log_dir: Path) -> Served:
    port = free_port()
    metrics = free_port_run(workers)
    argv = [
        sys.executable, "-m", "extproc", "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}",
        "--redis-url", redis_url, "--workers", str(workers),
        "--drain-delay-s", "0", "--log-level", "warning",
    ]  # fmt: skip
    # One worker: the plain processor, pinned from the start as in the throughput bench.
    process = ManagedProcess(
        pinned(argv, "0") if workers == 1 else argv, log_dir / f"serve-{workers}.log", cwd=ROOT
    )
    if workers == 1:
        process.wait_ready(lambda: grpc_serving(port) and answers(metrics), timeout_s=60)
        return Served(process, port, metrics, [process.pid])

    def up() -> bool:
        return len(children(process.pid)) == workers and all(
            answers(metrics + i) for i in range(workers)
        )

    process.wait_ready(up, timeout_s=90)
    by_port = {}
    for pid in children(process.pid):
        argv_of = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        by_port[int(argv_of[argv_of.index("--metrics-listen") + 1].rpartition(":")[2])] = pid
    pids = [by_port[metrics + i] for i in range(workers)]
    for index, pid in enumerate(pids):
        pin_all_threads(pid, index % (os.cpu_count() or 1))
    return Served(process, port, metrics, pids)


# -- one measured phase ---------------------------------------------------------------------


@dataclass
class Phase:
    workers: int
    messages: int
    seconds: float
    processor_cpu_s: float  # workers + supervisor, measured interval
    worker_cpu_s: list[float]
    client_cpu_s: float  # measured interval
    redis_cpu_s: float
    other_cpu_s: float  # everything else the machine ran meanwhile (other users, kernel)
    worker_messages: list[int]  # from each worker's /metrics, measured interval
    requests: int
    errors: int
    redials: int

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds

    @property
    def per_cpu_s(self) -> float:
        return ratio(self.messages, self.processor_cpu_s)


def machine_busy_s() -> float:
    """CPU-seconds every core spent busy so far (all processes, steal included)."""
    return busy_jiffies()[0] / os.sysconf("SC_CLK_TCK")


def _sum_cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def run_phase(served: Served, redis_pid: int, args: argparse.Namespace, client_cpus: str) -> Phase:
    workers = len(served.workers)
    if args.clients % workers:
        raise SystemExit(f"--clients {args.clients} does not split evenly over {workers}")
    share = args.clients // workers
    ctx = mp.get_context("spawn")
    sent: SynchronizedArray = ctx.Array("q", args.clients, lock=False)  # type: ignore[assignment]
    stop = ctx.Value("b", 0, lock=False)
    results = ctx.Queue()
    tag = f"w{workers}-{uuid.uuid4().hex[:8]}"
    kept: list[Any] = []
    taken = [0] * workers
    redials = 0
    try:
        for index in range(args.clients):
            plan = ClientPlan(
                served.port, index, args.streams, args.tokens, args.window, tag, client_cpus
            )
            while True:
                client = ctx.Process(target=client_main, args=(plan, sent, stop, results))
                client.start()
                found: dict[int, int] = {}

                def connected(pid: int = client.pid, found: dict[int, int] = found) -> bool:
                    found.update(connections(served.port, served.workers, [pid]))
                    return pid in found

                if not wait_until(connected, timeout_s=60, interval_s=0.05):
                    raise SystemExit("a client process never connected to the processor")
                worker = found[client.pid]
                if taken[worker] < share:
                    taken[worker] += 1
                    kept.append(client)
                    break
                # Its connection went to a worker that has its share: dial again.
                client.terminate()
                client.join(30)
                redials += 1
                if redials > MAX_REDIALS:
                    raise SystemExit("the kernel kept putting the clients on one worker")
        time.sleep(args.warmup)  # first admissions, tokenizer warm, all streams running
        client_pids = [c.pid for c in kept]
        processors = served.processor_pids

        def sample() -> tuple[int, list[int], list[float], float, float, float, float]:
            per_worker = [int(m["extproc_body_messages_total"]) for m in served.worker_metrics()]
            return (
                sum(sent),
                per_worker,
                [cpu_seconds(p) for p in served.workers],
                _sum_cpu(processors),
                _sum_cpu(client_pids),
                cpu_seconds(redis_pid),
                machine_busy_s(),
            )

        t0, s0 = time.monotonic(), sample()
        time.sleep(args.seconds)
        t1, s1 = time.monotonic(), sample()
    finally:
        stop.value = 1
    for c in kept:
        c.join(120)
    if any(c.exitcode != 0 for c in kept):
        raise SystemExit(f"a client process failed against {workers} worker(s) (see above)")
    outcomes = [results.get(timeout=5) for _ in kept]
    return Phase(
        workers=workers,
        messages=s1[0] - s0[0],
        seconds=t1 - t0,
        processor_cpu_s=s1[3] - s0[3],
        worker_cpu_s=[b - a for a, b in zip(s0[2], s1[2], strict=True)],
        client_cpu_s=s1[4] - s0[4],
        redis_cpu_s=s1[5] - s0[5],
        other_cpu_s=(s1[6] - s0[6]) - (s1[3] - s0[3]) - (s1[4] - s0[4]) - (s1[5] - s0[5]),
        worker_messages=[b - a for a, b in zip(s0[1], s1[1], strict=True)],
        requests=sum(r for r, _, _ in outcomes),
        errors=sum(e for _, e, _ in outcomes),
        redials=redials,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    load_arguments(parser, clients="client processes (even)")
    args = load_args(parser)
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        raise SystemExit("needs 2 cores and sched_setaffinity (Linux)")

    workdir = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    phases: list[Phase] = []
    with StopStack() as stops:
        redis = stops.push(RedisServer.start(workdir / "redis"))
        config = write_bench_config(workdir / "quota.yaml", redis.url, batch_tokens=BATCH)
        print(
            f"workers: {args.clients} client processes × {args.streams} streams, {args.tokens} "
            f"token chunks per response, batch {BATCH}, Redis on; load average "
            f"{os.getloadavg()[0]:.1f}; logs in {workdir}",
            flush=True,
        )
        for workers, client_cpus in ((1, "1"), (2, "0,1")):
            served = serve(config, redis.url, workers, workdir)
            stops.push(served.process)
            phases.append(run_phase(served, redis.pid, args, client_cpus))
            print(f"  {workers} worker(s): {phases[-1].per_s:,.0f} msg/s", flush=True)
            # Every stream ended: wait for the spawned settlements before stopping.
            wait_until(
                lambda s=served: all(all_settled(m) for m in s.worker_metrics()), timeout_s=15
            )
            served.process.stop(timeout_s=30)
    report(phases)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


def report(phases: list[Phase]) -> None:
    one, two = phases
    rows = []
    for p in phases:
        total = sum(p.worker_messages) or 1
        rows.append(
            [
                f"{p.workers} worker{'s' if p.workers > 1 else ''}",
                fmt(p.per_s, 0),
                fmt(p.processor_cpu_s, 2),
                " + ".join(fmt(c, 2) for c in p.worker_cpu_s),
                fmt(p.per_cpu_s, 0),
                " / ".join(f"{100 * m / total:.0f}%" for m in p.worker_messages),
                fmt(p.client_cpu_s, 2),
                fmt(p.redis_cpu_s, 2),
                fmt(p.other_cpu_s, 2),
                f"{p.requests:,}",
                str(p.errors),
                str(p.redials),
            ]
        )
    rows.append(
        [
            "2 / 1",
            fmt(ratio(two.per_s, one.per_s), 2) + "×",
            fmt(ratio(two.processor_cpu_s, one.processor_cpu_s), 2) + "×",
            "",
            fmt(ratio(two.per_cpu_s, one.per_cpu_s), 2) + "×",
            "",
            "",
            "",
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
                "set-up",
                "body msg/s",
                "proc CPU-s",
                "per worker",
                "msg per proc CPU-s",
                "msg split",
                "client CPU-s",
                "redis CPU-s",
                "other CPU-s",
                "requests",
                "errors",
                "redials",
            ],
            rows,
        )
    )
    print(
        f"\nmeasured over {one.seconds:.1f} s / {two.seconds:.1f} s; CPU-seconds are over "
        "the same interval. Pinning: 1 worker — worker on core 0 (taskset -c 0), clients on "
        "core 1 (sched_setaffinity); 2 workers — worker 0 on core 0, worker 1 on core 1 "
        "(sched_setaffinity on every thread), clients on cores 0,1; supervisor and "
        "redis-server unpinned. proc CPU-s includes the supervisor; other CPU-s: what "
        f"the rest of the machine took (/proc/stat busy minus ours) of the "
        f"{fmt((os.cpu_count() or 1) * one.seconds, 0)} core-seconds there were."
    )
    print(
        f"scaling: {fmt(ratio(two.per_s, one.per_s), 2)}× the messages/s with 2 workers "
        f"(the ceiling here is below 2×: the clients' {fmt(two.client_cpu_s, 1)} CPU-s come "
        f"out of the same 2 cores); {fmt(ratio(two.per_cpu_s, one.per_cpu_s), 2)}× the "
        "messages per processor CPU-second."
    )


if __name__ == "__main__":
    main()
