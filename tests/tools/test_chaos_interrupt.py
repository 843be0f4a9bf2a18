"""Ctrl-C (or SIGTERM) mid-run stops every part by PID, a paused Redis included, and
leaves no process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tools.chaos_support import TINY_CHAOS
from tests.tools.conftest import ROOT, alive, children, reap, write_scenario

# Interrupted while Redis is paused (SIGSTOP) by a fault that has seconds to go.
LONG = {
    **TINY_CHAOS,
    "duration_s": 30,
    "faults": [{"at": "1s", "fault": "redis_pause", "for": "20s"}],
}
PARTS = 5  # redis-server, the simulator, two processors, Envoy


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_stops_every_part(sig: int, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "long.yaml", LONG)
    log = tmp_path / "stderr.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "extproc", "chaos", str(scenario), "--quiet",
             "--out", str(tmp_path / "out")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        # Until a part is stopped (SIGSTOP: Redis, paused by the fault for 20 s more).
        while not any(map(stopped, seen)) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            seen |= children(proc.pid)
            time.sleep(0.02)
        assert any(map(stopped, seen)), log.read_text()
        seen |= children(proc.pid)
        # Every part is up; a short-lived helper process (git, say) may be up beside them.
        assert len(children(proc.pid)) >= PARTS, log.read_text()
        proc.send_signal(sig)
        status = proc.wait(90)
    finally:
        reap(proc, seen)
    assert status == 130, log.read_text()
    assert "interrupted; every part stopped" in log.read_text()
    assert [pid for pid in seen if alive(pid)] == []
