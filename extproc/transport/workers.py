"""Several processor processes for one Envoy, one per core, on consecutive ports.

One CPython process tops out at a few thousand ext_proc messages per second (grpc.aio's
own cost per message dominates), so a busy Envoy gets N workers and lists N endpoints in
its processor cluster; Envoy balances streams across them. Workers share nothing but
Redis, exactly like replicas behind different Envoys.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType


def _shift(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset}"


def worker_argv(argv: list[str], index: int, listen: str, metrics: str | None) -> list[str]:
    """The serve command line of worker ``index``: its own gRPC and metrics ports."""
    out = [sys.executable, "-m", "extproc", "serve", *argv, "--workers", "1"]
    out += ["--listen", _shift(listen, index)]
    if metrics:
        out += ["--metrics-listen", _shift(metrics, index)]
    return out


def supervise(argv: list[str], workers: int, listen: str, metrics: str | None) -> int:
    """Run the workers until they exit; SIGTERM/SIGINT are passed on so each drains."""
    children = [subprocess.Popen(worker_argv(argv, i, listen, metrics)) for i in range(workers)]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, key=abs)
