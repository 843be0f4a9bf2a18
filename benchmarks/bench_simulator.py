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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadlab.machine import cpu_seconds
from loadlab.simulator import PROFILES_DIR, Simulator

TARGET_EVENTS_PER_S = 20_000


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
    parser.add_argument("--profile", default=str(PROFILES_DIR / "fast.yaml"))
    args = parser.parse_args()

    sim = Simulator(args.profile, log_dir=Path(tempfile.mkdtemp(prefix="llmsim-bench-")))
    try:
        cpu_before = cpu_seconds(sim.pid)
        started = time.monotonic()
        events, size, requests = asyncio.run(
            _drive(sim.port, args.streams, args.seconds, args.tokens)
        )
        wall = time.monotonic() - started
        cpu = cpu_seconds(sim.pid) - cpu_before
    finally:
        sim.stop()

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
