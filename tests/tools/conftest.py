"""Running ``extproc bench`` as a subprocess, as a user would, and reading what it leaves."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Seconds, not minutes: every route, two levels, short answers.
TINY: dict[str, Any] = {
    "name": "tiny",
    "simulator": {"profile": "fast.yaml", "itl_ms": 5},
    "routes": ["direct", "envoy", "noop", "processor"],
    "load": {
        "mode": "closed",
        "levels": [1, 3],
        "requests": 3,
        "rounds": 1,
        "prompt_tokens": 10,
        "output_tokens": 12,
        "warmup_requests": 1,
    },
}


def write_scenario(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def bench(*args: str | Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "bench", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc: parent PIDs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def tiny_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    base = tmp_path_factory.mktemp("tiny")
    scenario = write_scenario(base / "tiny.yaml", TINY)
    out = base / "results"
    return out, bench(scenario, "--out", out, "--quiet")


def reap(proc: subprocess.Popen[bytes], seen: set[int]) -> None:
    """A test that failed half-way still leaves nothing: the tool is asked to stop, then
    killed, and so is every part of it still alive."""
    if proc.poll() is None:
        seen |= children(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in seen:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
