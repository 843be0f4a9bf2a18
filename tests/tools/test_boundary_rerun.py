"""The suite's guard against a test's run crossing the end of a budget window, and its rerun
of one that crossed it and failed (``tests.support.boundary``), each tried on a pytest run
of its own with windows of a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INNER = """
import time
from pathlib import Path

RUNS = Path(__file__).with_name("runs.txt")


def _ran(name: str, tmp_path: Path) -> int:
    with RUNS.open("a") as f:
        f.write(f"{name} {tmp_path}\\n")
    return sum(1 for line in RUNS.read_text().splitlines() if line.startswith(name + " "))


def test_fails_once_across_a_boundary(tmp_path: Path) -> None:
    if _ran("once", tmp_path) == 1:
        time.sleep(1.05)  # past at least one boundary of a 1 s window
        raise AssertionError("the first run")


def test_fails_every_time_across_a_boundary(tmp_path: Path) -> None:
    _ran("always", tmp_path)
    time.sleep(1.05)
    raise AssertionError("every run")
"""


GUARDED = """
import time
from pathlib import Path

RUNS = Path(__file__).with_name("runs.txt")


def test_ends_close_to_a_window_end() -> None:
    now = time.time()
    time.sleep(4 - now % 4 - 1.5 if now % 4 < 2.5 else 4 - now % 4 + 2.5)  # 1.5 s before one
    RUNS.write_text(f"ended {time.time()}\\n")


def test_next() -> None:
    with RUNS.open("a") as f:
        f.write(f"started {time.time()}\\n")
"""


def run_inner(
    tmp_path: Path, window_s: int, *workers: str, guard_s: float = 0.0, text: str = INNER
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The inner tests under the hook; ``workers`` as pytest's arguments (xdist's ``-n 2``,
    as the suite runs), none for one process. ``guard_s``: the hook's ``GUARD_S``."""
    (tmp_path / "conftest.py").write_text(
        "import tests.support.boundary as boundary\n\n"
        f"boundary.WINDOW_S = {window_s}\nboundary.GUARD_S = {guard_s}\n"
        "boundary.MARGIN_S = 0.05\n"
    )
    (tmp_path / "test_inner.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.support.boundary",
         "-p", "no:cacheprovider", *(workers or ("-p", "no:xdist")), "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, (tmp_path / "runs.txt").read_text().splitlines()


def test_a_failure_across_a_window_boundary_runs_once_more_and_its_second_run_stands(
    tmp_path: Path,
) -> None:
    done, runs = run_inner(tmp_path, 1, "-n", "2")
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    once = [line.split()[1] for line in runs if line.startswith("once ")]
    always = [line for line in runs if line.startswith("always ")]
    assert len(once) == 2 and once[0] != once[1]  # fresh fixtures for the second run
    assert len(always) == 2  # failed again: reported as a failure, not run a third time
    assert "the first run crossed a 1 s window boundary and failed (call): run again" in (
        done.stdout
    )


def test_a_failure_within_one_window_is_not_run_again(tmp_path: Path) -> None:
    done, runs = run_inner(tmp_path, 10**9)  # the next boundary in 2033
    assert "2 failed" in done.stdout, done.stdout + done.stderr
    assert [line.split()[0] for line in runs] == ["once", "always"]
    assert "window boundary" not in done.stdout


def test_a_test_does_not_start_close_to_a_window_end_it_waits_for_the_next_window(
    tmp_path: Path,
) -> None:
    # Windows of 4 s, a guard of 2 s: the first test ends 1.5 s before a window's end, so the
    # second waits until just after it.
    done, runs = run_inner(tmp_path, 4, guard_s=2.0, text=GUARDED)
    assert "2 passed" in done.stdout, done.stdout + done.stderr
    ended, started = (float(line.split()[1]) for line in runs)
    assert int(ended // 4) != int(started // 4)  # a window ended between the two
    assert 0.05 <= started % 4 < 2.0  # the second began early in the next window
    assert "waited " in done.stdout and "s for the next 4 s window to begin" in done.stdout
