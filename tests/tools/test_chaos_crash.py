"""The books balance after a crash (issue 21): ``extproc chaos`` on benchmarks/chaos/crash.yaml,
shortened, as a process. 2 processors of ``serve --workers 2`` on a real 3-master Redis
Cluster with a replica each; a worker SIGKILLed under load once it holds open streams (its
supervisor replaces it, a live peer settles its records from Redis), then a master
SIGKILLed (its replica takes over) and started again empty (it rejoins as that replica's
replica), then the node that took over is SIGKILLed too (the rejoined one takes the slots
back). Writes a master acknowledged and its replica never had are lost at each failover:
settlements, cancels and block returns are sent again by their owners' sweeps, admissions
charged at their settlement. The integrity report must
show counters == ledger in every window, one ledger entry per admitted request, 0 open
records after the drain, the kills as they happened, and no error on the tenants of the
healthy masters meanwhile.

Every assertion is on what the run recorded (events, counts, pids), none on a duration:
the kill waits for its streams (``min_open``), the drain for the records (polled, with a
deadline derived from ``heartbeat_ttl_s`` and ``orphan_sweep_s``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tools.chaos_support import INVARIANTS, chaos_run, load
from tests.tools.conftest import ROOT

pytestmark = pytest.mark.slow

CRASH = ROOT / "benchmarks" / "chaos" / "crash.yaml"
SHORT_S = 24  # of load; the file's 30 s, its faults moved to fit
WORKER_KILL_AT, MASTER_KILL_AT, SUCCESSOR_KILL_AT = "4s", "9s", "14s"


def short_crash() -> dict[str, Any]:
    doc = yaml.safe_load(CRASH.read_text())
    doc["duration_s"] = SHORT_S
    worker, master = doc["faults"]
    assert worker["fault"] == "processor_kill" and "worker" in worker
    assert master["fault"] == "redis_kill" and "master" in master and "for" in master
    # The second kill waits for the first one's rejoin (loadlab.faults), then hits the
    # node serving master 1's slots: the first one's replica.
    doc["faults"] = [
        {**worker, "at": WORKER_KILL_AT},
        {**master, "at": MASTER_KILL_AT, "for": "2s"},
        {"fault": "redis_kill", "master": master["master"], "at": SUCCESSOR_KILL_AT},
    ]
    return doc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return chaos_run(tmp_path_factory, "crash", short_crash(), timeout_s=600)


def checks_of(out: Path) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in load(out, "integrity.json")["checks"]}


def test_the_crash_run_passes_every_invariant_crash_checks_included(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = load(out, "integrity.json")
    assert report["passed"] is True and report["failed"] == []
    names = [c["name"] for c in report["checks"]]
    assert names == [*INVARIANTS, "crashes_applied", "healthy_masters_unaffected"]


def test_counters_equal_the_ledger_in_every_window_none_excused(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    figures = checks_of(out)["counters_equal_ledger"]["figures"]
    windows = load(out, "summary.json")["windows"]
    # 6 tenants, over the whole run: every window seen was compared, and equal.
    assert figures["windows_checked"] == len(windows) > 0
    assert figures["mismatches"] == 0
    assert figures["excused_by_faults"] == 0 and figures["unverified"] == 0
    assert len({w["tenant"] for w in windows}) == 6  # 2 per master


def test_one_ledger_entry_per_admitted_request_and_no_record_left_open(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    checks = checks_of(out)
    once = checks["settled_exactly_once"]["figures"]
    assert once["admitted"] > 0
    assert once["admitted"] == once["settled_once"]
    # Beside those, an admission a failover lost is charged at its settlement, entry and all.
    assert once["ledger_entries"] == once["settled_once"] + once["lost_admissions_charged"]
    assert once["duplicates"] == once["settled_without_entry"] == once["open"] == 0
    assert once["lost_with_redis_restart"] == 0
    opened = checks["no_open_reservations"]["figures"]
    assert opened["open_left"] == 0 and opened["allowed"] == 0
    crash = load(out, "summary.json")["run"]["crash"]
    assert crash["open_after_drain"] == 0


def test_the_worker_was_killed_with_open_streams_replaced_and_its_records_settled_by_a_peer(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    summary = load(out, "summary.json")
    kill = next(f for f in summary["faults"] if f["fault"] == "processor_kill")
    assert kill["target"].startswith("processor 0 worker 0 pid ")
    [replaced] = checks_of(out)["crashes_applied"]["figures"]["workers_replaced"]
    assert kill["target"].endswith(f"pid {replaced['killed_pid']}")
    assert replaced["new_pid"] not in (0, replaced["killed_pid"])
    assert not os.path.exists(f"/proc/{replaced['killed_pid']}")
    [dead] = summary["run"]["crash"]["worker_kills"]
    assert dead["pid"] == replaced["killed_pid"]
    # It held streams at the kill (min_open: 3); a peer settled every one, billed orphaned.
    assert dead["open_at_kill"] >= 1
    assert dead["settled_by_peer"] == dead["open_at_kill"] and dead["left_open"] == 0
    assert summary["run"]["ledger_reasons"].get("orphaned", 0) >= dead["settled_by_peer"]


def test_the_master_was_killed_failed_over_came_back_as_a_replica_and_took_over_again(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    summary = load(out, "summary.json")
    first, second = [f for f in summary["faults"] if f["fault"] == "redis_kill"]
    for kill in (first, second):
        assert kill["target"].startswith("master 1 port ")
        assert kill["until_s"] is not None and kill["until_s"] >= kill["at_s"]
    failover, back = checks_of(out)["crashes_applied"]["figures"]["failovers"]
    assert failover["master"] == back["master"] == 1
    assert failover["new_port"] is not None and failover["new_port"] != failover["old_port"]
    assert failover["rejoined_as_replica"] is True
    assert f"port {failover['old_port']} back 2s later as its replica" in first["note"]
    # The successor killed in turn: the rejoined node, once empty, serves the slots again.
    assert (back["old_port"], back["new_port"]) == (failover["new_port"], failover["old_port"])


def test_the_other_masters_tenants_saw_no_error_during_either_failover(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    healthy = checks_of(out)["healthy_masters_unaffected"]
    assert healthy["passed"]
    rows = healthy["figures"]["failovers"]
    assert len(rows) == 2
    for row in rows:
        assert row["requests_of_healthy_masters"] > 0
        assert row["errors_of_healthy_masters"] == 0
