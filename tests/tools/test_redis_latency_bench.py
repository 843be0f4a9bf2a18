"""The delaying relay of ``bench_redis_latency.py`` and the benchmark itself, as processes.

The relay must add at least the round trip it is told (each PING through it takes that
long; no upper bound: a shared machine's timers fire late) and pass every byte on, in
order, both ways. The benchmark's quick mode must run end to end and leave its report.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from loadlab.delay_relay import RelayProcess, ping_rtt_ms
from loadlab.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def resp(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(out)


def exchange(port: int, request: bytes, reply_size: int, rng: random.Random) -> bytes:
    """``request`` written in pieces of random sizes (each its own segment, most of them),
    then read until ``reply_size`` bytes came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        at = 0
        while at < len(request):
            size = rng.choice((1, 7, 100, 4096, 65536))
            sock.sendall(request[at : at + size])
            at += size
            if rng.random() < 0.05:
                time.sleep(0.002)
        got = bytearray()
        while len(got) < reply_size:
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed after {len(got)} of {reply_size} bytes"
            got += chunk
        return bytes(got)


def test_relay_adds_at_least_the_round_trip_it_is_given(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    relay = RelayProcess(redis_server.port, 40.0, tmp_path)
    try:
        through = ping_rtt_ms(relay.port, 10)
    finally:
        relay.stop()
    assert all(ms >= 40.0 for ms in through), through
    stats = relay.stats()
    assert stats is not None
    assert stats["rtt_ms"] == 40.0
    assert stats["chunks"] == 20  # a PING and a PONG each, none merged or split here
    assert stats["bytes"] == 10 * (len(b"PING\r\n") + len(b"+PONG\r\n"))
    assert stats["lateness_ms"]["p50"] >= 0  # a chunk never leaves before its delay


def test_relay_passes_every_byte_on_in_order(redis_server: RedisServer, tmp_path: Path) -> None:
    rng = random.Random(24)
    values = {
        f"relay-bytes:{i}".encode(): rng.randbytes(rng.choice((0, 1, 13, 1000, 70000)))
        for i in range(200)
    }
    values[b"relay-bytes:big"] = rng.randbytes(1 << 20)
    sets = b"".join(resp(b"SET", k, v) for k, v in values.items())
    gets = b"".join(resp(b"GET", k) for k in values)
    expected = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in values.values())
    relay = RelayProcess(redis_server.port, 2.0, tmp_path)
    try:
        # Pipelined both ways: the writes land in the server in the order sent, and the
        # replies come back in that order, whatever pieces they travel in.
        assert exchange(relay.port, sets, 5 * len(values), rng) == b"+OK\r\n" * len(values)
        assert exchange(relay.port, gets, len(expected), rng) == expected
    finally:
        relay.stop()
    stats = relay.stats()
    assert stats is not None
    assert stats["bytes"] == len(sets) + 5 * len(values) + len(gets) + len(expected)


def test_the_benchmark_runs_end_to_end_with_and_without_admission_leases(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_redis_latency.py", "--quick", "--rtt-ms", "20",
         "--levels", "1,3", "--requests", "3", "--output-tokens", "40", "--budget-s", "1",
         "--admission-leases", "both", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [(r["rtt_ms"], r["run"]) for r in report["rtts"]] == [
        (20.0, "rtt-20"),
        (20.0, "rtt-20+leases"),
    ]
    for info in report["rtts"]:
        assert info["ping_ms"]["min"] >= info["rtt_ms"]  # the relay adds what it was told
        assert info["relay"]["chunks"] > 0
    cells = {(c["admission_leases"], c["streams"]): c for c in report["cells"]}
    assert set(cells) == {(False, 1), (False, 3), (True, 1), (True, 3)}
    for cell in cells.values():
        assert cell["failed_requests"] == 0
        # 3 requests of 40 tokens per route, each event metered once: the usage and
        # finish events on top of the 40 token events.
        assert cell["events"] >= 3 * 40
        assert 0 <= cell["events_waited"] <= cell["events"]
        budget = cell["budget"]
        assert budget["all_settled"]
        assert budget["windows"] >= 1  # a day's window: two if the run spans midnight
        assert 0 < budget["charged_tokens"] <= budget["budget_tokens"] * budget["windows"]
        assert budget["over_budget"] == 0
    routes = {json.loads(line)["route"] for line in (out / "records.jsonl").open()}
    assert routes == {"envoy", "rtt-20", "rtt-20+leases"}
    table = (out / "table.txt").read_text()
    assert "TTFT added" in table and "with admission leases" in table
