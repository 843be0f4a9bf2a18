"""How much of a token budget a burst of streaming clients can really use (LiteLLM's scenario).

The scenario: a tenant with TPM 5,000, clients asking ``max_tokens`` 1,000, answers of
20–200 tokens, a burst of 50 concurrent streaming clients. A gateway that reserves
``max_tokens`` up front (LiteLLM's pre-call reservation; ``charge_mode: reserve_max`` here)
holds 5,000 / (prompt + 1,000) = 4 requests at once although each uses ~130 tokens, and
refuses the rest with most of the budget unused. Lease-ahead billing should let the burst
use (nearly) all of the budget, and never go past it.

Everything is real but the answer length: redis-server, Envoy with the billing processor
(as the gateway tests start them), and llmsim from ``--profile`` (``fast.yaml``; or
``llm-d-v0.10.2.yaml``, llm-d-inference-sim's behaviour) paced at ``--itl-ms`` per token.
Clients send ``max_tokens: 1000`` through the gateway, so the gateway meters against 1,000
and never learns how long an answer will be. llmsim answers a limit of 1,000 with a
six-bucket histogram (mostly ≤ 60 or ≥ 900 tokens; v0.10.2's hits the limit 15% of the
time), and a per-request ``max_tokens``/``ignore_eos`` would tell the gateway the length, so
llmsim runs here with one change, made in its own process: a random-mode answer is uniform
in ``--answer-min``..``--answer-max`` tokens (``finish_reason: stop``), as a model stopping
at its own EOS. With ``fast.yaml`` output is whole o200k_base tokens, one per event; with
the compat profile it is v0.10.2's pieces, which its dummy tokenizer counts a few % below
o200k (gpt-4.1 is billed ``max(server's usage, the meter's count)``, docs/billing.md).

Columns: the ``reserve_max`` baseline and each ``--batches`` size (incremental charging),
each on a fresh tenant with ``tpm: 5000`` on a one-hour window, so that every run lies in
ONE window (the benchmark waits for the next hour if too little of this one is left). Per
column, ``--clients`` clients start at once; one table per way a client takes a 429:

* ``backoff`` (closed loop): each client sends a streaming request, reads it to the end,
  sends the next; on 429 it waits 50–250 ms and sends again, so refunds from streams in
  flight get used: what the gateway lets through in the end.
* ``retry-after`` (closed loop): the same, but a refused client honours ``Retry-After``,
  which for a TPM refusal is the window's end: it is done for this window. A request
  refused while the budget is only *reserved* (and refunded later) is lost for the window.
* ``once`` (the burst alone): each client sends one request. This is how the issue measured
  the scenario (batch 32 → 0.977–0.995, batch 128 → 0.51–0.66 with the former rule).

A column ends when its window is used: every client refused (``retry-after``), every client
done (``once``), or no stream in flight or ended for 0.3 s and every client refused twice
since (``backoff``); ``--max-seconds`` bounds it (only ``reserve_max`` in a closed loop, 4
streams at a time, gets near it). Then the run waits until the processor has settled every
admitted request, and reads the tenant's counter.

The figures, and why they are honest:

* **utilisation** = tokens charged in the window / limit, from the Redis counter once every
  request is settled: committed use (prompt + delivered output, or the upstream's own
  ``usage`` for a completed stream), never a reservation. Every unused lease has been
  refunded, and none is lost to a window end: every request starts and settles in the
  window. The demand exceeds the budget in every table: ~38 requests of this mix fill
  5,000 tokens and 50 clients ask for ~50 × 130 = 6,500 in the first burst alone, so
  budget left unused is the gateway's doing, not a lack of traffic.
* **client-side total**: the same figure rebuilt by the clients — prompt tokens counted as
  the gateway counts them, plus the output tokens in what each client received,
  re-tokenized with o200k_base as the tests do. It must equal the counter (a note is printed
  otherwise, and when a complete stream's ``usage`` differs from the client's count); minus
  the limit it gives **over budget**, which must be 0.
* **billed / server usage / delivered**, over the complete streams: their ledger entries,
  the usage the server reported, and the client's own count (prompt as the gateway counts
  it, o200k of the text received). With ``fast.yaml`` all three agree.
* **in complete answers**: the share of the limit spent on requests whose answer was not
  cut. A stream is cut when a lease is refused: the tenant pays for tokens it received,
  but a truncated answer. Utilisation counts them (the client got them); this row shows
  how much of the budget went to whole answers.
* **room left / smallest request**: unused budget vs the cheapest possible request (prompt
  + ``--answer-min``): admission needs the prompt plus its first reservation, so a little
  room can stay unused; much more than a request's worth is budget refused while free.

    .venv/bin/python benchmarks/bench_utilisation.py [--batches 32,128] [--clients 50]
        [--tpm 5000] [--itl-ms 20] [--behaviours backoff,retry-after,once] [--no-baseline]
        [--profile fast.yaml|llm-d-v0.10.2.yaml]

Target (issue 8 item 11): ≥ 98 % of the budget used at batch 32 and at batch 128, 0 tokens
over the budget. Runtime ~1.5 min (~30 s with ``--no-baseline``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.98
WINDOW_S = 3600
MAX_TOKENS = 1000
MODEL = "gpt-4.1"
BEHAVIOURS = ("backoff", "retry-after", "once")
# backoff clients: the window is used once no stream has been in flight (or ended) for this
# long and every client has been refused this many times since.
QUIET_S = 0.3
REFUSALS_PER_CLIENT = 2
BACKOFF_S = (0.05, 0.25)
PROBE_KEY = "sk-probe"

LEASE_REFUSALS = 'extproc_lease_batches_total{result="refused"}'


# -- the simulator, with answers of a given length range ---------------------------------


def run_simulator(argv: list[str]) -> int:
    """llmsim's own ``main`` with random-mode answers uniform in [min, max] tokens."""
    from llmsim import cli, textgen
    from llmsim.llmd import answers

    low, high = int(os.environ["BENCH_ANSWER_MIN"]), int(os.environ["BENCH_ANSWER_MAX"])

    def sample_length(
        max_tokens: int | None, ignore_eos: bool, context_left: int, rng: random.Random
    ) -> int:
        limit = max_tokens if max_tokens is not None else max(1, context_left)
        return limit if ignore_eos else min(limit, rng.randint(low, high))

    def histogram_length(limit: int, rng: random.Random) -> int:
        return min(limit, rng.randint(low, high))

    textgen.sample_length = sample_length  # plan_answer looks it up at call time
    answers.histogram_length = histogram_length  # the compat one's random_answer, the same
    return cli.main(argv)


# -- clients -------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: int
    request_id: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cut: bool = False  # the gateway ended the stream: a lease was refused
    complete: bool = False  # a whole answer: finish event, [DONE], no error
    usage: dict[str, Any] | None = None  # the upstream's usage, on a complete stream
    error_body: str = ""  # the start of a refusal's body


@dataclass
class Load:
    """One column's clients: what they got, and whether the window is used."""

    clients: int
    behaviour: str
    deadline: float
    streaming: int = 0
    last_change: float = field(default_factory=time.monotonic)
    refusals_since_change: int = 0
    done: bool = False
    outcomes: list[Outcome] = field(default_factory=list)

    def changed(self) -> None:
        self.last_change = time.monotonic()
        self.refusals_since_change = 0

    def refused(self) -> None:
        self.refusals_since_change += 1
        if (
            self.streaming == 0
            and time.monotonic() - self.last_change >= QUIET_S
            and self.refusals_since_change >= REFUSALS_PER_CLIENT * self.clients
        ):
            self.done = True


async def one_request(host: str, port: int, api_key: str, body: bytes, load: Load) -> Outcome:
    """POST over a raw HTTP/1.1 socket, keep every byte that arrived; count streams in flight."""
    from loadlab.sse_client import dechunk, parse_events

    request_id = str(uuid.uuid4())
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\n"
        f"Authorization: Bearer {api_key}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-request-id: {request_id}\r\n"
        "Connection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(host, port)
    streaming = False
    raw = bytearray()
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        try:
            raw += await reader.readuntil(b"\r\n\r\n")
            if raw.startswith(b"HTTP/1.1 200 "):
                streaming = True
                load.streaming += 1
                load.changed()
            while chunk := await asyncio.wait_for(reader.read(65536), timeout=60):
                raw += chunk
        except (ConnectionResetError, asyncio.IncompleteReadError):
            pass
    finally:
        writer.close()
        if streaming:
            load.streaming -= 1
            load.changed()
    header_blob, _, rest = bytes(raw).partition(b"\r\n\r\n")
    status = int(header_blob.split(b" ", 2)[1]) if header_blob.startswith(b"HTTP/") else 0
    outcome = Outcome(status, request_id)
    if status != 200:
        outcome.error_body = rest[:300].decode(errors="replace")
        return outcome
    chunked = b"transfer-encoding: chunked" in header_blob.lower()
    content, clean = dechunk(rest) if chunked else (rest, True)
    events = parse_events(content)
    text = []
    finished = False
    error = None
    for event in events:
        if not isinstance(event, dict):
            continue
        error = error or event.get("error")
        outcome.usage = outcome.usage or event.get("usage")
        for choice in event.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
            finished = finished or choice.get("finish_reason") is not None
    outcome.output_tokens = len(_tokenizer().encode("".join(text)))
    outcome.cut = error is not None
    outcome.complete = clean and finished and error is None and events[-1:] == ["[DONE]"]
    return outcome


def _tokenizer() -> Any:
    from extproc.tokens.encodings import load_tokenizer

    return load_tokenizer("o200k_base")


async def client(index: int, host: str, port: int, api_key: str, load: Load) -> None:
    from extproc.tokens.prompt import count_prompt_tokens
    from extproc.tokens.registry import TokenizerRegistry

    registry = TokenizerRegistry.from_config([{"match": MODEL, "tokenizer": "o200k_base"}])
    counter = registry.counter_for(MODEL)
    rng = random.Random(index)
    n = 0
    while not load.done and time.monotonic() < load.deadline:
        n += 1
        payload = {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": MAX_TOKENS,
            "messages": [
                {"role": "user", "content": f"Client {index}, question {n}: what is a quota?"}
            ],
        }
        outcome = await one_request(host, port, api_key, orjson.dumps(payload), load)
        load.outcomes.append(outcome)
        if outcome.status not in (200, 429):
            raise SystemExit(f"client {index}: status {outcome.status}: {outcome.error_body}")
        if outcome.status == 200:
            outcome.prompt_tokens = count_prompt_tokens(payload, counter)
        if load.behaviour == "once":
            return  # one request per client: the burst
        if outcome.status == 429 and load.behaviour == "retry-after":
            return  # Retry-After is the window's end: this client is done with the window
        if outcome.status == 429:
            load.refused()
            await asyncio.sleep(rng.uniform(*BACKOFF_S))


async def burst(host: str, port: int, api_key: str, load: Load) -> None:
    await asyncio.gather(*(client(i, host, port, api_key, load) for i in range(load.clients)))
    load.done = True


# -- figures -------------------------------------------------------------------------------


@dataclass
class Column:
    plan: str  # "max" or "b<batch>"
    behaviour: str
    limit: int
    answer_min: int
    charged: int = 0
    windows: int = 0
    seconds: float = 0.0
    finished: bool = False  # the window was used before the time limit
    metrics: dict[str, float] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    billed: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id: ledger

    @property
    def title(self) -> str:
        return "reserve max_tokens" if self.plan == "max" else f"batch {self.plan[1:]}"

    @property
    def tenant(self) -> str:
        return f"{self.plan}-{self.behaviour}"

    @property
    def utilisation(self) -> float:
        return self.charged / self.limit

    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def client_total(self) -> int:
        return sum(o.prompt_tokens + o.output_tokens for o in self.admitted())

    def usage_mismatches(self) -> int:
        """Complete streams whose upstream usage differs from the client's own count."""
        return sum(
            1
            for o in self.admitted()
            if o.complete
            and o.usage is not None
            and (o.usage.get("completion_tokens"), o.usage.get("prompt_tokens"))
            != (o.output_tokens, o.prompt_tokens)
        )

    def three_ways(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(prompt, output) over the complete streams: billed, server usage, delivered."""
        done = [o for o in self.admitted() if o.complete and o.request_id in self.billed]
        usages = [o.usage or {} for o in done]
        billed = [self.billed[o.request_id] for o in done]
        return (
            (sum(b[0] for b in billed), sum(b[1] for b in billed)),
            (
                sum(int(u.get("prompt_tokens", 0)) for u in usages),
                sum(int(u.get("completion_tokens", 0)) for u in usages),
            ),
            (sum(o.prompt_tokens for o in done), sum(o.output_tokens for o in done)),
        )

    def over_budget(self) -> int:
        return max(0, self.client_total() - self.limit)

    def cells(self) -> list[str]:
        admitted = self.admitted()
        complete = [o for o in admitted if o.complete]
        cut = sum(1 for o in admitted if o.cut)
        other = len(admitted) - len(complete) - cut
        refused = sum(1 for o in self.outcomes if o.status == 429)
        complete_total = sum(o.prompt_tokens + o.output_tokens for o in complete)
        smallest = min((o.prompt_tokens for o in admitted), default=0) + self.answer_min
        m = self.metrics.get
        billed, usage, ours = self.three_ways()
        return [
            f"{self.charged:,} = {100 * self.utilisation:.1f} %",
            f"{self.client_total():,} ({sum(o.output_tokens for o in admitted):,} output)",
            f"{self.over_budget():,}",
            f"{100 * complete_total / self.limit:.1f} %",
            f"{self.limit - self.charged:,} / {smallest}",
            f"{len(admitted)} ({len(complete)} / {cut} / {other})",
            f"{refused:,}",
            f"{m('extproc_local_admissions_total', 0):.0f}",
            f"{m('extproc_lease_batches_total', 0):.0f} / {m(LEASE_REFUSALS, 0):.0f}",
            f"{m('extproc_events_waited_total', 0):.0f} of {m('extproc_sse_events_total', 0):.0f}",
            f"{self.seconds:.1f}" + ("" if self.finished else " (time limit)"),
            f"{billed[1]:,} / {usage[1]:,} / {ours[1]:,}",
            f"{billed[0]:,} / {usage[0]:,} / {ours[0]:,}",
        ]


ROW_NAMES = [
    "utilisation: charged / limit",
    "client-side total (prompt + output received)",
    "over budget (client-side total − limit)",
    "in complete answers / limit",
    "room left / smallest request",
    "admitted (complete / cut / other)",
    "refused (429)",
    "admitted from a block (admission leases)",
    "lease batches / refused",
    "events that waited on Redis",
    "seconds until the window was used",
    "complete streams' output: billed / server usage / delivered",
    "complete streams' prompt: billed / server usage / gateway's count",
]


# -- the benchmark ---------------------------------------------------------------------------


def counter_in_window(client: Any, tenant: str, window_start: int) -> tuple[int, int]:
    """The tenant's TPM counter in the measured window, and how many windows it touched."""
    from extproc.quota import keys

    prefix = keys.counter_key(tenant, "tpm", MODEL, WINDOW_S)
    found = {k: int(client.get(k) or 0) for k in client.scan_iter(match=prefix + ":*")}
    return found.get(f"{prefix}:{window_start}", 0), len(found)


def ledger_of(client: Any, tenant: str) -> dict[str, tuple[int, int]]:
    """Client request id -> (prompt, output) billed, from the tenant's usage ledger."""
    entries = client.xrange(f"tq:{{{tenant}}}:usage")
    return {
        e["client_request_id"]: (int(e["prompt_tokens"]), int(e["output_tokens"]))
        for _, e in entries
    }


def settled_all(after: dict[str, float], before: dict[str, float], admitted: int) -> bool:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return delta("extproc_requests_admitted_total") >= admitted and delta(
        "extproc_settlements_total"
    ) >= delta("extproc_requests_admitted_total")


def plan_doc(plan: str, tpm: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"window_s": WINDOW_S, "limits": {"*": {"tpm": tpm}}}
    if plan == "max":
        return {**doc, "charge_mode": "reserve_max"}
    return {**doc, "charge_mode": "incremental", "batch_tokens": int(plan[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--behaviours", default=",".join(BEHAVIOURS))
    parser.add_argument("--no-baseline", action="store_true", help="skip reserve_max")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--tpm", type=int, default=5000)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--answer-min", type=int, default=20)
    parser.add_argument("--answer-max", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=30.0, help="per column")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--profile",
        default="fast.yaml",
        help="simulator profile: a name in simulator_profiles/ or a path (llm-d-v0.10.2.yaml: "
        "llm-d-inference-sim v0.10.2's tokenizer and chunks)",
    )
    parser.add_argument(
        "--admission-leases",
        action="store_true",
        help="admission_leases on (docs/design-admission-leases.md): utilisation must hold",
    )
    args = parser.parse_args()
    plans = ([] if args.no_baseline else ["max"]) + [f"b{b}" for b in args.batches.split(",")]
    behaviours = args.behaviours.split(",")
    if not set(behaviours) <= set(BEHAVIOURS):
        parser.error(f"--behaviours: choose from {', '.join(BEHAVIOURS)}")

    import redis as redis_lib

    from loadlab.figures import table, verdict
    from loadlab.gateway import Envoy, http_get, key_hash, wait_until, write_config
    from loadlab.procs import ManagedProcess, free_port
    from loadlab.redis_server import RedisServer
    from loadlab.rig import MODELS, start_billing_processor
    from loadlab.simulator import profile_path

    try:
        profile = profile_path(args.profile)
    except FileNotFoundError as exc:
        parser.error(f"--profile: {exc}")

    columns = [
        Column(plan, behaviour, args.tpm, args.answer_min)
        for behaviour in behaviours
        for plan in plans
    ]
    workdir = Path(tempfile.mkdtemp(prefix="bench-utilisation-"))
    leases = "on" if args.admission_leases else "off"
    print(f"load average at start: {os.getloadavg()[0]:.2f}; admission leases {leases}", flush=True)
    config = write_config(
        workdir / "quota.yaml",
        {
            "models": MODELS,
            "plans": {c.tenant: plan_doc(c.plan, args.tpm) for c in columns},
            "tenants": {
                **{
                    c.tenant: {"plan": c.tenant, "key_sha256": [key_hash(f"sk-{c.tenant}")]}
                    for c in columns
                },
                # Never metered: readiness probes through the gateway before the runs.
                "probe": {"plan": columns[0].tenant, "key_sha256": [key_hash(PROBE_KEY)]},
            },
            "stream_idle_timeout_s": 120,
            "admission_leases": {"enabled": args.admission_leases},
        },
    )
    sim_port = free_port()
    sim_argv = [
        sys.executable, __file__, "--llmsim",
        "--config", str(profile),
        "--host", "127.0.0.1", "--port", str(sim_port),
        "--inter-token-latency", f"{args.itl_ms}ms",
        "--seed", str(args.seed), "--log-level", "WARNING",
    ]  # fmt: skip
    sim_env = {"BENCH_ANSWER_MIN": str(args.answer_min), "BENCH_ANSWER_MAX": str(args.answer_max)}
    started: list[Any] = []
    try:
        redis = RedisServer.start(workdir / "redis")
        started.append(redis)
        sim = ManagedProcess(sim_argv, workdir / "llmsim.log", env=sim_env, cwd=ROOT)
        started.append(sim)
        health = f"http://127.0.0.1:{sim_port}/health"
        sim.wait_ready(lambda: _answers(http_get, health), timeout_s=30)
        processor = start_billing_processor(config, workdir, redis.url)
        started.append(processor)
        envoy = Envoy.start(workdir, [processor.port], [sim_port])
        started.append(envoy)
        # Envoy health-checks its processors: wait until requests really get through.
        if not wait_until(lambda: _gateway_ready(envoy.base_url), timeout_s=30, interval_s=0.1):
            raise SystemExit("the gateway did not answer GET /v1/models with 200 within 30 s")
        rclient = redis_lib.Redis(port=redis.port, decode_responses=True)

        needed = len(columns) * (args.max_seconds + 10) + 30
        left = WINDOW_S - int(rclient.time()[0]) % WINDOW_S
        if left < needed:
            print(f"waiting {left} s for the next window, so the run lies in one", flush=True)
            time.sleep(left + 1)
        window_start = int(rclient.time()[0]) // WINDOW_S * WINDOW_S

        for col in columns:
            before = processor.metrics()
            load = Load(args.clients, col.behaviour, time.monotonic() + args.max_seconds)
            t0 = time.monotonic()
            asyncio.run(burst("127.0.0.1", envoy.ports.listen, f"sk-{col.tenant}", load))
            col.seconds = time.monotonic() - t0
            col.finished = time.monotonic() < load.deadline
            col.outcomes = load.outcomes
            admitted = len(col.admitted())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if settled_all(processor.metrics(), before, admitted):
                    break
                time.sleep(0.05)
            after = processor.metrics()
            col.metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
            col.charged, col.windows = counter_in_window(rclient, col.tenant, window_start)
            col.billed = ledger_of(rclient, col.tenant)
            print(f"{col.behaviour:>11} {col.title}: {col.seconds:.1f} s", flush=True)
        rclient.close()
    finally:
        for part in reversed(started):
            part.stop()

    prompts = [o.prompt_tokens for c in columns for o in c.admitted()]
    prompt = sum(prompts) / len(prompts)
    mean_cost = prompt + (args.answer_min + args.answer_max) / 2
    print()
    print(
        f"simulator profile {args.profile}; "
        f"{args.clients} clients, tpm {args.tpm:,}, max_tokens {MAX_TOKENS}, answers "
        f"{args.answer_min}–{args.answer_max} tokens (prompt ≈ {prompt:.0f}), ITL "
        f"{args.itl_ms:g} ms: the budget holds ≈ {args.tpm / mean_cost:.0f} requests of this "
        f"mix; reserving max_tokens, {args.tpm // round(prompt + MAX_TOKENS)} at once"
    )
    for behaviour in behaviours:
        cols = [c for c in columns if c.behaviour == behaviour]
        print()
        print(f"clients on 429: {behaviour}")
        cells = [c.cells() for c in cols]
        rows = [[name, *(col[i] for col in cells)] for i, name in enumerate(ROW_NAMES)]
        print(table(["", *(c.title for c in cols)], rows))
    print()
    for col in columns:
        notes = [] if col.windows == 1 else [f"counter in {col.windows} windows"]
        if col.client_total() != col.charged:
            notes.append(f"client-side total {col.client_total()} ≠ charged {col.charged}")
        if col.usage_mismatches():
            notes.append(f"{col.usage_mismatches()} complete streams' usage ≠ client count")
        note = f" ({'; '.join(notes)})" if notes else ""
        ok = col.utilisation >= TARGET and col.over_budget() == 0
        target = verdict(ok) if col.plan != "max" else "baseline"
        print(f"{col.behaviour:>11} {col.title}: ≥ 98 % used, 0 over budget: {target}{note}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def _gateway_ready(base_url: str) -> bool:
    request = urllib.request.Request(
        f"{base_url}/v1/models", headers={"Authorization": f"Bearer {PROBE_KEY}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=1) as reply:
            return reply.status == 200
    except OSError:  # URLError and HTTPError included
        return False


def _answers(http_get: Any, url: str) -> bool:
    try:
        return http_get(url, 0.5)[0] == 200
    except OSError:
        return False


if __name__ == "__main__":
    if sys.argv[1:2] == ["--llmsim"]:
        sys.exit(run_simulator(sys.argv[2:]))
    main()
