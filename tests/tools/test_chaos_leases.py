"""Admission leases under chaos: the books balance with blocks in play. ``extproc chaos``
as a process, two processors admitting from blocks of their tenants' budgets through a
Redis pause (local admissions go on; their records wait), a misbehaving simulator and
clients that hang up, and a processor SIGKILLed while it holds blocks. Every invariant
must hold, and each block the dead processor held must be settled by its peer as used
(charged in full, never free)."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.tools.chaos_support import INVARIANTS, TINY_CHAOS, chaos_run, load

pytestmark = pytest.mark.slow


def leases_scenario() -> dict[str, Any]:
    doc = copy.deepcopy(TINY_CHAOS)
    doc["name"] = "leases"
    # Far from the limits (a block is 5 % of one, worth ~200 requests, so none is spent
    # before the kill) in hour-long windows (none ends during the run).
    doc["processor"]["budget"] = {"tpm": 100_000, "window_s": 3600}
    doc["processor"]["admission_leases"] = {"fraction": 0.05, "idle_ms": 5000}
    # A heartbeat that outlives the Redis pause (1 s): no live processor is taken for dead,
    # so no admission finds its block settled by a peer (overdrawn, asserted 0 below).
    doc["processor"]["heartbeat_ttl_s"] = 4
    pause, kill = doc["faults"]
    assert pause["fault"] == "redis_pause" and kill["fault"] == "processor_kill"
    doc["faults"] = [pause, {**kill, "min_blocks": 1}]
    return doc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return chaos_run(tmp_path_factory, "leases", leases_scenario())


def test_every_invariant_holds_with_admission_blocks_in_play(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = load(out, "integrity.json")
    assert report["passed"] is True and report["failed"] == []
    assert [c["name"] for c in report["checks"]] == INVARIANTS
    figures = load(out, "summary.json")["run"]["processor_metrics"]
    # Blocks were taken and requests admitted from them, not only the usual way.
    assert figures["admission_blocks"]["taken"] >= 1
    assert figures["local_admissions"] >= 1
    assert figures["admission_blocks"]["overdrawn"] == 0


def test_the_blocks_a_killed_processor_held_are_charged_by_its_peer(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    s = load(out, "summary.json")
    [kill] = [f for f in s["faults"] if f["fault"] == "processor_kill"]
    held = int(kill["note"].split("holding ", 1)[1].split()[0])
    assert held >= 1, kill
    blocks = s["run"]["admission_blocks"]
    dead = blocks["of_dead_processors_settled_as"]
    # Each block it held at the kill is settled as used (orphaned), ledger entry and all;
    # any it gave back before were returned; none is left open or settled otherwise.
    assert dead.get("orphaned", 0) >= held
    assert set(dead) <= {"orphaned", "returned"}
    assert sum(dead.values()) == blocks["of_dead_processors"]
    # The survivor's blocks went back unused at its shutdown.
    assert set(blocks["settled_as"]) <= {"orphaned", "returned"}
    assert sum(blocks["settled_as"].values()) == blocks["seen"]
