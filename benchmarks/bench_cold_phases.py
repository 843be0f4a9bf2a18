"""What each phase of a billed exchange costs when the CPU's caches are cold, as at one stream.

In a hot loop (one exchange after another, nothing else on the core) the processor's own
work before the first token is small. Through Envoy at one stream each ext_proc message
finds the caches filled by Envoy, the client and the upstream, which ran in between, and
the same Python code costs several times more CPU. This measures that ratio in process
(``Session.handle`` over ``loadlab.wire`` messages, a real redis-server), phase by phase:
request headers, request body (admission), response headers, the first chunk, and the
settlement, each timed in thread CPU time.

* **warm**: exchanges back to back;
* **cold**: before each phase, ``--evict-mib`` of memory is written through (one byte per
  64-byte line), which evicts what the phase would find cached: what Envoy, the client and
  the upstream running between two messages do.

Rounds alternate warm and cold (``--rounds``), so a change in the machine's load hits both
alike; medians per phase, then cold ÷ warm. Two backends: ``redis`` (the shipped path, one
admit round trip) and ``leases`` (``admission_leases`` on: admitted from a block).

    .venv/bin/python benchmarks/bench_cold_phases.py [--exchanges 300] [--rounds 4] [--evict-mib 16]

About half a minute. No target: it says what bounds issue 24's target 4 (TTFT added at
one stream), with ``bench_ttft_hops.py`` giving the same phases by Envoy's clock.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from loadlab import wire
from loadlab.figures import table
from loadlab.gateway import write_config
from loadlab.redis_server import RedisServer
from loadlab.rig import BENCH_KEY, write_bench_config

PHASES = ("request headers", "request body", "response headers", "first chunk", "settlement")
WARM_UP = 50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--exchanges", type=int, default=300, help="per backend and mode")
    p.add_argument("--rounds", type=int, default=4, help="alternating warm/cold rounds")
    p.add_argument("--evict-mib", type=int, default=16, help="memory written before a phase")
    return p.parse_args(argv)


class Evictor:
    def __init__(self, mib: int) -> None:
        self.buffer = bytearray(mib << 20)

    def __call__(self) -> None:
        buffer = self.buffer
        for i in range(0, len(buffer), 64):
            buffer[i] = (buffer[i] + 1) & 255


async def measure(config: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from extproc.app.runtime import Runtime
    from extproc.config import load_config

    runtime = Runtime(load_config(config))
    runtime.warm_up()
    exchange = wire.Exchange(max_tokens=16)
    body = wire.request_body(exchange.body)
    response_headers = wire.sse_response_headers()
    chunk = wire.response_body(wire.token_chunk(" word"))
    tail = wire.response_body(wire.stream_tail(16, 8), end_of_stream=True)
    tag = uuid.uuid4().hex[:8]
    evict = Evictor(args.evict_mib)
    spent: dict[str, dict[str, list[float]]] = {
        mode: {p: [] for p in PHASES} for mode in ("warm", "cold")
    }
    count = 0

    async def timed(mode: str, phase: str, step: Callable[[], Awaitable[Any]], keep: bool) -> None:
        if mode == "cold":
            evict()
        started = time.thread_time()
        await step()
        if keep:
            spent[mode][phase].append((time.thread_time() - started) * 1e6)

    async def one(mode: str, keep: bool) -> None:
        nonlocal count
        count += 1
        session = runtime.session()
        headers = wire.request_headers(BENCH_KEY, f"{tag}-{count}", len(exchange.body))

        async def first_chunk() -> None:
            if session.answer_now(chunk) is None:
                await session.handle(chunk)

        await timed(mode, "request headers", lambda: session.handle(headers), keep)
        await timed(mode, "request body", lambda: session.handle(body), keep)
        await timed(mode, "response headers", lambda: session.handle(response_headers), keep)
        await timed(mode, "first chunk", first_chunk, keep)
        for _ in range(7):
            if session.answer_now(chunk) is None:
                await session.handle(chunk)
        await session.handle(tail)
        await timed(mode, "settlement", lambda: session.close("end_of_stream"), keep)

    try:
        for _ in range(WARM_UP):
            await one("warm", keep=False)
        gc.collect()
        gc.freeze()  # the collector's pauses are not what is measured here
        per_round = max(1, args.exchanges // args.rounds)
        for r in range(args.rounds):
            for mode in ("warm", "cold") if r % 2 == 0 else ("cold", "warm"):
                for _ in range(per_round):
                    await one(mode, keep=True)
    finally:
        await runtime.drain(5.0)
        await runtime.close()
    return {
        mode: {p: statistics.median(v) for p, v in phases.items()} for mode, phases in spent.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cold-phases-") as tmp:
        server = RedisServer.start(Path(tmp) / "redis")
        try:
            url = f"redis://127.0.0.1:{server.port}/0"
            plain = write_bench_config(Path(tmp) / "redis.yaml", url)
            doc = yaml.safe_load(plain.read_text())
            leased = write_config(
                Path(tmp) / "leases.yaml", {**doc, "admission_leases": {"enabled": True}}
            )
            for name, config in (("redis", plain), ("leases", leased)):
                got = asyncio.run(measure(config, args))
                warm, cold = got["warm"], got["cold"]
                for phase in PHASES:
                    ratio = cold[phase] / warm[phase] if warm[phase] else float("nan")
                    rows.append(
                        [name, phase, f"{warm[phase]:.1f}", f"{cold[phase]:.1f}", f"{ratio:.1f}×"]
                    )
                before = [p for p in PHASES if p != "settlement"]
                rows.append(
                    [
                        name,
                        "before the first token",
                        f"{sum(warm[p] for p in before):.1f}",
                        f"{sum(cold[p] for p in before):.1f}",
                        f"{sum(cold[p] for p in before) / sum(warm[p] for p in before):.1f}×",
                    ]
                )
        finally:
            server.stop()
    print(
        f"Per-phase CPU of one billed exchange, µs (thread time), medians of {args.exchanges}"
        f" exchanges per mode; cold: {args.evict_mib} MiB written through before each phase"
    )
    print(table(["backend", "phase", "warm µs", "cold µs", "cold ÷ warm"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
