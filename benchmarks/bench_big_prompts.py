"""Big prompts vs everyone else: per-chunk lateness of 50 streams while 1 MiB prompts are admitted.

One billing processor (real redis-server) and ``--streams`` streaming chat requests with a
fixed inter-token latency (ITL). Rounds alternate between *quiet* (the streams alone) and
*big*: the same streams while this process sends one ~1 MiB chat prompt every ``1/--rate``
s to the same processor (open loop: a slow admission does not delay the next one). The
figure is the rise of the streams' per-chunk lateness p99 from quiet to big rounds.

* ``--level envoy`` (default): through the real Envoy (``loadlab.rig``'s bootstrap): the
  streams go to llmsim (no jitter), a chunk's lateness is its arrival − Envoy's "request
  written upstream" time (access log) − i × ITL. The big prompts are admitted like any
  request (parsed, counted, charged, re-serialised, forwarded), but Envoy routes them
  (``x-bench-upstream: sink``) to a sink process that reads the body and answers a small
  chat.completion: llmsim would tokenize a 1 MiB prompt on its own event loop and stall
  its streams, which is the simulator's cost, not the gateway's.
* ``--level grpc``: this process plays Envoy on the processor's gRPC stream (as
  ``bench_admission.py``), one FDX body message per token due at ``start + i × ITL``; a
  chunk's lateness is its reply's arrival − its due time. No Envoy or simulator work in it.

Each processor runs with a probe task on its own event loop (a 1 ms sleep, how late it
woke): what the loop itself went through, apart from the machine's other load.
``--baseline DIR`` runs a second processor from another checkout (``git archive HEAD |
tar -x -C DIR``) and alternates rounds between the two, so before and after see the same
load.

First, inside this process (``--no-stages`` skips it): what admitting one big prompt costs
in each stage (JSON parse, counting per tokenizer kind, re-serialising) and how long each
holds the GIL (the longest gap a sleeping ticker thread sees while the stage runs in
another thread: what holds the GIL blocks an event loop wherever it runs); the thread
hop's cost by text size; whole admissions by the processor's Session with the longest
time its loop could not run.

    .venv/bin/python benchmarks/bench_big_prompts.py [--quick] [--level envoy|grpc]
        [--rate 2] [--itl-ms 50] [--big-model gpt-4.1|open-mistral-7b|bench-estimator]
        [--ascii] [--baseline DIR] [--no-stages | --no-gateway]

Target (issue 10): while 1 MiB prompts are admitted, the other streams' per-chunk p99
rises by at most 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from loadlab import wire
from loadlab.client import TimedStream, chat_request, timed_stream
from loadlab.figures import fmt, percentile, table, verdict
from loadlab.gateway import Envoy, Processor, grpc_serving, key_hash, write_config
from loadlab.procs import ManagedProcess, StopStack, free_port, free_ports
from loadlab.prompts import text_of_bytes
from loadlab.redis_server import RedisServer
from loadlab.rig import BENCH_KEY, BENCH_TENANT, MODEL, MODELS, ROOMY, bootstrap, upstream_sent_at
from loadlab.simulator import Simulator
from stack.envoy import EnvoyPorts

ROOT = Path(__file__).resolve().parents[1]
TARGET_RISE_MS = 1.0
PROMPT_BYTES = 1_000_000  # under max_body_bytes (1,048,576) with the JSON around it
SINK_HEADER = "x-bench-upstream"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
BIG_MODELS: dict[str, dict[str, Any]] = {
    # One model per tokenizer kind; the big prompts go to one of them (--big-model).
    "open-mistral-7b": {"max_tokens": 8192},  # the Mistral v1 SentencePiece model (built-in)
    "bench-estimator": {"tokenizer": "estimator", "max_tokens": 8192},
}
KINDS = {"gpt-4.1": "tiktoken o200k", "open-mistral-7b": "sentencepiece", "bench-estimator":
         "estimator"}  # fmt: skip


# --- the prompt ------------------------------------------------------------------------


def image_body(model: str, target_bytes: int) -> bytes:
    """A body as big, but one image (a data URL): nothing for the tokenizer to count."""
    url = "data:image/png;base64," + "A" * (target_bytes - 200)
    part = {"type": "image_url", "image_url": {"url": url}}
    return orjson.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}
    )


def big_body(model: str, text: str) -> bytes:
    return orjson.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    )


# --- stage costs inside one process ----------------------------------------------------


def gil_probe(work: Callable[[], object]) -> tuple[float, float]:
    """(wall ms of ``work`` run in a thread, longest gap ms of a 0.2 ms-sleep ticker).

    The ticker only advances when it gets the GIL, so its longest gap is the longest time
    ``work`` held the GIL in one go (plus one sleep): that much it blocks an event loop
    even when run off it.
    """
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    out: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        work()
        out.append(time.perf_counter() - t0)

    tick = threading.Thread(target=ticker, daemon=True)
    tick.start()
    try:
        time.sleep(0.01)
        gaps.clear()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join()
    finally:
        stop.set()
        tick.join()
    if not out:
        raise RuntimeError("the probed stage failed (its traceback is above)")
    return out[0] * 1000, max(gaps, default=0.0) * 1000


@dataclass
class StageRow:
    stage: str
    wall_ms: list[float] = field(default_factory=list)
    gil_ms: list[float] = field(default_factory=list)

    def cells(self) -> list[str]:
        return [
            self.stage,
            fmt(statistics.median(self.wall_ms), 1),
            fmt(min(self.wall_ms), 1),
            fmt(statistics.median(self.gil_ms), 1),
        ]


def stage_costs(config_path: Path, prompt_bytes: int, ascii_only: bool, reps: int) -> None:
    from extproc.admission.request import parse_model_request
    from extproc.app.runtime import tokenizer_rules
    from extproc.config import load_config
    from extproc.tokens.prompt import count_prompt_tokens
    from extproc.tokens.registry import TokenizerRegistry
    from extproc.tokens.text import decode_utf8

    config = load_config(config_path)
    registry = TokenizerRegistry(tokenizer_rules(config))
    text = text_of_bytes(prompt_bytes, ascii_only)
    raw = big_body("gpt-4.1", text)
    print(
        f"\nStages of one big admission, in this process: {len(raw):,}-byte chat body, "
        f"{len(text):,} characters ({'ASCII' if ascii_only else 'mixed scripts'}), "
        f"{reps} runs each. ms.\n"
    )
    rows: dict[str, StageRow] = {}

    def record(stage: str, work: Callable[[], object]) -> None:
        wall, gil = gil_probe(work)
        row = rows.setdefault(stage, StageRow(stage))
        row.wall_ms.append(wall)
        row.gil_ms.append(gil)

    counts: dict[str, int] = {}
    for _ in range(reps):
        # GIL free throughout: what the probe shows for no hold at all on this machine now.
        record("time.sleep(0.05): the probe's floor", lambda: time.sleep(0.05))
        record("decode UTF-8 + orjson.loads(str)", lambda: orjson.loads(decode_utf8(raw)))
        record("orjson.loads(bytes)", lambda: orjson.loads(raw))
        fresh = orjson.loads(raw)  # no cached UTF-8 form yet, as in a real admission
        record("orjson.dumps (re-serialise)", lambda fresh=fresh: orjson.dumps(fresh))
        record(
            "parse_model_request (parse + rewrite + dumps)",
            lambda: parse_model_request("chat", raw, config),
        )
        for model, kind in KINDS.items():
            tok = registry.counter_for(model)
            body = parse_model_request("chat", big_body(model, text), config).body
            stage = f"count_prompt_tokens, {kind}"

            def count(body: dict[str, Any] = body, tok: Any = tok, model: str = model) -> None:
                counts[model] = count_prompt_tokens(body, tok)

            record(stage, count)
        offloaded = _offloaded_count_stages(config, registry, text)
        for stage, work in offloaded:
            record(stage, work)
    print(table(["stage", "wall p50", "wall min", "longest GIL hold p50"], [
        r.cells() for r in rows.values()
    ]))  # fmt: skip
    print(
        "\nprompt tokens: "
        + ", ".join(f"{KINDS[m]} {n:,}" for m, n in counts.items())
        + "\n(longest GIL hold: what blocks an event loop even when the stage runs in a thread)"
    )


def _offloaded_count_stages(
    config: Any, registry: Any, text: str
) -> list[tuple[str, Callable[[], object]]]:
    """What the admission runs for a big prompt, where the code has ``extproc.tokens.offload``:
    the walk (on the loop), then the worker's count (tiktoken, SentencePiece)."""
    try:
        from extproc.tokens.prompt import prompt_texts, run_through
    except ImportError:  # the code before the change counts on the loop only
        return []
    from extproc.admission.request import parse_model_request

    out: list[tuple[str, Callable[[], object]]] = []
    for model, kind in KINDS.items():
        tok = registry.counter_for(model)
        body = parse_model_request("chat", big_body(model, text), config).body
        out.append(
            (f"offload: the walk (on the loop), {kind}", lambda b=body, t=tok: run_through(
                prompt_texts(b, t)
            ))
        )  # fmt: skip
        if tok.kind == "estimator":
            continue  # its slices run on the loop: see slice_costs

        def worker(b: dict[str, Any] = body, t: Any = tok) -> None:
            run_through(prompt_texts(b, t)).tally.total_large()

        out.append((f"offload: the worker's count, {kind}", worker))
    return out


async def _admission_stalls(config_path: Path, bodies: dict[str, bytes], n: int) -> list[list[str]]:
    from extproc.app.runtime import Runtime
    from extproc.config import load_config
    from extproc.exchange.session import Session

    runtime = Runtime(load_config(config_path))
    runtime.warm_up()
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def probe() -> None:
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.0005)
            lags.append(loop.time() - t0 - 0.0005)

    ticker = asyncio.create_task(probe())
    rows = []
    try:
        for model, raw in bodies.items():
            walls: list[float] = []
            stalls: list[float] = []
            request = wire.request_body(raw)
            for i in range(n + 1):
                session = Session(runtime)
                await session.handle(wire.request_headers(BENCH_KEY, f"stall-{i}", len(raw)))
                await asyncio.sleep(0.002)
                lags.clear()
                t0 = time.perf_counter()
                answer = await session.handle(request)
                walls.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.001)  # the probe's last wake-up of this admission
                stalls.append(max(lags, default=0.0) * 1000)
                if answer is None or answer.WhichOneof("response") != "request_body":
                    raise RuntimeError(f"big prompt refused in the benchmark: {answer}")
                await session.close("benchmark")
            walls, stalls = walls[1:], stalls[1:]  # the first warms the tokenizer's caches
            rows.append(
                [
                    KINDS[model], fmt(statistics.median(walls), 1), fmt(max(walls), 1),
                    fmt(statistics.median(stalls), 2), fmt(max(stalls), 2),
                ]
            )  # fmt: skip
    finally:
        ticker.cancel()
        await runtime.close()
    return rows


def admission_stalls(config_path: Path, prompt_bytes: int, ascii_only: bool, n: int) -> None:
    """Whole admissions of a big prompt by the processor's own Session, in this process, with
    a probe task on the same loop: how long the loop could not run during each one."""
    text = text_of_bytes(prompt_bytes, ascii_only)
    bodies = {model: big_body(model, text) for model in KINDS}
    rows = asyncio.run(_admission_stalls(config_path, bodies, n))
    print(
        f"\nWhole admissions (Session.handle of the request body, in-memory quota backend), "
        f"{n} per tokenizer, and the longest the event loop could not run during one. ms.\n"
    )
    print(table(["tokenizer", "admission p50", "max", "loop blocked p50", "max"], rows))


async def _handoff_rows(registry: Any, text: str, reps: int) -> list[list[str]]:
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1)
    sizes = {
        "gpt-4.1": (1024, 4096, 16384, 32768, 65536, 262144),
        "open-mistral-7b": (256, 1024, 2048, 8192, 32768),
    }
    rows = []
    try:
        for model, chars in sizes.items():
            tok = registry.counter_for(model)
            for size in chars:
                piece = "".join([text[:size], " "])  # a fresh string, as a body's would be
                orjson.dumps(piece)  # with its UTF-8 form, as after the re-serialising
                on: list[float] = []
                cpu: list[float] = []
                off: list[float] = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    tok.count(piece)
                    on.append((time.perf_counter() - t0) * 1000)
                    c0, t0 = time.thread_time(), time.perf_counter()
                    await loop.run_in_executor(pool, tok.count_large, piece)
                    off.append((time.perf_counter() - t0) * 1000)
                    cpu.append((time.thread_time() - c0) * 1000)
                rows.append(
                    [
                        KINDS[model], f"{size:,}", fmt(statistics.median(on), 3),
                        fmt(statistics.median(cpu), 3), fmt(statistics.median(off), 3),
                    ]
                )  # fmt: skip
    finally:
        pool.shutdown()
    return rows


def handoff_costs(config_path: Path, ascii_only: bool, reps: int) -> None:
    """Where the thread hop pays: counting on the loop (the loop waits all of it) vs in a
    worker (the loop spends only the hand-off; the request waits the count + the hop)."""
    from extproc.app.runtime import tokenizer_rules
    from extproc.config import load_config
    from extproc.tokens.registry import TokenizerRegistry

    registry = TokenizerRegistry(tokenizer_rules(load_config(config_path)))
    rows = asyncio.run(_handoff_rows(registry, text_of_bytes(300_000, ascii_only), reps))
    print("\nThe thread hop, by text size (characters). ms, medians.\n")
    print(table(["tokenizer", "chars", "on the loop", "hop: loop CPU", "hop: request waits"], rows))


def slice_costs(config_path: Path, prompt_bytes: int, ascii_only: bool) -> None:
    """The estimator's slices run on the loop: the longest one is what the loop waits."""
    try:
        from extproc.tokens.offload import ESTIMATOR_STEP_CHARS
        from extproc.tokens.prompt import prompt_texts, run_through
    except ImportError:
        return
    from extproc.admission.request import parse_model_request
    from extproc.app.runtime import tokenizer_rules
    from extproc.config import load_config
    from extproc.tokens.registry import TokenizerRegistry

    config = load_config(config_path)
    tok = TokenizerRegistry(tokenizer_rules(config)).counter_for("bench-estimator")
    body = parse_model_request(
        "chat", big_body("bench-estimator", text_of_bytes(prompt_bytes, ascii_only)), config
    ).body
    steps = run_through(prompt_texts(body, tok)).tally.total_steps(ESTIMATOR_STEP_CHARS)
    gaps: list[float] = []
    while True:
        t0 = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            break
        gaps.append((time.perf_counter() - t0) * 1000)
    print(
        f"estimator slices of {ESTIMATOR_STEP_CHARS} characters on the loop: {len(gaps)} "
        f"slices, p50 {fmt(percentile(gaps, 50), 3)} ms, max {fmt(max(gaps), 3)} ms"
    )


# --- the sink upstream -----------------------------------------------------------------

SINK_ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-sink",
        "object": "chat.completion",
        "created": 1,
        "model": "sink",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)


def serve_sink(port: int) -> None:
    """Read each request whole, answer a one-token chat.completion (keep-alive)."""
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(SINK_ANSWER),
        SINK_ANSWER,
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, limit=1 << 16)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_sink(log_dir: Path) -> tuple[ManagedProcess, int]:
    port = free_port()
    process = ManagedProcess(
        [sys.executable, str(Path(__file__).resolve()), "--sink", str(port)],
        log_dir / f"sink-{port}.log",
    )

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    process.wait_ready(ready, timeout_s=15)
    return process, port


def start_envoy_with_sink(
    log_dir: Path, processor_port: int, sim_port: int, sink_port: int, name: str
) -> tuple[Envoy, Path]:
    """The project's bootstrap + access log, plus a route on ``x-bench-upstream: sink``."""
    ports = EnvoyPorts(*free_ports(2))
    access_log = log_dir / f"access-{name}.log"
    doc = bootstrap(ports, processor_port, sim_port, access_log)
    clusters = doc["static_resources"]["clusters"]
    backends = next(c for c in clusters if c["name"] == "llm_backends")
    sink = yaml.safe_load(yaml.safe_dump(backends))
    sink["name"] = "bench_sink"
    address = {"socket_address": {"address": "127.0.0.1", "port_value": sink_port}}
    sink["load_assignment"] = {
        "cluster_name": "bench_sink",
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    }
    clusters.append(sink)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(
        0,
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": SINK_HEADER, "string_match": {"exact": "sink"}}],
            },
            "route": {"cluster": "bench_sink", "timeout": "0s", "idle_timeout": "300s"},
        },
    )
    # The floor (--floor): the same big requests relayed by Envoy with no processor at all.
    routes.insert(
        0,
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": SINK_HEADER, "string_match": {"exact": "sink-direct"}}],
            },
            "route": {"cluster": "bench_sink", "timeout": "0s", "idle_timeout": "300s"},
            "typed_per_filter_config": {
                "envoy.filters.http.ext_proc": {
                    "@type": EXT_PROC_PER_ROUTE,
                    "disabled": True,
                }
            },
        },
    )
    config_path = log_dir / f"envoy-{name}.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    envoy = Envoy.launch(
        config_path, ports, log_dir / f"envoy-{name}.log", "--file-flush-interval-msec", "100"
    )
    return envoy, access_log


# --- the two ways to reach a processor -------------------------------------------------


@dataclass
class Route:
    name: str  # part of every x-request-id: no spaces (Envoy's log lines are split on them)
    port: int  # Envoy's listener, or the processor's own port (gRPC level)
    access_log: Path | None = None  # Envoy's: the anchor of each stream's lateness
    sink: str = "sink"  # where Envoy sends the big prompts: "sink-direct" skips the processor


@dataclass
class BigResult:
    status: int
    latency_ms: float  # request written → whole answer read


class EnvoyDriver:
    """Through the real Envoy: the streams to llmsim, the big prompts to the sink. A chunk's
    lateness is its arrival − (Envoy wrote the request upstream + i × ITL), from the access
    log, as the stream-latency benchmark did before its send stamps."""

    async def streams(
        self, route: Route, streams: int, tokens: int, itl_s: float, tag: str
    ) -> tuple[list[float], int]:
        payload = {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about token budgets."}],
            "max_tokens": tokens,
            "ignore_eos": True,  # exactly `tokens` token events, one per ITL
        }
        rng = random.Random(streams)

        async def one(index: int) -> TimedStream:
            await asyncio.sleep(rng.uniform(0, itl_s))  # real streams don't emit in lockstep
            rid = f"{tag}-{route.name}-{index}"
            request = chat_request("/v1/chat/completions", payload, rid, BENCH_KEY)
            return await timed_stream(route.port, request, rid)

        results = await asyncio.gather(*(one(i) for i in range(streams)))
        assert route.access_log is not None
        anchors = upstream_sent_at(route.access_log, [r.request_id for r in results])
        lateness: list[float] = []
        failed = 0
        for stream in results:
            anchor = anchors.get(stream.request_id)
            ok = stream.status == 200 and stream.complete and len(stream.arrivals) == tokens
            if not ok or anchor is None:
                failed += 1
                continue
            lateness.extend((t - anchor - i * itl_s) * 1e6 for i, t in enumerate(stream.arrivals))
        return lateness, failed

    async def big(self, route: Route, body: bytes, request_id: str, out: list[BigResult]) -> None:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\n"
            f"{SINK_HEADER}: {route.sink}\r\nAuthorization: Bearer {BENCH_KEY}\r\n"
            "Connection: close\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", route.port)
        t0 = time.perf_counter()
        writer.write(head.encode() + body)
        response = await reader.read()  # Connection: close → EOF ends the answer
        status = int(response.split(b" ", 2)[1] or 0) if response else 0
        out.append(BigResult(status, (time.perf_counter() - t0) * 1e3))
        writer.close()

    async def close(self) -> None:
        pass


JSON_RESPONSE_HEADERS = pb.ProcessingRequest(
    response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            ]
        )
    )
).SerializeToString()


class GrpcDriver:
    """This process plays Envoy on the processor's Process streams (as bench_admission.py):
    per stream the request headers, a small body (admission), SSE response headers, then
    one FDX body message per token, due at ``start + i × ITL``. A chunk's lateness is its
    reply's arrival − its due time: a stalled processor shows as it does through Envoy,
    without Envoy's or the simulator's own work in the figure."""

    def __init__(self) -> None:
        self.channels: dict[int, Any] = {}
        self._serialised: dict[bytes, bytes] = {}  # 1 MiB messages: built once, not per send

    def _call(self, port: int) -> Any:
        import grpc

        if port not in self.channels:
            self.channels[port] = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self.channels[port].stream_stream(wire.PROCESS_METHOD)()

    async def streams(
        self, route: Route, streams: int, tokens: int, itl_s: float, tag: str
    ) -> tuple[list[float], int]:
        exchange = wire.Exchange("Write a long story about token budgets.", tokens)
        chunk, tail = exchange.chunk, exchange.tail(tokens)
        rng = random.Random(streams)
        lateness: list[float] = []
        failed = 0

        async def one(index: int) -> None:
            nonlocal failed
            await asyncio.sleep(rng.uniform(0, itl_s))
            call = self._call(route.port)
            rid = f"{tag}-{route.name}-{index}"
            if not await wire.open_stream(call, exchange, BENCH_KEY, rid):
                failed += 1
                return
            loop = asyncio.get_running_loop()
            start = loop.time()
            mine: list[float] = []
            for i in range(tokens):
                due = start + i * itl_s
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await call.write(chunk)
                await call.read()
                mine.append((loop.time() - due) * 1e6)
            await call.write(tail)
            await call.read()
            await call.done_writing()
            await call.code()
            lateness.extend(mine)

        await asyncio.gather(*(one(i) for i in range(streams)))
        return lateness, failed

    async def big(self, route: Route, body: bytes, request_id: str, out: list[BigResult]) -> None:
        call = self._call(route.port)
        t0 = time.perf_counter()
        await call.write(wire.request_headers(BENCH_KEY, request_id, len(body)).SerializeToString())
        await call.read()
        message = self._serialised.get(body)
        if message is None:
            message = self._serialised[body] = wire.request_body(body).SerializeToString()
        await call.write(message)
        answer = wire.response(await call.read())
        status = 200
        if wire.verdict_kind(answer) == "request_body":  # admitted: a JSON answer settles it
            await call.write(JSON_RESPONSE_HEADERS)
            await call.read()
            await call.write(wire.response_body(SINK_ANSWER, True).SerializeToString())
            await call.read()
        else:
            status = answer.immediate_response.status.code or 500
        await call.done_writing()
        await call.code()
        out.append(BigResult(status, (time.perf_counter() - t0) * 1e3))

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


Driver = EnvoyDriver | GrpcDriver


async def big_sender(
    driver: Driver,
    route: Route,
    body: bytes,
    rate: float,
    stop: asyncio.Event,
    tag: str,
    out: list[BigResult],
) -> None:
    """One big prompt every 1/rate s until ``stop`` (open loop); waits for those in flight."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent: list[asyncio.Task[None]] = []
    k = 0
    while not stop.is_set():
        sent.append(asyncio.create_task(driver.big(route, body, f"{tag}-big-{k}", out)))
        k += 1
        delay = start + k / rate - loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay))
    await asyncio.gather(*sent, return_exceptions=True)


# --- the run ---------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    lateness_us: list[float] = field(default_factory=list)
    chunks: int = 0
    failed: int = 0
    big: list[BigResult] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)  # wall clock, s


async def run_rounds(
    driver: Driver,
    routes: list[Route],
    streams: int,
    tokens: int,
    itl_s: float,
    rounds: int,
    rate: float,
    body: bytes,
) -> dict[tuple[str, str], Phase]:
    """Round by round, each route quiet then big (or big then quiet, alternately)."""
    tag = uuid.uuid4().hex[:8]
    phases = {(r.name, name): Phase(name) for r in routes for name in ("quiet", "big")}
    try:
        for route in routes:  # warm: connections, tokenizers, Redis scripts, Envoy buffers
            await driver.streams(route, 4, 8, itl_s, f"{tag}-warm")
            await driver.big(route, body, f"{tag}-warm-big-{route.name}", [])
        for r in range(rounds):
            # A drift in the machine's other load hits every route and both phases alike.
            order = ("quiet", "big") if r % 2 == 0 else ("big", "quiet")
            for route in routes if r % 2 == 0 else routes[::-1]:
                for name in order:
                    phase = phases[(route.name, name)]
                    stop = asyncio.Event()
                    sender = None
                    if name == "big":
                        sender = asyncio.create_task(
                            big_sender(driver, route, body, rate, stop, f"{tag}-r{r}", phase.big)
                        )
                    started = time.time()
                    lateness, failed = await driver.streams(
                        route, streams, tokens, itl_s, f"{tag}-r{r}-{name}"
                    )
                    phase.windows.append((started, time.time()))
                    stop.set()
                    if sender is not None:
                        await sender
                    phase.lateness_us += lateness
                    phase.chunks += len(lateness)
                    phase.failed += failed
            load = os.getloadavg()[0]
            print(f"  round {r + 1}/{rounds} done, load average {load:.1f}", flush=True)
    finally:
        await driver.close()
    return phases


def report(
    phases: dict[tuple[str, str], Phase],
    routes: list[Route],
    lag_files: dict[str, Path],
    level: str,
    streams: int,
    tokens: int,
    itl_ms: float,
    rate: float,
    body: bytes,
) -> None:
    print(
        f"\nPer-chunk lateness ({level} level) of {streams} streams (ITL {itl_ms:g} ms, {tokens} "
        f"token events each), quiet vs with a {len(body):,}-byte prompt admitted every "
        f"{1 / rate:g} s. ms.\n"
    )
    rows = []
    for route in routes:
        for name in ("quiet", "big"):
            phase = phases[(route.name, name)]
            lat = phase.lateness_us
            rows.append(
                [
                    route.name, phase.name, f"{phase.chunks:,}", str(phase.failed),
                    fmt(percentile(lat, 50) / 1e3, 2), fmt(percentile(lat, 90) / 1e3, 2),
                    fmt(percentile(lat, 99) / 1e3, 2), fmt(percentile(lat, 99.9) / 1e3, 2),
                    fmt(max(lat, default=float("nan")) / 1e3, 2),
                ]
            )  # fmt: skip
    headers = ["processor", "rounds", "chunks", "failed", "p50", "p90", "p99", "p99.9", "max"]
    print(table(headers, rows))
    print(
        "\nThe processor's own event loop meanwhile: how late a 1 ms sleep woke up (a probe "
        "task in the processor), ms:\n"
    )
    rows = []
    for route in routes:
        for name in ("quiet", "big"):
            lags = loop_lags(lag_files[route.name], phases[(route.name, name)].windows)
            rows.append(
                [
                    route.name, name, f"{len(lags):,}", fmt(percentile(lags, 50) / 1e3, 2),
                    fmt(percentile(lags, 99) / 1e3, 2), fmt(percentile(lags, 99.9) / 1e3, 2),
                    fmt(max(lags, default=float("nan")) / 1e3, 2),
                ]
            )  # fmt: skip
    print(table(["processor", "rounds", "wake-ups", "p50", "p99", "p99.9", "max"], rows))
    print()
    for route in routes:
        quiet, big = phases[(route.name, "quiet")], phases[(route.name, "big")]
        rise = (percentile(big.lateness_us, 99) - percentile(quiet.lateness_us, 99)) / 1e3
        rise50 = (percentile(big.lateness_us, 50) - percentile(quiet.lateness_us, 50)) / 1e3
        statuses: dict[int, int] = {}
        for b in big.big:
            statuses[b.status] = statuses.get(b.status, 0) + 1
        latencies = [b.latency_ms for b in big.big if b.status == 200]
        print(
            f"{route.name}: big prompts {len(big.big)} sent, statuses "
            f"{dict(sorted(statuses.items()))}, request → answer p50 "
            f"{fmt(percentile(latencies, 50), 1)} ms, max "
            f"{fmt(max(latencies, default=float('nan')), 1)} ms; the streams' p50 rises "
            f"{fmt(rise50, 2)} ms, p99 {fmt(rise, 2)} ms — target ≤ {TARGET_RISE_MS:g} ms: "
            f"{verdict(rise <= TARGET_RISE_MS)}"
        )


def write_big_config(path: Path, redis_url: str, key_prefix: str = "tq") -> Path:
    return write_config(
        path,
        {
            "redis_url": redis_url,
            "key_prefix": key_prefix,
            "models": {**MODELS, **BIG_MODELS},
            "plans": {
                "roomy": {
                    "window_s": 3600,
                    "limits": {"*": {"rpm": ROOMY, "tpm": ROOMY}},
                    "charge_mode": "incremental",
                    "batch_tokens": 32,
                }
            },
            "tenants": {BENCH_TENANT: {"plan": "roomy", "key_sha256": [key_hash(BENCH_KEY)]}},
            "stream_idle_timeout_s": 120,
        },
    )


# ``extproc serve`` with a probe of its own event loop: a task that sleeps 1 ms and notes
# how late it woke (wall time, µs), written out in batches. Run with ``python -c`` in the
# checkout, so that checkout's ``extproc`` is the one imported.
LAG_PROBE = """
import asyncio, sys, time
out = open(sys.argv[1], "w")
async def probe():
    loop, batch = asyncio.get_running_loop(), []
    while True:
        t0 = loop.time()
        await asyncio.sleep(0.001)
        batch.append(f"{time.time():.6f} {(loop.time() - t0 - 0.001) * 1e6:.0f}\\n")
        if len(batch) >= 500:
            out.write("".join(batch)); out.flush(); batch.clear()
run = asyncio.run
def probed(main, **kw):
    async def both():
        task = asyncio.ensure_future(probe())
        try:
            return await main
        finally:
            task.cancel()
    return run(both(), **kw)
asyncio.run = probed
from extproc.app.cli import main
sys.exit(main(sys.argv[2:]))
"""


def start_processor(
    name: str, checkout: Path, config_path: Path, log_dir: Path
) -> tuple[Processor, Path]:
    """A billing processor running ``checkout``'s code, its loop probed; and the probe's file."""
    port, metrics_port = free_ports(2)
    lag_file = log_dir / f"loop-lag-{name}.txt"
    argv = [
        sys.executable, "-c", LAG_PROBE, str(lag_file), "serve", "--config", str(config_path),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
        "--log-level", "warning", "--drain-delay-s", "0",
    ]  # fmt: skip
    process = ManagedProcess(argv, log_dir / f"extproc-{name}-{port}.log", cwd=checkout)
    process.wait_ready(lambda: grpc_serving(port), timeout_s=30)
    return Processor(process, port, metrics_port), lag_file


def loop_lags(lag_file: Path, windows: list[tuple[float, float]]) -> list[float]:
    """The probe's lateness samples (µs) that fall in any of the wall-clock windows."""
    out: list[float] = []
    if not lag_file.exists():
        return out
    for line in lag_file.read_text().splitlines():
        at, _, lag = line.partition(" ")
        t = float(at)
        if any(start <= t <= end for start, end in windows):
            out.append(float(lag))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)  # run as the sink upstream
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--level",
        choices=("envoy", "grpc"),
        default="envoy",
        help="through the real Envoy, or this process playing Envoy at the gRPC level",
    )
    parser.add_argument("--streams", type=int, default=50)
    # 50 streams at 50 ms: 1,000 chunks/s, which a 2-core machine carries with room (at
    # 25 ms Envoy, simulator, processor and client already queue for the cores).
    parser.add_argument("--itl-ms", type=float, default=50.0, help="inter-token latency")
    parser.add_argument("--tokens", type=int, default=60, help="token events per stream")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (each: quiet and big)")
    parser.add_argument("--rate", type=float, default=2.0, help="big prompts per second")
    parser.add_argument("--prompt-bytes", type=int, default=PROMPT_BYTES)
    parser.add_argument("--big-model", default="gpt-4.1", choices=sorted(KINDS))
    parser.add_argument("--ascii", action="store_true", help="an ASCII-only big prompt")
    parser.add_argument(
        "--image",
        action="store_true",
        help="big bodies of one image data URL instead of text: the same bytes to carry, "
        "parse and re-serialise, nothing to tokenize",
    )
    parser.add_argument("--no-stages", action="store_true", help="skip the in-process stages")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="envoy level: also rounds whose big prompts Envoy relays without the processor",
    )
    parser.add_argument("--no-gateway", action="store_true", help="only the in-process stages")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. `git archive HEAD | tar -x -C DIR`): its processor runs "
        "beside this one's, and rounds alternate between the two, so both see the same load",
    )
    args = parser.parse_args()
    if args.sink is not None:
        serve_sink(args.sink)
        return
    rounds = 2 if args.quick else args.rounds
    itl_s = args.itl_ms / 1000

    workdir = Path(tempfile.mkdtemp(prefix="bench-big-"))
    print(
        f"big-prompt benchmark: load average {os.getloadavg()[0]:.1f}, logs in {workdir}",
        flush=True,
    )
    if not args.no_stages:
        config = write_big_config(workdir / "stages.yaml", "memory://")
        stage_costs(config, args.prompt_bytes, args.ascii, 3 if args.quick else 7)
        slice_costs(config, args.prompt_bytes, args.ascii)
        handoff_costs(config, args.ascii, 5 if args.quick else 21)
        admission_stalls(config, args.prompt_bytes, args.ascii, 3 if args.quick else 10)
    if args.no_gateway:
        return
    with StopStack() as stops:  # stop by PID, newest first
        redis = stops.push(RedisServer.start(workdir / "redis"))
        processors: list[tuple[str, Processor]] = []
        lag_files: dict[str, Path] = {}
        checkouts = [("this-checkout", ROOT)]
        if args.baseline is not None:
            checkouts.insert(0, ("baseline", args.baseline.resolve()))
        for name, checkout in checkouts:
            # Own key prefix each: the two never share a counter in the one Redis.
            config = write_big_config(workdir / f"{name}.yaml", redis.url, f"tq-{name}")
            processor, lag_files[name] = start_processor(name, checkout, config, workdir)
            stops.push(processor)
            processors.append((name, processor))
        driver: Driver
        if args.level == "grpc":
            driver = GrpcDriver()
            routes = [Route(name, processor.port) for name, processor in processors]
        else:
            driver = EnvoyDriver()
            sim = Simulator(
                "fast.yaml",
                "--inter-token-latency", f"{args.itl_ms}ms",
                "--inter-token-latency-std-dev", "0ms",
                "--time-to-first-token", "0ms",
                log_dir=workdir,
            )  # fmt: skip
            stops.push(sim)
            sink, sink_port = start_sink(workdir)
            stops.push(sink)
            routes = []
            for name, processor in processors:
                envoy, access_log = start_envoy_with_sink(
                    workdir, processor.port, sim.port, sink_port, name
                )
                stops.push(envoy)
                routes.append(Route(name, envoy.ports.listen, access_log))
                if args.floor and name == "this-checkout":
                    routes.append(
                        Route("envoy-only", envoy.ports.listen, access_log, "sink-direct")
                    )
                    lag_files["envoy-only"] = lag_files[name]
        if args.image:
            body = image_body(args.big_model, args.prompt_bytes)
        else:
            body = big_body(args.big_model, text_of_bytes(args.prompt_bytes, args.ascii))
        print(
            f"\n{args.level} level: {args.streams} streams, ITL {args.itl_ms:g} ms, "
            f"{args.tokens} tokens, {rounds} rounds; big prompts ({KINDS[args.big_model]}, "
            f"{'one image' if args.image else 'ASCII' if args.ascii else 'mixed scripts'}) "
            f"at {args.rate:g}/s",
            flush=True,
        )
        phases = asyncio.run(
            run_rounds(driver, routes, args.streams, args.tokens, itl_s, rounds, args.rate, body)
        )
        report(
            phases,
            routes,
            lag_files,
            args.level,
            args.streams,
            args.tokens,
            args.itl_ms,
            args.rate,
            body,
        )
        for name, processor in processors:
            metrics = processor.metrics()
            print(f"{name}: {int(metrics.get('extproc_requests_admitted_total', 0)):,} admitted")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
