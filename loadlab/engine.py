"""The measuring engine: one phase = one route at one level, closed loop or open loop.

Closed loop: ``level`` clients, each sending its next request when the last one ended.
Open loop (``rate``): Poisson arrivals at ``level`` requests/s, at most ``max_concurrency``
in flight (an arrival over the cap waits, as in ``vllm bench serve``). Every request is a
fresh connection through the raw-socket client (``loadlab.client``), so the send time is the
request's one write and each arrival is taken in ``data_received``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadlab.client import TimedStream, chat_request, timed_stream
from loadlab.parts import Route
from loadlab.rig import cpu_seconds
from loadlab.scenario import Scenario

# A refused closed-loop client waits its Retry-After, at most this long, before the next
# request: a real client would, and a spinning one would only measure 429s per second.
MAX_REFUSAL_PAUSE_S = 1.0
WORD = "hello "  # one o200k token each: a prompt of n words is about n tokens
# OpenAI's chat counting rule around one user message: 3 per message, 1 for the role, 3 to
# prime the reply (when no usage event tells the prompt's count).
CHAT_OVERHEAD = 7


@dataclass
class Record:
    """One request as ``records.jsonl`` holds it (times in ms, one-way latencies in µs)."""

    route: str
    level: float
    index: int
    start_ns: int  # wall clock, the request's write
    status: int
    outcome: str  # ok, cut, refused, error, short, timeout, connect_failed
    prompt_tokens: int  # the stream's usage, else words + the chat overhead
    max_tokens: int  # output asked for
    output_tokens: int  # the stream's usage, else token events × tokens per chunk
    events: int  # token events received
    ttft_ms: float | None
    e2el_ms: float | None
    tpot_ms: float | None
    itl_ms: list[float] = field(default_factory=list)
    chunk_latency_us: list[float] = field(default_factory=list)  # arrival − ext_sent_ns
    chunk_arrival_ms: list[float] = field(default_factory=list)  # since start_ns
    error_code: str | None = None
    retry_after_s: float | None = None

    def to_doc(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "level": self.level,
            "index": self.index,
            "start_ns": self.start_ns,
            "status": self.status,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "events": self.events,
            "ttft_ms": self.ttft_ms,
            "e2el_ms": self.e2el_ms,
            "tpot_ms": self.tpot_ms,
            "itl_ms": self.itl_ms,
            "chunk_latency_us": self.chunk_latency_us,
            "chunk_arrival_ms": self.chunk_arrival_ms,
            "error_code": self.error_code,
            "retry_after_s": self.retry_after_s,
        }


@dataclass
class Phase:
    route: str
    level: float
    records: list[Record]
    wall_s: float
    cpu_share: dict[str, float]  # role → CPU s per wall s (1.0 = one core); machine: all cores
    charged: dict[int, int] | None = None  # window start → tokens the processor charged


def _outcome(stream: TimedStream, asked: int, tokens_per_chunk: int) -> str:
    if stream.status == 0:
        return "timeout" if stream.timed_out else "connect_failed"
    if stream.status == 429:
        return "refused"
    if stream.status != 200:
        return "error"
    if stream.error_code is not None:
        return "cut"
    if stream.timed_out:
        return "timeout"
    expected_events = -(-asked // tokens_per_chunk)
    if not stream.complete or len(stream.arrivals_ns) != expected_events:
        return "short"
    return "ok"


def make_record(
    route: str,
    level: float,
    index: int,
    stream: TimedStream,
    prompt_words: int,
    asked: int,
    tokens_per_chunk: int,
) -> Record:
    arrivals, sent = stream.arrivals_ns, stream.sent_ns
    outcome = _outcome(stream, asked, tokens_per_chunk)
    events = len(arrivals)
    counted = min(asked, events * tokens_per_chunk)
    output = stream.completion_tokens if stream.completion_tokens is not None else counted
    if outcome == "cut":
        output = counted  # what reached the client, whatever usage the meter closed with
    ttft = (arrivals[0] - sent) / 1e6 if arrivals else None
    e2el = (arrivals[-1] - sent) / 1e6 if arrivals and outcome == "ok" else None
    tpot = None
    if e2el is not None and ttft is not None and output > 1:
        tpot = (e2el - ttft) / (output - 1)
    stamps = stream.stamps_ns if len(stream.stamps_ns) == events else []
    return Record(
        route=route,
        level=level,
        index=index,
        start_ns=sent,
        status=stream.status,
        outcome=outcome,
        prompt_tokens=stream.prompt_tokens
        if stream.prompt_tokens is not None
        else prompt_words + CHAT_OVERHEAD,
        max_tokens=asked,
        output_tokens=output,
        events=events,
        ttft_ms=ttft,
        e2el_ms=e2el,
        tpot_ms=tpot,
        itl_ms=[round((b - a) / 1e6, 4) for a, b in itertools.pairwise(arrivals)],
        chunk_latency_us=[round((a - s) / 1e3, 1) for a, s in zip(arrivals, stamps, strict=True)],
        chunk_arrival_ms=[round((a - sent) / 1e6, 3) for a in arrivals],
        error_code=stream.error_code,
        retry_after_s=stream.retry_after_s,
    )


def _machine_jiffies() -> tuple[int, int]:
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return 0, 0
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for role, pid in pids.items():
        try:
            out[role] = cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            continue
    return out


class Engine:
    """Runs phases against routes; ``on_done`` is called after each request (progress)."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario

    def _payload(self, rng: random.Random) -> tuple[dict[str, Any], int, int]:
        words = self.s.prompt_tokens.draw(rng)
        asked = self.s.output_tokens.draw(rng)
        payload = {
            "model": self.s.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": (WORD * words).strip()}],
            "max_tokens": asked,
            "ignore_eos": True,  # exactly max_tokens tokens: the lengths are the scenario's
        }
        return payload, words, asked

    async def _one(
        self,
        route: Route,
        level_index: int,
        level: float,
        index: int,
        drawn: tuple[dict[str, Any], int, int],
    ) -> Record:
        payload, words, asked = drawn
        rid = f"{route.name}-{level:g}-{index}-{time.time_ns()}"
        request = chat_request(
            route.path, payload, rid, route.api_key(level_index), host=f"{route.host}"
        )
        try:
            stream = await timed_stream(route.port, request, rid, self.s.timeout_s, route.host)
        except OSError:
            stream = TimedStream(rid, sent_ns=time.time_ns())
        return make_record(route.name, level, index, stream, words, asked, self.s.tokens_per_chunk)

    async def warm(self, route: Route) -> None:
        """A few requests first: connection pools, tokenizers, Redis scripts."""
        rng = random.Random(f"warm-{route.name}")
        warm_index = len(self.s.levels)  # its own tenant: no level's budget is touched
        await asyncio.gather(
            *(
                self._one(route, warm_index, 0, i, self._payload(rng))
                for i in range(self.s.warmup_requests)
            )
        )

    async def run_phase(
        self,
        route: Route,
        level_index: int,
        on_done: Callable[[Record], None] = lambda _: None,
    ) -> Phase:
        s = self.s
        level = s.levels[level_index]
        total = s.phase_requests(level)
        # The same lengths and arrival times on every route at one level: like for like.
        rng = random.Random(f"{s.seed}-{level_index}")
        records: list[Record] = []
        started = time.monotonic()
        deadline = None if s.duration_s is None else started + s.duration_s
        cpu_before, jiffies_before = _cpu(route.pids), _machine_jiffies()

        def more(issued: int) -> bool:
            if total is not None:
                return issued < total
            return time.monotonic() < (deadline or 0)

        def done(record: Record) -> None:
            records.append(record)
            on_done(record)

        issued = 0
        if s.mode == "closed":

            async def client() -> None:
                nonlocal issued
                while more(issued):
                    index, drawn = issued, self._payload(rng)
                    issued += 1
                    record = await self._one(route, level_index, level, index, drawn)
                    done(record)
                    if record.outcome == "refused":
                        pause = record.retry_after_s if record.retry_after_s is not None else 1
                        await asyncio.sleep(min(max(pause, 0.0), MAX_REFUSAL_PAUSE_S))

            await asyncio.gather(*(client() for _ in range(int(level))))
        else:
            cap = asyncio.Semaphore(s.max_concurrency)
            tasks: list[asyncio.Task[None]] = []

            gaps = random.Random(f"{s.seed}-{level_index}-arrivals")

            async def arrival(index: int, drawn: tuple[dict[str, Any], int, int]) -> None:
                async with cap:
                    done(await self._one(route, level_index, level, index, drawn))

            next_at = time.monotonic()
            while more(issued):
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(arrival(issued, self._payload(rng))))
                issued += 1
                next_at += gaps.expovariate(level)
            await asyncio.gather(*tasks)
        wall = time.monotonic() - started
        cpu_after, jiffies_after = _cpu(route.pids), _machine_jiffies()
        share = {
            role: (cpu_after[role] - cpu_before[role]) / wall if wall > 0 else 0.0
            for role in cpu_after
            if role in cpu_before
        }
        busy = jiffies_after[0] - jiffies_before[0]
        all_ = jiffies_after[1] - jiffies_before[1]
        share["machine"] = busy / all_ if all_ > 0 else 0.0
        records.sort(key=lambda r: r.index)
        return Phase(route.name, level, records, wall, share)
