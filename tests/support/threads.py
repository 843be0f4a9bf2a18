"""The threads of a running process and their scheduling policies, as the kernel has them."""

from __future__ import annotations

import os
from pathlib import Path

GRPC_THREAD_NAMES = ("event_engine", "grpc_global_tim", "lifeguard")


def thread_policies(pid: int) -> dict[int, tuple[str, int]]:
    """Thread id → (name, scheduling policy) of every thread of process ``pid``."""
    found = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        tid = int(entry)
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            found[tid] = (name, os.sched_getscheduler(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return found


def grpc_thread_policies(pid: int) -> set[int]:
    """The policies of gRPC's own named threads in process ``pid`` (empty: none found)."""
    return {p for name, p in thread_policies(pid).values() if name in GRPC_THREAD_NAMES}
