"""A tiny chaos run end to end: exit 0, every result file, plausible figures, plots."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.tools.chaos_support import INVARIANTS, TINY_CHAOS, chaos_run, load
from tests.tools.conftest import PNG_SIGNATURE

CLASSES = {
    "complete", "cut_clean", "error_status", "client_disconnect", "reset_by_fault",
    "reset_by_upstream", "malformed_upstream", "malformed",
}  # fmt: skip
RECORD_KEYS = {
    "request_id", "tenant", "index", "attempt", "start_s", "end_s", "start_ns", "status",
    "outcome", "detail", "prompt_tokens", "max_tokens", "output_tokens", "events",
    "error_code", "error_body", "bad_events", "client_closed", "retry_after_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return chaos_run(tmp_path_factory, "tiny", TINY_CHAOS)


def test_a_tiny_chaos_run_passes_every_invariant(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = load(out, "integrity.json")
    assert report["passed"] is True and report["failed"] == []
    assert [c["name"] for c in report["checks"]] == INVARIANTS
    assert all(c["passed"] for c in report["checks"])
    assert "every invariant held" in done.stdout
    for name in INVARIANTS:
        assert name in done.stdout  # the table, one row per invariant


def test_the_records_are_one_per_attempt_with_a_known_class(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert records
    assert all(set(r) == RECORD_KEYS for r in records)
    assert {r["outcome"] for r in records} <= CLASSES
    assert all(r["end_s"] >= r["start_s"] for r in records)
    assert all(0 <= r["output_tokens"] <= r["max_tokens"] for r in records)
    # Budgets that run out: some streams cut cleanly or refused with an OpenAI error body.
    assert any(r["outcome"] in ("cut_clean", "error_status") for r in records)
    summary = load(out, "summary.json")
    assert summary["requests"] == len(records)
    assert sum(summary["outcomes"].values()) == len(records)
    by_class = next(c for c in load(out, "integrity.json")["checks"]
                    if c["name"] == "well_formed_outcomes")["figures"]["by_class"]  # fmt: skip
    assert sum(by_class.values()) == len(records)


def test_a_malformed_event_ends_its_stream_cleanly_and_never_reaches_the_client(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    ended = [r for r in records if r["outcome"] == "malformed_upstream"]
    assert ended, "the simulator's malformed events (25% of streams) showed nowhere"
    assert all(r["error_code"] == "upstream_error" and r["status"] == 200 for r in ended)
    assert not any(r["bad_events"] for r in records)


def test_the_figures_add_up(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    checks = {c["name"]: c["figures"] for c in load(out, "integrity.json")["checks"]}
    once = checks["settled_exactly_once"]
    assert once["admitted"] > 0 and once["duplicates"] == 0
    # Every admitted request: settled once, left open (a SIGKILL's) or lost with Redis.
    assert once["admitted"] == once["settled_once"] + once["open"] + once["lost_with_redis_restart"]
    assert checks["no_open_reservations"]["open_left"] == once["open"]
    assert checks["tokens_within_budget"]["max_charged_over_budget"] <= 1.0
    assert checks["counters_equal_ledger"]["windows_checked"] > 0
    procs = checks["processor_resources"]["processors"]
    assert procs and all(p["before"]["fds"] > 0 and p["after"]["rss_kib"] > 0 for p in procs)
    summary = load(out, "summary.json")
    faults = summary["faults"]
    assert [f["fault"] for f in faults] == ["redis_pause", "processor_kill"]
    for fault, planned in zip(faults, (1.5, 3.5), strict=True):
        assert fault["at_s"] >= planned - 0.05  # applied when planned, never before
        assert fault["until_s"] >= fault["at_s"]
    assert summary["run"]["ledger_reasons"]
    assert summary["windows"] and all(w["charged"] <= 400 for w in summary["windows"])


def test_the_scenario_as_run_and_the_plots_are_written(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    doc = yaml.safe_load((out / "scenario.yaml").read_text())
    assert doc["name"] == "tiny" and doc["duration_s"] == 6
    assert [f["fault"] for f in doc["faults"]] == ["redis_pause", "processor_kill"]
    assert doc["run"]["machine"]["cpus"] >= 1
    for name in ("outcomes_over_time.png", "charged_per_window.png"):
        data = (out / "plots" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, name


def test_progress_tells_what_the_scenario_causes_from_what_fails(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The quiet progress line counts complete requests as ok and the scenario's own doing
    (cut-offs, refusals, injected errors, hang-ups, resets in a fault) as expected: an
    all-PASS run shows no failure count its report contradicts."""
    out, done = run
    summary = load(out, "summary.json")
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("chaos ") and "requests: " in x]
    found = re.search(r" requests?: (.*), [0-9.]+s$", line)
    assert found, line
    counts = {k: int(n) for k, n in (part.rsplit(" ", 1) for part in found.group(1).split(" · "))}
    assert counts["ok"] == summary["outcomes"].get("complete", 0)
    assert sum(counts.values()) == summary["requests"]
    assert counts["failed"] >= summary["outcomes"].get("malformed", 0)
    assert counts.get("expected", 0) > 0  # the tiny scenario injects failures
