"""``extproc serve`` with an address it can't listen on: one line on stderr naming the flag,
the address and why, a non-zero exit, before anything starts (run as a process, the port
held by the test)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.tools.conftest import ROOT

CONFIG = ROOT / "examples" / "first-tenant.yaml"


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port another program listens on (no SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(CONFIG), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_metrics_port_in_use_is_one_line(taken: int) -> None:
    done = serve("--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{taken}")
    assert one_line(done) == (
        f"extproc: --metrics-listen 127.0.0.1:{taken}: cannot listen: address already in use"
    )


def test_a_grpc_port_in_use_says_in_use(taken: int) -> None:
    done = serve("--listen", f"127.0.0.1:{taken}")
    assert one_line(done) == (
        f"extproc: --listen 127.0.0.1:{taken}: cannot listen: address already in use"
    )


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--listen", "nonsense", "is not host:port (e.g. 127.0.0.1:50051, [::]:50051)"),
        ("--listen", "127.0.0.1:", "is not host:port (e.g. 127.0.0.1:50051, [::]:50051)"),
        ("--listen", "127.0.0.1:70000", "port 70000 is above 65535"),
        ("--listen", "no-such-host.invalid:50051", "cannot resolve 'no-such-host.invalid'"),
        ("--metrics-listen", "9464", "is not host:port (e.g. 127.0.0.1:50051, [::]:50051)"),
        ("--listen", "192.0.2.1:50051", "cannot listen: Cannot assign requested address"),
    ],
)
def test_an_address_that_cannot_be_listened_on_is_one_line(flag: str, value: str, why: str) -> None:
    extra = ["--listen", "127.0.0.1:0"] if flag != "--listen" else []
    line = one_line(serve(*extra, flag, value))
    assert line.startswith(f"extproc: {flag} ") and why in line, line


def test_the_configs_own_listen_is_named_as_such(tmp_path, taken: int) -> None:
    config = tmp_path / "quota.yaml"
    config.write_text(CONFIG.read_text() + f"listen: 127.0.0.1:{taken}\n")
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert one_line(done) == (
        f"extproc: listen (in {config}) 127.0.0.1:{taken}: cannot listen: address already in use"
    )
