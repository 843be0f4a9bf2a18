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
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadlab.client import TimedStream, chat_request, host_header, timed_stream
from loadlab.machine import busy_jiffies, cpu_seconds
from loadlab.parts import Route
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
    detail: str | None = None  # why it isn't ok, in a few words (an error's message)

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
            "detail": self.detail,
        }


@dataclass
class Phase:
    route: str
    level: float
    records: list[Record]
    wall_s: float
    cpu_share: dict[str, float]  # role → CPU s per wall s (1.0 = one core); machine: all cores
    charged: dict[int, int] | None = None  # window start → tokens the processor charged


def _outcome(stream: TimedStream, asked: int, tokens_per_chunk: int | None) -> str:
    """``tokens_per_chunk`` None: a backend not started here, whose answers may end before
    ``max_tokens`` (no ignore_eos) and group tokens as it likes: any complete stream with a
    token in it is ok."""
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
    if not stream.complete or not stream.arrivals_ns:
        return "short"
    if tokens_per_chunk is not None and len(stream.arrivals_ns) != -(-asked // tokens_per_chunk):
        return "short"
    return "ok"


def _body_message(body: bytes) -> str:
    """An error body's message (OpenAI's ``{"error": {"message"}}``), else its first line."""
    try:
        doc = orjson.loads(body)
        error = doc.get("error") if isinstance(doc, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message
    except orjson.JSONDecodeError:
        pass
    text = body.decode("utf-8", "replace").strip()
    return text.splitlines()[0] if text else "no body"


def _detail(stream: TimedStream, outcome: str) -> str | None:
    if outcome == "ok":
        return None
    if outcome == "connect_failed":
        return f"connection failed: {stream.connect_error or 'refused'}"
    if outcome in ("error", "refused"):
        return f"HTTP {stream.status}: {_body_message(stream.body)[:200]}"
    if outcome == "cut":
        return f"error event {stream.error_code}"
    if outcome == "timeout":
        return f"no end after the timeout ({len(stream.arrivals_ns)} token events)"
    if not stream.arrivals_ns:
        events = stream.other_events + stream.unreadable_events
        why = f"{stream.unreadable_events} not JSON" if stream.unreadable_events else "none"
        return f"no token event among {events} events ({why}); done={stream.saw_done}"
    if not stream.complete:
        return f"stream ended early after {len(stream.arrivals_ns)} token events"
    return f"{len(stream.arrivals_ns)} token events, not the answer's length"


def make_record(
    route: str,
    level: float,
    index: int,
    stream: TimedStream,
    prompt_words: int,
    asked: int,
    tokens_per_chunk: int | None,
    overhead: int = CHAT_OVERHEAD,
) -> Record:
    """``tokens_per_chunk`` None: not our simulator (see ``_outcome``); without a usage
    event its output is counted as one token per event."""
    arrivals, sent = stream.arrivals_ns, stream.sent_ns
    outcome = _outcome(stream, asked, tokens_per_chunk)
    events = len(arrivals)
    counted = min(asked, events * (tokens_per_chunk or 1))
    output = stream.completion_tokens if stream.completion_tokens is not None else counted
    if outcome == "cut":
        output = counted  # what reached the client, whatever usage the meter closed with
    ttft = (arrivals[0] - sent) / 1e6 if arrivals else None
    e2el = (arrivals[-1] - sent) / 1e6 if arrivals and outcome == "ok" else None
    tpot = None
    if e2el is not None and ttft is not None and output > 1:
        tpot = (e2el - ttft) / (output - 1)
    # Stamps only when every token event carried one (llmsim's ext-stamp-events): other
    # backends send none, and one missing would pair every later stamp with another event.
    chunk_us = []
    if events and len(stream.stamps_ns) == events:
        chunk_us = [
            round((a - s) / 1e3, 1) for a, s in zip(arrivals, stream.stamps_ns, strict=True)
        ]
    return Record(
        route=route,
        level=level,
        index=index,
        start_ns=sent,
        status=stream.status,
        outcome=outcome,
        prompt_tokens=stream.prompt_tokens
        if stream.prompt_tokens is not None
        else prompt_words + overhead,
        max_tokens=asked,
        output_tokens=output,
        events=events,
        ttft_ms=ttft,
        e2el_ms=e2el,
        tpot_ms=tpot,
        itl_ms=[round((b - a) / 1e6, 4) for a, b in itertools.pairwise(arrivals)],
        chunk_latency_us=chunk_us,
        chunk_arrival_ms=[round((a - sent) / 1e6, 3) for a in arrivals],
        error_code=stream.error_code,
        retry_after_s=stream.retry_after_s,
        detail=_detail(stream, outcome),
    )


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
        self._tls: ssl.SSLContext | None = None
        self._models = {t.name: t.model for t in scenario.targets if t.model is not None}

    def tls(self) -> ssl.SSLContext:
        """The system's CAs (SSL_CERT_FILE / SSL_CERT_DIR choose others), made once."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _payload(self, rng: random.Random) -> tuple[dict[str, Any], int, int]:
        words = self.s.prompt_tokens.draw(rng)
        asked = self.s.output_tokens.draw(rng)
        prompt = (WORD * words).strip()
        payload: dict[str, Any] = {"model": self.s.model, "stream": True}
        payload["stream_options"] = {"include_usage": True}
        if self.s.api == "chat":
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        payload["max_tokens"] = asked
        if self.s.ignore_eos:
            payload["ignore_eos"] = True  # exactly max_tokens tokens: the scenario's lengths
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
        if route.name in self._models:
            payload = {**payload, "model": self._models[route.name]}
        rid = f"{route.name}-{level:g}-{index}-{time.time_ns()}"
        host = host_header(route.host, route.port, route.tls)
        request = chat_request(route.path, payload, rid, route.api_key(level_index), host=host)
        try:
            stream = await timed_stream(
                route.port,
                request,
                rid,
                self.s.timeout_s,
                route.host,
                tls=self.tls() if route.tls else None,
            )
        except OSError as exc:  # refused, unreachable, a TLS handshake that failed
            stream = TimedStream(rid, sent_ns=time.time_ns(), connect_error=str(exc)[:200])
        per_chunk = self.s.tokens_per_chunk if route.exact_lengths else None
        overhead = CHAT_OVERHEAD if self.s.api == "chat" else 0
        return make_record(route.name, level, index, stream, words, asked, per_chunk, overhead)

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

    def round_requests(self, level: float) -> int | None:
        """Requests per route in one round of a level (None: the round runs for a time)."""
        total = self.s.phase_requests(level)
        rounds = self.s.rounds_per_level
        if total is None or rounds == 1:
            return total
        floor = int(level) if self.s.mode == "closed" else 1  # every stream busy
        return max(math.ceil(total / rounds), floor)

    async def run_phase(
        self,
        route: Route,
        level_index: int,
        on_done: Callable[[Record], None] = lambda _: None,
        round_index: int = 0,
    ) -> Phase:
        """One route at one level, or its ``round_index``-th round of
        ``rounds_per_level`` (a share of the level's requests or duration)."""
        s = self.s
        level = s.levels[level_index]
        rounds = s.rounds_per_level
        total = self.round_requests(level)
        # The same lengths and arrival times on every route at one level: like for like.
        seed = f"{s.seed}-{level_index}" + (f"-{round_index}" if rounds > 1 else "")
        rng = random.Random(seed)
        records: list[Record] = []
        started = time.monotonic()
        duration = None if s.duration_s is None else s.duration_s / rounds
        deadline = None if duration is None else started + duration
        cpu_before, jiffies_before = _cpu(route.pids), busy_jiffies()

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

            gaps = random.Random(f"{seed}-arrivals")

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
        cpu_after, jiffies_after = _cpu(route.pids), busy_jiffies()
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


def merge_rounds(rounds: list[Phase]) -> Phase:
    """One route's rounds at one level as one phase: records renumbered in order, wall
    times summed, CPU shares weighted by each round's wall time."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    records: list[Record] = []
    for phase in rounds:
        for record in phase.records:
            record.index = len(records)
            records.append(record)
    wall = sum(p.wall_s for p in rounds)
    roles = set.intersection(*(set(p.cpu_share) for p in rounds))
    share = {
        role: sum(p.cpu_share[role] * p.wall_s for p in rounds) / wall if wall > 0 else 0.0
        for role in sorted(roles)
    }
    return Phase(first.route, first.level, records, wall, share)
