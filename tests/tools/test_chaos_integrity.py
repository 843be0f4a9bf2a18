"""The report fails when an invariant is broken: the chaos tool's test hook tampers with
Redis after the run, before the checks (a counter INCRBY'd, a ledger entry deleted), and
the run exits 1 naming the invariant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.chaos_support import TINY_CHAOS, chaos
from tests.tools.conftest import write_scenario

# No faults, no simulator failures: nothing but the tampering can break an invariant.
PLAIN = {
    **TINY_CHAOS,
    "duration_s": 3,
    "simulator": {"itl_ms": 5},
    "clients": {},
    "faults": [],
}


@pytest.mark.parametrize(
    ("tamper", "broken"),
    [
        ("counter", {"counters_equal_ledger", "tokens_within_budget"}),
        ("ledger", {"counters_equal_ledger", "settled_exactly_once"}),
    ],
)
def test_a_tampered_run_fails_naming_the_broken_invariant(
    tamper: str, broken: set[str], tmp_path: Path
) -> None:
    scenario = write_scenario(tmp_path / "plain.yaml", PLAIN)
    done = chaos(scenario, "--out", tmp_path / "out", "--quiet", "--tamper", tamper)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "integrity.json").read_text())
    assert report["passed"] is False
    assert set(report["failed"]) == broken
    assert "FAILED: " in done.stdout
    for name in broken:
        assert name in done.stdout.split("FAILED: ", 1)[1]
    checks = {c["name"]: c["figures"] for c in report["checks"]}
    assert checks["counters_equal_ledger"]["mismatches"] == 1
    if tamper == "ledger":
        assert checks["settled_exactly_once"]["settled_without_entry"] == 1
    else:
        assert checks["tokens_within_budget"]["windows_over_budget"] == 1


def test_the_same_run_untampered_passes(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "plain.yaml", PLAIN)
    done = chaos(scenario, "--out", tmp_path / "out", "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    once = _settled_once(tmp_path / "out")
    assert once["lost_admissions_charged"] == 0
    assert once["ledger_entries"] == once["settled_once"] == once["admitted"]


def test_an_entry_of_an_admission_never_seen_and_nothing_reserved_counts_as_a_lost_admission(
    tmp_path: Path,
) -> None:
    # What a failover that lost an admission's record leaves: the settlement's entry,
    # nothing reserved, no record ever read. The books count it, and nothing fails.
    scenario = write_scenario(tmp_path / "plain.yaml", PLAIN)
    done = chaos(scenario, "--out", tmp_path / "out", "--quiet", "--tamper", "lost_admission")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    once = _settled_once(tmp_path / "out")
    assert once["lost_admissions_charged"] == 1
    assert once["ledger_entries"] == once["settled_once"] + 1
    assert once["duplicates"] == once["settled_without_entry"] == 0
    assert "lost admissions charged 1" in done.stdout


def _settled_once(out: Path) -> dict[str, int]:
    report = json.loads((out / "integrity.json").read_text())
    return next(c["figures"] for c in report["checks"] if c["name"] == "settled_exactly_once")
