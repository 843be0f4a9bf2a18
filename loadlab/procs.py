"""Free ports and child processes that are always stopped by PID."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, Self, TypeVar


class Stoppable(Protocol):
    def stop(self) -> object: ...


S = TypeVar("S", bound=Stoppable)


def free_port() -> int:
    """A port the kernel just handed out on loopback (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel just handed out on loopback: each socket is held
    until all are picked (two ``free_port`` calls in a row can return the same port)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(count: int, attempts: int = 200) -> int:
    """The first of ``count`` consecutive free loopback ports (for multi-worker processes).

    Drawn below the kernel's ephemeral range: a port there is never what another process's
    bind to port 0 (``free_port``) is handed between this check and the child's own bind
    (seen with parallel test workers: a worker's metrics port taken meanwhile)."""
    top = _ephemeral_low() - count
    for _ in range(attempts):
        first = random.randrange(20000, top) if top > 20000 else free_port()
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports found")


def child_pids_by_metrics_port(parent: int, first_metrics_port: int) -> dict[int, int]:
    """Worker index → pid of a supervisor's live workers, from /proc (the index from the
    metrics port on the worker's command line)."""
    out: dict[int, int] = {}
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return out
    for pid in map(int, children):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--metrics-listen" in argv:
            port = int(argv[argv.index("--metrics-listen") + 1].rpartition(":")[2])
            out[port - first_metrics_port] = pid
    return out


class ManagedProcess:
    """A child process in its own session, logged to a file, stopped by PID on ``stop``."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,  # Envoy dies with the launching job otherwise
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}"
                )
            if ready():
                return
            time.sleep(0.02)
        raise TimeoutError(
            f"{self.argv[0]} not ready after {timeout_s}s:\n{self.log_text()[-4000:]}"
        )

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


class StopsOnExit:
    """A part used in ``with``: stopped however the block ends."""

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StopStack(StopsOnExit):
    """What a run started, stopped newest first however the block ends (a part already gone
    is no error): ``redis = stops.push(RedisServer.start(...))``; ``stops.call(f)`` for a
    stop that isn't a part's."""

    def __init__(self) -> None:
        self._stops: list[Callable[[], object]] = []

    def push(self, part: S) -> S:
        self._stops.append(part.stop)
        return part

    def call(self, stop: Callable[[], object]) -> None:
        self._stops.append(stop)

    def stop(self) -> None:
        while self._stops:
            stop = self._stops.pop()
            with contextlib.suppress(OSError):  # already gone: nothing left to stop
                stop()
