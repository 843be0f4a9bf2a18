"""``extproc chaos``: a steady load through Envoy and N processors while the simulator fails,
clients misbehave and a timeline of faults hits Redis, the processors and Envoy; then an
integrity report, one row per invariant.

    extproc chaos [SCENARIO.yaml] [--out DIR] [--quiet] [--duration-s S] [--rate R]
        [--profile fast.yaml|llm-d-v0.10.2.yaml|PATH]

Exit status: 0 every invariant held, 1 one failed (or a part failed), 2 a bad scenario or
flag, 130 interrupted. docs/benchmarking.md, "extproc chaos".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from loadlab.chaos_scenario import ChaosScenario, load_chaos, parse_chaos
from loadlab.client import TimedStream, chat_request, timed_stream
from loadlab.engine import CHAT_OVERHEAD, WORD
from loadlab.faults import ChaosParts, tenant_api_key, usage
from loadlab.harness import Run, one_line
from loadlab.integrity import (
    EXCUSED,
    MALFORMED,
    WELL_FORMED,
    Check,
    Watcher,
    block_figures,
    check_budget,
    check_counters,
    check_open,
    check_outcomes,
    check_resources,
    check_settled_once,
)
from loadlab.parts import CHAT_PATH
from loadlab.report import Live
from loadlab.rig import MODEL
from loadlab.scenario import ScenarioError
from loadlab.tables import output_console, print_table

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = ROOT / "benchmarks" / "chaos" / "default.yaml"
# After a fault ends, how long its effects may still show (Envoy's health checks need two
# failed checks half a second apart to drop a dead processor, and one more to take it back).
FAULT_GRACE_S = 2.0
TAMPERS = ("counter", "ledger", "lost_admission")
UPSTREAM_ERROR = "upstream_error"  # the code of the event ending a stream it cannot read


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="extproc chaos",
        description="Chaos runs with an integrity report (docs/benchmarking.md).",
    )
    p.add_argument(
        "scenario",
        nargs="?",
        type=Path,
        help="scenario YAML (default: benchmarks/chaos/default.yaml)",
    )
    p.add_argument("--out", type=Path, help="results folder (default: results/<name>-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar: plain lines")
    p.add_argument("--duration-s", type=float, help="override the scenario's duration_s")
    p.add_argument("--rate", type=float, help="override load.rate (requests/s)")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--profile",
        help="override simulator.profile: a name in simulator_profiles/ (llm-d-v0.10.2.yaml: "
        "the real simulator's behaviour) or a path",
    )
    # A test hook: breaks one invariant in Redis after the run, before the checks, so a
    # test can prove the report fails. Never a switch of the processor.
    p.add_argument("--tamper", choices=TAMPERS, help=argparse.SUPPRESS)
    return p


def build(args: argparse.Namespace) -> ChaosScenario:
    path = args.scenario or DEFAULT_SCENARIO
    s = load_chaos(path)
    doc = s.to_doc()
    if args.duration_s is not None:
        doc["duration_s"] = args.duration_s
    if args.rate is not None:
        doc["load"]["rate"] = args.rate
    if args.seed is not None:
        doc["seed"] = args.seed
    if args.profile is not None:
        doc["simulator"]["profile"] = args.profile
    return parse_chaos(doc) if doc != s.to_doc() else s


# --- load -------------------------------------------------------------------------------


class Load:
    def __init__(self, s: ChaosScenario, parts: ChaosParts, live_advance: Any) -> None:
        self.s = s
        self.parts = parts
        self.records: list[dict[str, Any]] = []
        self.advance = live_advance
        self.origin = 0.0
        self._cap = asyncio.Semaphore(s.max_concurrency)

    async def _attempt(self, index: int, attempt: int, rng: random.Random) -> dict[str, Any]:
        s = self.s
        tenant = index % s.tenants
        words = s.prompt_tokens.draw(rng)
        asked = s.output_tokens.draw(rng)
        close_after = None
        if rng.random() * 100 < s.client_disconnect_rate:
            close_after = rng.randint(1, max(1, asked // 2))
        payload = {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": (WORD * words).strip()}],
            "max_tokens": asked,
            "ignore_eos": True,
        }
        rid = f"chaos-{index}-{attempt}-{time.time_ns()}"
        request = chat_request(CHAT_PATH, payload, rid, tenant_api_key(tenant), host="chaos")
        try:
            stream = await timed_stream(
                self.parts.port, request, rid, s.timeout_s, close_after=close_after, validate=True
            )
        except OSError:
            stream = TimedStream(rid, sent_ns=time.time_ns())
        end = time.time()
        return {
            "request_id": rid,
            "tenant": self.parts.tenants[tenant],
            "index": index,
            "attempt": attempt,
            "start_s": round(stream.sent_ns / 1e9 - self.origin, 4),
            "end_s": round(end - self.origin, 4),
            "start_ns": stream.sent_ns,
            "status": stream.status,
            "outcome": "",  # classified once the fault timeline is known
            "detail": _detail(stream),
            "prompt_tokens": stream.prompt_tokens or words + CHAT_OVERHEAD,
            "max_tokens": asked,
            "output_tokens": delivered_tokens(stream),
            "events": len(stream.arrivals_ns),
            "error_code": stream.error_code,
            "error_body": _error_body(stream),
            "bad_events": stream.bad_events,
            "client_closed": stream.client_closed,
            "retry_after_s": stream.retry_after_s,
        }

    async def request(self, index: int) -> None:
        rng = random.Random(f"{self.s.seed}-{index}")
        async with self._cap:
            for attempt in range(self.s.retries + 1):
                rec = await self._attempt(index, attempt, rng)
                self.records.append(rec)
                self.advance(rec)
                retryable = rec["status"] in (0, 429, 503) and not rec["client_closed"]
                if not retryable or attempt == self.s.retries:
                    return
                pause = self.s.backoff_s * 2**attempt
                if rec["retry_after_s"] is not None:
                    pause = max(pause, min(rec["retry_after_s"], 2.0))
                await asyncio.sleep(pause)

    async def run(self) -> None:
        s = self.s
        arrivals = random.Random(f"{s.seed}-arrivals")
        tasks: list[asyncio.Task[None]] = []
        index = 0

        async def burst(at_s: float, count: int) -> None:
            nonlocal index
            await asyncio.sleep(max(0.0, self.origin + at_s - time.time()))
            for _ in range(count):
                tasks.append(asyncio.create_task(self.request(index)))
                index += 1

        bursts = [asyncio.create_task(burst(b.at_s, b.requests)) for b in s.bursts]
        next_at = self.origin
        end = self.origin + s.duration_s
        while next_at < end:
            delay = next_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.request(index)))
            index += 1
            next_at += arrivals.expovariate(s.rate)
        await asyncio.gather(*bursts)
        await asyncio.gather(*tasks)


@functools.cache
def _o200k() -> Any:
    from extproc.tokens.encodings import load_tokenizer

    return load_tokenizer("o200k_base")


def delivered_tokens(stream: TimedStream) -> int:
    """o200k tokens of the text the client read, as the meter counts it: one per event from
    llmsim's exact profile, not from v0.10.2's pieces ("(", "x", "+" can be fewer)."""
    return len(_o200k().encode("".join(stream.text)))


def _detail(stream: TimedStream) -> str:
    if stream.client_closed:
        return "client_closed"
    if stream.status == 0:
        return "timeout" if stream.timed_out else "connect_failed"
    if stream.status != 200:
        return "status"
    if stream.bad_events:
        return "bad_events"
    if stream.timed_out:
        return "timeout"
    if not stream.complete:
        return "reset"
    if stream.error_code is not None:
        return "error_event"
    return "done" if stream.saw_done else "no_done"


def _error_body(stream: TimedStream) -> bool | None:
    """An OpenAI-style error body: ``{"error": {"message": ...}}`` (None: not an error)."""
    if stream.status in (0, 200):
        return None
    try:
        doc = orjson.loads(stream.body)
    except orjson.JSONDecodeError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def classify(rec: dict[str, Any], spans: Sequence[tuple[float, float]], s: ChaosScenario) -> str:
    """complete / cut_clean / error_status / client_disconnect are well-formed;
    reset_by_fault (the request overlapped a fault on the timeline), reset_by_upstream (the
    stream broke off mid-body while the simulator disconnects streams: Envoy resets the
    client, as tests/gateway/test_chaos.py documents) and malformed_upstream (the
    simulator's malformed event: the processor ends the stream there, cleanly, with an
    ``upstream_error`` event and ``[DONE]``) are explained; the rest is malformed, an event
    no client can parse reaching the client included (the processor never forwards one)."""
    detail = rec["detail"]
    if detail == "client_closed":
        return "client_disconnect"
    if detail == "done":
        return "complete"
    if detail == "error_event" and rec["error_code"] == UPSTREAM_ERROR:
        # The processor found the stream unreadable: explained only by injected events.
        return "malformed_upstream" if s.malformed_rate > 0 else "malformed"
    if detail == "error_event":
        return "cut_clean"
    if detail == "status" and rec["error_body"]:
        return "error_status"
    during = any(a - 0.5 <= rec["end_s"] and rec["start_s"] <= b + FAULT_GRACE_S for a, b in spans)
    if during and detail in ("status", "reset", "connect_failed", "timeout"):
        return "reset_by_fault"
    if s.disconnect_rate > 0 and detail == "reset" and rec["status"] == 200:
        return "reset_by_upstream"
    return "malformed"


# --- the run ----------------------------------------------------------------------------


async def _fault(parts: ChaosParts, origin: float, fault: Any, live: Live) -> None:
    await asyncio.sleep(max(0.0, origin + fault.at_s - time.time()))
    try:
        applied = await asyncio.to_thread(parts.apply, fault)
        live.note(f"  {fault.kind} at {applied.started_s - origin:.1f}s {applied.note}".rstrip())
    except (RuntimeError, TimeoutError, OSError) as exc:
        # e.g. a processor restarted while Redis is away exits: the fault says so.
        text = one_line(exc)
        if parts.applied and parts.applied[-1].kind == fault.kind:
            parts.applied[-1].note = f"failed: {text}"
            parts.applied[-1].ended_s = parts.applied[-1].ended_s or time.time()
        live.note(f"  {fault.kind} failed: {text}")


def settle_bound_s(s: ChaosScenario) -> float:
    """docs/operations.md: a dead processor's records are settled within heartbeat_ttl_s +
    1.2 × orphan_sweep_s of its death, and a peer just back from a Redis outage (or a
    failover of the master holding the heartbeats) first trusts its own beats for a TTL."""
    return 2 * s.heartbeat_ttl_s + 1.2 * s.orphan_sweep_s


async def _drain(s: ChaosScenario, watcher: Watcher) -> dict[str, Any]:
    """Wait until no admitted reservation is open, polling the watcher's full reads (each
    condition seen on a read that began after the last check). The deadline is the sweep
    bound many times over plus the streams' idle timeout, for a loaded machine: a deadline
    only ends a run that failed, it is never what the run waits for."""
    started = time.monotonic()
    deadline = started + 10 * settle_bound_s(s) + s.stream_idle_timeout_s + 30
    first: int | None = None
    left = 0
    while time.monotonic() < deadline:
        await watcher.next_full_read(deadline)
        left = len(watcher.open_records())
        first = left if first is None else first
        if not left:
            break
    return {
        "drain_s": time.monotonic() - started,
        "open_at_load_end": first or 0,
        "open_after_drain": left,
        "settle_bound_s": settle_bound_s(s),
    }


async def _run(
    s: ChaosScenario, parts: ChaosParts, live: Live, tamper: str | None
) -> dict[str, Any]:
    # Loaded now, not by the first stream's end: loading blocks the loop for seconds on a
    # busy machine, and the watcher on it would miss windows' final values.
    await asyncio.to_thread(_o200k)
    before = {pid: u for pid in parts.processor_pids() if (u := usage(pid)) is not None}
    watcher = Watcher(
        parts.redis_url,
        cluster_ports=parts.cluster_ports(),
        cluster_shards=parts.cluster_shards,
    )
    watcher.start()
    total = None
    live.note(
        "  progress: ok = complete; expected = what the scenario causes (budget cut-offs, "
        "refusals, injected errors, clients hanging up, resets during a fault); failed = "
        "anything else (the report's 'malformed')"
    )
    with live.phase(f"chaos {s.name}: {s.duration_s:g}s at {s.rate:g} req/s", total) as adv:
        load = Load(s, parts, lambda rec: adv(progress_kind(rec, parts, load.origin, s)))
        load.origin = time.time() + 0.2
        faults = [asyncio.create_task(_fault(parts, load.origin, f, live)) for f in s.faults]
        try:
            await load.run()
            await asyncio.gather(*faults)
        finally:  # also on Ctrl-C: a fault's thread mustn't hold the way out
            parts.abort.set()
    live.note("  load done; waiting for every reservation to settle")
    drain = await _drain(s, watcher)
    after = {pid: u for pid in parts.processor_pids() if (u := usage(pid)) is not None}
    await watcher.stop()
    final = await watcher.final_read(tamper)
    metrics = []
    for p in parts.processors:
        if p is not None:
            try:
                metrics.append(p.metrics())
            except OSError:
                continue
    return {
        "load": load,
        "watcher": watcher,
        "final": final,
        "before": before,
        "after": after,
        "drain": drain,
        "metrics": metrics,
    }


def progress_kind(rec: dict[str, Any], parts: ChaosParts, origin: float, s: ChaosScenario) -> str:
    """The progress bar's kind of a request just ended: its class against the faults applied
    so far (the report classifies again with the whole timeline)."""
    now = time.time()
    spans = [(a.started_s - origin, (a.ended_s or now) - origin) for a in parts.applied]
    outcome = classify(rec, spans, s)
    return "ok" if outcome == "complete" else "failed" if outcome == MALFORMED else "expected"


def integrity(
    s: ChaosScenario,
    result: dict[str, Any],
    records: list[dict[str, Any]],
    kills: list[float],
    parts: ChaosParts | None = None,
    origin: float = 0.0,
) -> list[Check]:
    w: Watcher = result["watcher"]
    settled, lost = check_settled_once(w, kills)
    checks = [
        check_budget(w, s.tpm, records),
        settled,
        check_open(w, kills, result["final"]["live_owners"]),
        check_counters(w, lost, s.timeout_s, kills),
        check_outcomes(records),
        check_resources(result["before"], result["after"]),
    ]
    if parts is not None and (parts.replaced or parts.killed_masters or _crash_faults(s)):
        checks.append(check_crashes(s, parts))
        if parts.killed_masters:
            checks.append(check_healthy_masters(parts, records, origin))
    return checks


def _crash_faults(s: ChaosScenario) -> list[Any]:
    return [f for f in s.faults if f.worker is not None or f.master is not None]


def check_crashes(s: ChaosScenario, parts: ChaosParts) -> Check:
    """Every worker kill and master kill of the scenario happened: the worker's pid was
    SIGKILLed and its supervisor started another in its place; the master's pid was
    SIGKILLed and its replica took its slots; a master killed ``for`` a time came back as
    its successor's replica."""
    planned_workers = sum(1 for f in s.faults if f.worker is not None)
    planned_masters = sum(1 for f in s.faults if f.master is not None)
    planned_rejoins = sum(1 for f in s.faults if f.master is not None and f.for_s)
    gone = [r for r in parts.replaced if os.path.exists(f"/proc/{r['killed_pid']}")]
    promoted = [f for f in parts.failovers if f["new_port"] is not None]
    rejoined = [f for f in parts.failovers if f.get("rejoined_as_replica")]
    passed = (
        len(parts.replaced) == planned_workers
        and not gone
        and len(promoted) == planned_masters
        and len(parts.failovers) == planned_masters
        and len(rejoined) == planned_rejoins
    )
    figures = {
        "workers_killed": len(parts.killed_pids),
        "workers_replaced": parts.replaced,
        "masters_killed": len(parts.killed_masters),
        "failovers": parts.failovers,
    }
    return Check(
        "crashes_applied",
        passed,
        figures,
        f"workers SIGKILLed and replaced {len(parts.replaced)}/{planned_workers}, "
        f"masters SIGKILLed and failed over {len(promoted)}/{planned_masters}, "
        f"back as replicas {len(rejoined)}/{planned_rejoins}",
    )


def is_error(rec: dict[str, Any]) -> bool:
    """What a client counts as a failure: not a complete stream, not the budget's own
    refusal (429) or cut-off (``*_exceeded``), not its own hang-up."""
    if rec["outcome"] in ("complete", "client_disconnect"):
        return False
    if rec["status"] == 429:
        return False
    code = rec["error_code"] or ""
    return not (rec["outcome"] == "cut_clean" and code.endswith("_exceeded"))


def failover_errors(
    parts: ChaosParts, records: list[dict[str, Any]], origin: float
) -> list[dict[str, Any]]:
    """Per master kill: client errors of requests in flight during its failover (from the
    SIGKILL until every node agrees on the new master), on its tenants and on the others;
    those also in flight at a processor's SIGKILL are left out (that kill cut them)."""
    out = []
    for index, at in parts.killed_masters:
        applied = next(
            (a for a in parts.applied if a.kind == "redis_kill" and a.started_s == at), None
        )
        end = (applied.ended_s if applied and applied.ended_s else at) - origin
        start = at - origin
        # A request in flight when a processor (or worker) was SIGKILLed is that kill's.
        kills = [k - origin for k in parts.killed_at]
        during = [
            r
            for r in records
            if r["start_s"] <= end
            and r["end_s"] >= start
            and not any(r["start_s"] <= k + 0.5 and r["end_s"] >= k for k in kills)
        ]
        victims = [r for r in during if parts.tenant_master.get(r["tenant"]) == index]
        healthy = [r for r in during if parts.tenant_master.get(r["tenant"]) != index]
        out.append(
            {
                "master": index,
                "failover_s": round(end - start, 3),
                "requests_of_its_tenants": len(victims),
                "errors_of_its_tenants": sum(map(is_error, victims)),
                "requests_of_healthy_masters": len(healthy),
                "errors_of_healthy_masters": sum(map(is_error, healthy)),
                "healthy_error_examples": [
                    {k: r[k] for k in ("request_id", "tenant", "status", "detail", "error_code")}
                    for r in healthy
                    if is_error(r)
                ][:5],
            }
        )
    return out


def check_healthy_masters(parts: ChaosParts, records: list[dict[str, Any]], origin: float) -> Check:
    """One master down stops only the tenants whose slots it serves: the tenants of the
    others see no error while it fails over."""
    rows = failover_errors(parts, records, origin)
    errors = sum(r["errors_of_healthy_masters"] for r in rows)
    asked = sum(r["requests_of_healthy_masters"] for r in rows)
    return Check(
        "healthy_masters_unaffected",
        errors == 0 and asked > 0,
        {"failovers": rows},
        f"errors on the healthy masters' tenants during the failover {errors} of {asked}; "
        f"on its own tenants {sum(r['errors_of_its_tenants'] for r in rows)} of "
        f"{sum(r['requests_of_its_tenants'] for r in rows)}",
    )


def crash_figures(
    w: Watcher, parts: ChaosParts, drain: dict[str, Any], origin: float
) -> dict[str, Any]:
    """Per worker SIGKILL: the records the dead worker held open at the kill (admitted, not
    settled by it), how many a peer settled (ledger reason ``orphaned``), how many stayed
    open, and the time from the kill to the last of those settlements (the ledger entry's
    id is its time, ms)."""
    entries: dict[str, tuple[str, dict[str, str]]] = {}
    for (_, entry_id), entry in w.ledger.items():
        entries[entry.get("request_id", "")] = (entry_id, entry)
    kills = []
    for pid, at in zip(parts.killed_pids, parts.killed_at, strict=True):
        mine = [r for r in w.records.values() if r.admitted and owner_pid(r.owner) == pid]
        held, orphaned, settle_s = [], 0, 0.0
        for r in mine:
            found = entries.get(_decoded(r.request_id))
            if found is None:
                if not r.settled:
                    held.append(r)
                continue
            entry_id, entry = found
            if entry.get("reason") == "orphaned":
                held.append(r)
                orphaned += 1
                settle_s = max(settle_s, int(entry_id.split("-")[0]) / 1000 - at)
        kills.append(
            {
                "pid": pid,
                "at_s": round(at - origin, 3),
                "records_of_the_dead": len(mine),
                "open_at_kill": len(held),
                "settled_by_peer": orphaned,
                "left_open": sum(1 for r in held if not r.settled),
                "kill_to_last_settlement_s": round(settle_s, 3),
            }
        )
    return {
        "worker_kills": kills,
        "open_at_load_end": drain["open_at_load_end"],
        "open_after_drain": drain["open_after_drain"],
        "drain_s": round(drain["drain_s"], 2),
        "settle_bound_s": drain["settle_bound_s"],
    }


def _decoded(request_id: str) -> str:
    from extproc.quota.keys import decode_name

    return decode_name(request_id)


def owner_pid(owner: str) -> int:
    """The pid in a processor id (``<host>-<pid>-<hex>``); 0: none."""
    found = re.search(r"-(\d+)-[0-9a-f]+$", owner)
    return int(found.group(1)) if found else 0


def processor_figures(metrics: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Summed over the processors alive at the end (a killed one's counts died with it)."""

    def total(name: str) -> int:
        return int(sum(m.get(name, 0.0) for m in metrics))

    reasons = ("completed", "cutoff", "disconnect", "upstream_error", "timeout", "shutdown")
    return {
        "processors": len(metrics),
        "admitted": total("extproc_requests_admitted_total"),
        "refused": total("extproc_requests_refused_total"),
        "cutoffs": total("extproc_cutoffs_total"),
        "orphan_settlements": total("extproc_orphan_settlements_total"),
        "malformed_events": total("extproc_malformed_events_total"),
        "local_admissions": total("extproc_local_admissions_total"),
        "admission_blocks": {
            r: total(f'extproc_admission_blocks_total{{result="{r}"}}')
            for r in ("taken", "refused", "failed", "returned", "overdrawn")
        },
        "settlements": {r: total(f'extproc_settlements_total{{reason="{r}"}}') for r in reasons},
    }


def write_all(
    out: Path,
    s: ChaosScenario,
    info: dict[str, Any],
    records: list[dict[str, Any]],
    checks: list[Check],
    faults: list[dict[str, Any]],
    windows: list[dict[str, Any]],
) -> dict[str, Any]:
    from loadlab.chaos_plots import write_chaos_plots

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "wb") as f:
        for rec in records:
            f.write(orjson.dumps(rec) + b"\n")
    passed = all(c.passed for c in checks)
    report = {
        "passed": passed,
        "failed": [c.name for c in checks if not c.passed],
        "checks": [c.to_doc() for c in checks],
    }
    (out / "integrity.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    outcomes = Counter(r["outcome"] for r in records)
    summary = {
        "scenario": s.to_doc(),
        "run": info,
        "requests": len(records),
        "outcomes": dict(sorted(outcomes.items())),
        "faults": faults,
        "windows": windows,
        "integrity": {"passed": passed, "failed": report["failed"]},
    }
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (out / "scenario.yaml").write_text(
        yaml.safe_dump({**s.to_doc(), "run": info}, sort_keys=False, allow_unicode=True)
    )
    write_chaos_plots(records, faults, windows, s.tpm, out / "plots")
    return report


def print_report(console: Console, summary: dict[str, Any], checks: list[Check]) -> None:
    classes = (*WELL_FORMED, *EXCUSED, MALFORMED)
    o = summary["outcomes"]
    print_table(
        console,
        "extproc chaos: requests by outcome",
        ["requests", *classes],
        [[str(summary["requests"]), *(str(o.get(k, 0)) for k in classes)]],
        keys=1,
    )
    console.print(
        f"well-formed: {', '.join(WELL_FORMED)}; explained by the scenario: "
        f"{', '.join(EXCUSED)}; {MALFORMED}: neither (fails well_formed_outcomes)."
    )
    faults = [
        f"{f['fault']} {f['at_s']:.1f}–{f['until_s']:.1f}s"
        if f["until_s"] is not None and f["until_s"] - f["at_s"] >= 0.1
        else f"{f['fault']} at {f['at_s']:.1f}s"
        for f in summary["faults"]
    ]
    console.print(escape(f"faults applied: {'; '.join(faults) or 'none'}"))
    it = Table(title="integrity: one row per invariant")
    it.add_column("invariant")
    it.add_column("result")
    it.add_column("figures")
    for c in checks:
        it.add_row(c.name, "[green]PASS[/]" if c.passed else "[red]FAIL[/]", escape(c.summary))
    console.print(it)


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    try:
        s = build(args)
    except ScenarioError as exc:
        print(f"extproc chaos: invalid scenario: {exc}", file=sys.stderr)
        return 2
    run = Run.begin("extproc chaos", args.out, f"chaos-{s.name}")
    out = run.out
    console = output_console()
    info = run.info()
    parts = ChaosParts(s, run.logs)

    def work(live: Live) -> dict[str, Any]:
        live.note(
            f"extproc chaos {s.name}: {s.processors} processors, {s.tenants} tenants at "
            f"{s.tpm} tokens per {s.window_s}s, {len(s.faults)} faults; load average "
            f"{os.getloadavg()[0]:.1f}; results in {out}"
        )
        parts.start()
        return asyncio.run(_run(s, parts, live, args.tamper))

    result = run.with_parts(parts, args.quiet, work)
    if result is None:
        return run.exit_code
    load: Load = result["load"]
    origin = load.origin
    faults = [a.to_doc(origin) for a in parts.applied]
    spans = [(f["at_s"], f["until_s"] if f["until_s"] is not None else f["at_s"]) for f in faults]
    records = sorted(load.records, key=lambda r: r["start_ns"])
    for rec in records:
        rec["outcome"] = classify(rec, spans, s)
    kills = list(parts.killed_at)
    checks = integrity(s, result, records, kills, parts, origin)
    w: Watcher = result["watcher"]
    windows = sorted(
        (
            {
                "tenant": x.tenant,
                "window_s": x.window_s,
                "start_s": round(x.start - origin, 3),
                "window_start": x.start,
                "charged": x.value,
                "final": x.final,
            }
            for x in w.windows.values()
        ),
        key=lambda d: (d["tenant"], d["window_start"]),
    )
    reasons = dict(sorted(Counter(e.get("reason", "") for e in w.ledger.values()).items()))
    finished = run.finished()
    info.update(
        wall_s=finished["wall_s"],
        drain_s=round(result["drain"]["drain_s"], 2),
        crash=crash_figures(w, parts, result["drain"], origin),
        failovers=failover_errors(parts, records, origin),
        redis_restarts=len(w.epochs) - 1,
        watcher_read_errors=w.read_errors,
        watcher_replica_reads=w.replica_reads,
        processor_metrics=processor_figures(result["metrics"]),
        ledger_reasons=reasons,
        admission_blocks=block_figures(w, result["final"]["live_owners"]),
        tamper=result["final"].get("tamper")
        and {k: v for k, v in result["final"].items() if k != "live_owners"},
        finished_load_average=finished["finished_load_average"],
    )
    report = write_all(out, s, info, records, checks, faults, windows)
    summary = orjson.loads((out / "summary.json").read_bytes())
    print_report(console, summary, checks)
    verdict = (
        "every invariant held" if report["passed"] else ("FAILED: " + ", ".join(report["failed"]))
    )
    console.print(f"integrity: {verdict}; results: {out} ({info['wall_s']:.0f}s)")
    return 0 if report["passed"] else 1
