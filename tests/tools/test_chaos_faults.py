"""Every fault on the timeline is applied by PID and recorded, the run still passes its
integrity report: Redis SIGKILLed (restarted empty) and restarted, a processor SIGTERMed
and restarted on its port, Envoy restarted on its ports."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tools.chaos_support import TINY_CHAOS, chaos
from tests.tools.conftest import write_scenario

FAULTS = {
    **TINY_CHAOS,
    "duration_s": 12,
    "simulator": {"itl_ms": 5},
    "clients": {"retries": 3, "backoff_s": "200ms"},
    "faults": [
        {"at": "1s", "fault": "redis_kill", "for": "0.5s"},
        {"at": "3s", "fault": "processor_term", "processor": 0, "for": "0.5s"},
        {"at": "5.5s", "fault": "envoy_restart", "for": "0.5s"},
        {"at": "10s", "fault": "redis_restart"},
    ],
}


def test_redis_processor_and_envoy_faults_are_applied_and_the_report_holds(
    tmp_path: Path,
) -> None:
    scenario = write_scenario(tmp_path / "faults.yaml", FAULTS)
    out = tmp_path / "out"
    done = chaos(scenario, "--out", out, "--quiet")
    report = json.loads((out / "integrity.json").read_text())
    assert done.returncode == 0, json.dumps(report["checks"], indent=1) + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    applied = summary["faults"]
    assert [f["fault"] for f in applied] == [
        "redis_kill", "processor_term", "envoy_restart", "redis_restart",
    ]  # fmt: skip
    for fault in applied:
        assert fault["note"].startswith(("restarted empty as pid", "restarted as pid")), fault
        old_pid = int(fault["target"].rsplit(" ", 1)[1])
        new_pid = int(fault["note"].rsplit(" ", 1)[1])
        assert new_pid != old_pid
    # Two Redis restarts seen by the watcher: each came back empty (a new run_id).
    assert summary["run"]["redis_restarts"] == 2
    checks = {c["name"]: c["figures"] for c in report["checks"]}
    assert checks["settled_exactly_once"]["duplicates"] == 0
