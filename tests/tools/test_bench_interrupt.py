"""Every part the tool starts is stopped by PID when the run is interrupted: Ctrl-C (or
SIGTERM) mid-run or while the parts are still starting leaves no process behind."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tools.conftest import ROOT, TINY, alive, children, reap, write_scenario

# Long enough to be interrupted in its second phase: 2 s per route and level.
LONG = {**TINY, "load": {**TINY["load"], "levels": [1, 2], "duration_s": 2, "requests": None}}
# simulator, redis-server (the in-memory backend without one), no-op processor, processor,
# three Envoys
PARTS = 7 if shutil.which("redis-server") else 6


def start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "stderr.txt"
    scenario = write_scenario(tmp_path / "long.yaml", LONG)
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "extproc", "bench", str(scenario), "--quiet",
             "--out", str(tmp_path / "out")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    return proc, log


def watch_until(
    proc: subprocess.Popen[bytes], seen: set[int], ready: object, timeout_s: float = 120
) -> None:
    """Collect the tool's descendants until ``ready()`` (or the tool exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= children(proc.pid)
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError(f"not ready (exit status {proc.poll()})")


def finish(proc: subprocess.Popen[bytes], seen: set[int], sig: int) -> int:
    proc.send_signal(sig)
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= children(proc.pid)  # a part that was starting when the signal came
        time.sleep(0.02)
    return proc.wait(5)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_stops_every_part(sig: int, tmp_path: Path) -> None:
    proc, log = start(tmp_path)
    seen: set[int] = set()
    try:
        # The first phase has ended (its line is out): every part is up, streams are flowing.
        watch_until(proc, seen, lambda: "direct @ 1 streams:" in log.read_text())
        # Every part is up now; a short-lived helper process (git, say) may be up beside them.
        assert len(children(proc.pid)) >= PARTS, log.read_text()
        status = finish(proc, seen, sig)
    finally:
        reap(proc, seen)
    assert status == 130, log.read_text()
    assert "interrupted; every part stopped" in log.read_text()
    assert [pid for pid in seen if alive(pid)] == []


def test_ctrl_c_while_parts_start_stops_those_already_started(tmp_path: Path) -> None:
    proc, log = start(tmp_path)
    seen: set[int] = set()
    try:
        watch_until(proc, seen, lambda: len(seen) >= 2)  # the simulator and the first Envoy
        status = finish(proc, seen, signal.SIGINT)
    finally:
        reap(proc, seen)
    assert status == 130, log.read_text()
    assert len(seen) >= 2
    assert [pid for pid in seen if alive(pid)] == []


def test_a_part_that_fails_to_start_ends_the_run_with_exit_1_and_nothing_left(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "broken-profile.yaml"
    profile.write_text('model: "gpt-4.1"\nmode: sideways\n')  # llmsim refuses it at start
    scenario = write_scenario(
        tmp_path / "s.yaml", {**TINY, "simulator": {"profile": str(profile), "itl_ms": 5}}
    )
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "bench", str(scenario), "--quiet",
         "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "exited with 2: llmsim: configuration error: mode: invalid mode" in done.stderr
    assert f"(part logs in {tmp_path / 'out' / 'logs'})" in done.stderr
    # No process of this run is left: every one of them was given the profile's path.
    left = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(profile).encode() in cmdline:
            left.append(entry.name)
    assert left == []
