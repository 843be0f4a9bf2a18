"""A chaos run against llm-d-inference-sim v0.10.2's behaviour (``--profile``): its pieces
("Today ", "4", ",") are not one o200k token each as llmsim's exact ones are, so what a
client received is counted in o200k tokens of its text, as the meter counts it, and every
invariant still holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.chaos_support import INVARIANTS, TINY_CHAOS, chaos
from tests.tools.conftest import write_scenario

pytestmark = pytest.mark.slow

# What the real simulator can inject itself: failures up front, no ext- chaos.
COMPAT_CHAOS = {
    **TINY_CHAOS,
    "name": "tiny-compat",
    "simulator": {"itl_ms": 5, "failure_injection_rate": 10},
}


def test_a_chaos_run_against_the_compat_profile_holds_every_invariant(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "compat.yaml", COMPAT_CHAOS)
    out = tmp_path / "results"
    done = chaos(scenario, "--profile", "llm-d-v0.10.2.yaml", "--out", out, "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "integrity.json").read_text())
    assert [c["name"] for c in report["checks"] if c["passed"]] == INVARIANTS
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"]["simulator"]["profile"] == "llm-d-v0.10.2.yaml"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert any(r["status"] == 200 and r["events"] for r in records)
    assert not any(r["outcome"] in ("malformed_upstream", "reset_by_upstream") for r in records)
