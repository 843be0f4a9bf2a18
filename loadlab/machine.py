"""The machine a run measures on, from /proc: a process's CPU time and memory, how busy the
cores were, and pinning a process to cores (``taskset`` for a child, affinity for this one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """``argv`` under ``taskset -c cpus`` when asked for and available, else unchanged."""
    taskset = shutil.which("taskset")
    if cpus is None or taskset is None:
        return argv
    return [taskset, "-c", cpus, *argv]


def pin_self(cpus: str | None) -> None:
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Context switches of a process so far, voluntary and not, summed over its live threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                total += int(line.split()[1])
    return total


def status_kib(pid: int, field: str = "VmRSS", default: int | None = None) -> int:
    """A memory figure of ``/proc/PID/status`` in KiB: VmRSS (resident now), VmHWM (peak).
    A process without it (a zombie) gives ``default``, or raises when there is none."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    if default is None:
        raise RuntimeError(f"no {field} for pid {pid}")
    return default


def busy_jiffies() -> tuple[int, int]:
    """Clock ticks every core spent busy so far (all processes, steal included) and in all;
    (0, 0) where /proc/stat can't be read."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return 0, 0
    idle = values[3] + values[4]  # idle + iowait; guest time is already in user
    return sum(values) - idle, sum(values)
