"""How gRPC's own threads are scheduled: ``SCHED_BATCH`` where they share one CPU (Linux).

grpc.aio hands each completion to the event loop from a poller thread of its own, and its
event-engine threads do the sockets' I/O. As ordinary (``SCHED_OTHER``) threads on the one
CPU the loop runs on, each of their wake-ups preempts the loop in the middle of a message:
measured 5-9 context switches per body message. As ``SCHED_BATCH`` threads they do not
preempt on waking, so the loop finishes what it is doing and then takes every completion
that is ready in one turn: ~0.5 context switches per message and 1.2-1.5x the body messages
per CPU-second (docs/results.md). Their priority is unchanged (the same nice value:
``SCHED_BATCH`` only gives up wake-up preemption), and the loop's own thread stays ordinary.

With more than one CPU a waking gRPC thread usually finds another core idle, and there
``SCHED_BATCH`` only makes it wait behind whatever runs: TTFT at 10 streams was worse in 8
of 9 measured pairs. So ``auto`` (the default) takes ``batch`` when the process may run on
one CPU only (a pinned sidecar, a one-CPU cpuset) and ``normal`` otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import grpc
import structlog

GRPC_THREADS: Final = ("auto", "batch", "normal")
DEFAULT_GRPC_THREADS: Final = "auto"
# Shared by the billing and the no-op processor, so benchmarks compare like for like.
GRPC_SERVER_OPTIONS: Final = (
    ("grpc.max_concurrent_streams", 10000),
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
)

log = structlog.get_logger("extproc.sched")


def resolved(policy: str) -> str:
    """``batch`` or ``normal``: what ``policy`` (one of ``GRPC_THREADS``) means here."""
    if policy not in GRPC_THREADS:
        raise ValueError(f"unknown thread policy {policy!r} (one of {', '.join(GRPC_THREADS)})")
    if policy != "auto":
        return policy
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    return "batch" if len(cpus) == 1 else "normal"


@contextmanager
def threads_started_as(policy: str) -> Iterator[None]:
    """Threads started inside the block run under ``policy`` (one of ``GRPC_THREADS``); the
    calling thread keeps its own. A thread inherits its creator's policy: the calling thread
    takes ``policy`` for the block's length. Threads those threads start inherit it too (the
    event engine grows its pool from its own threads)."""
    if resolved(policy) == "normal" or not hasattr(os, "SCHED_BATCH"):
        yield
        return
    try:
        own = os.sched_getscheduler(0)
        own_param = os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:  # refused (a seccomp profile, say): ordinary threads, said once
        log.warning("thread_policy_refused", policy=policy, error=str(exc))
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, own, own_param)


def grpc_server(policy: str, *options: tuple[str, int]) -> grpc.aio.Server:
    """A grpc.aio server with ``GRPC_SERVER_OPTIONS`` and ``options``, its threads under
    ``policy``. The first server of a process starts gRPC's threads (poller, event engine),
    so make it here."""
    with threads_started_as(policy):
        return grpc.aio.server(options=[*GRPC_SERVER_OPTIONS, *options])
