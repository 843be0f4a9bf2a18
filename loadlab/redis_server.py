"""A throwaway redis-server on a free loopback port, stopped by PID.

Persistence is off (``--save "" --appendonly no``) so a test never writes a dump into the
checkout and starts from an empty server. ``password`` turns on ``requirepass`` for AUTH
tests; ``tls`` serves TLS only, with a throwaway CA made by the ``openssl`` CLI.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from loadlab.procs import ManagedProcess, StopsOnExit, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost: (ca.crt, server.crt, server.key)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca_crt),
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca_crt),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(ext),
        "-out",
        str(crt),
    )
    return ca_crt, crt, key


class RedisServer(StopsOnExit):
    """One redis-server child process; use ``RedisServer.start(tmp_path)`` or ``with``."""

    def __init__(
        self, process: ManagedProcess, port: int, password: str | None, ca_path: Path | None
    ) -> None:
        self.process = process
        self.port = port
        self.password = password
        self.ca_path = ca_path  # set when serving TLS

    @classmethod
    def start(
        cls,
        directory: Path,
        password: str | None = None,
        tls: bool = False,
        port: int | None = None,
    ) -> RedisServer:
        """``port`` restarts a server where a stopped one was (outage tests); default: free."""
        directory.mkdir(parents=True, exist_ok=True)
        port = port if port is not None else free_port()
        argv = [
            REDIS_SERVER,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--databases",
            "16",
        ]
        ca_path: Path | None = None
        if tls:
            ca_path, crt, key = make_tls_files(directory / "tls")
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cert-file",
                str(crt),
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(ca_path),
                "--tls-auth-clients",
                "no",
            ]
        else:
            argv += ["--port", str(port)]
        if password is not None:
            argv += ["--requirepass", password]
        process = ManagedProcess(argv, directory / f"redis-{port}.log")
        server = cls(process, port, password, ca_path)
        try:
            process.wait_ready(lambda: accepts_connections(port), timeout_s=15.0)
        except BaseException:
            process.stop()
            raise
        return server

    @property
    def url(self) -> str:
        """URL without credentials (pass ``password`` separately or use ``auth_url``)."""
        scheme = "rediss" if self.ca_path is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def auth_url(self) -> str:
        scheme = "rediss" if self.ca_path is not None else "redis"
        credentials = f"default:{self.password}@" if self.password is not None else ""
        return f"{scheme}://{credentials}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> int:
        return self.process.stop()
