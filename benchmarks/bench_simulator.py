"""Streamed SSE events per second from one llmsim process (fast.yaml, 200 concurrent streams).

The simulator must never be what bounds the gateway's benchmarks, so the target is at least
20,000 events/s on one core. The client runs in this process on raw sockets (so parsing
cost stays off the measurement as much as possible); the simulator runs in a child process
whose CPU time is read from /proc, giving events per simulator CPU-second as well as per
wall-clock second.

    .venv/bin/python benchmarks/bench_simulator.py [--streams 200] [--seconds 8] [--tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_EVENTS_PER_S = 20_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmsim exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("llmsim did not become healthy")


async def _one_stream(port: int, body: bytes) -> tuple[int, int]:
    """(events, bytes) of one streamed request, read to the end of the response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    writer.write(request)
    events = 0
    size = 0
    carry = b""
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            size += len(data)
            window = carry + data
            events += window.count(b"data: ")
            carry = data[-5:]  # a marker split across reads is counted once, in the next window
            events -= carry.count(b"data: ")
    finally:
        writer.close()
    return events, size


async def _drive(port: int, streams: int, seconds: float, tokens: int) -> tuple[int, int, int]:
    body = (
        b'{"model":"gpt-4.1","messages":[{"role":"user","content":"benchmark"}],'
        b'"stream":true,"max_tokens":%d,"ignore_eos":true}' % tokens
    )
    deadline = time.monotonic() + seconds
    totals = [0, 0, 0]  # events, bytes, requests

    async def worker() -> None:
        while time.monotonic() < deadline:
            events, size = await _one_stream(port, body)
            totals[0] += events
            totals[1] += size
            totals[2] += 1

    await asyncio.gather(*(worker() for _ in range(streams)))
    return totals[0], totals[1], totals[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=400, help="tokens per streamed answer")
    parser.add_argument("--profile", default=str(REPO / "simulator_profiles" / "fast.yaml"))
    args = parser.parse_args()

    port = _free_port()
    log_path = Path(tempfile.mkdtemp(prefix="llmsim-bench-")) / "llmsim.log"
    log = log_path.open("wb")
    argv = [sys.executable, "-m", "llmsim", "--config", args.profile, "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, proc)
        cpu_before = _cpu_seconds(proc.pid)
        started = time.monotonic()
        events, size, requests = asyncio.run(_drive(port, args.streams, args.seconds, args.tokens))
        wall = time.monotonic() - started
        cpu = _cpu_seconds(proc.pid) - cpu_before
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()

    per_wall = events / wall
    per_cpu = events / cpu if cpu > 0 else float("inf")
    print(f"profile               {Path(args.profile).name}")
    print(f"concurrent streams    {args.streams}")
    print(f"tokens per answer     {args.tokens}")
    print(f"requests completed    {requests}")
    print(f"SSE events received   {events}  ({size / 1e6:.1f} MB)")
    print(f"wall time             {wall:.2f} s")
    print(f"simulator CPU time    {cpu:.2f} s  ({cpu / wall:.0%} of one core)")
    print(
        f"events/s (wall)       {per_wall:,.0f}   target {TARGET_EVENTS_PER_S:,}"
        f"   ratio {per_wall / TARGET_EVENTS_PER_S:.2f}"
    )
    print(
        f"events/s per CPU-s    {per_cpu:,.0f}   target {TARGET_EVENTS_PER_S:,}"
        f"   ratio {per_cpu / TARGET_EVENTS_PER_S:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
