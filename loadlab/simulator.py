"""Start an llmsim process: a free port, wait for /health, stop by PID.

    with running_simulator("fast.yaml", "--max-num-seqs", "4", log_dir=tmp_path) as sim:
        client = openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="x")

A bare name resolves inside ``simulator_profiles/``; any other path is used as given.
"""

from __future__ import annotations

import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from loadlab.procs import ManagedProcess, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = REPO_ROOT / "simulator_profiles"


def profile_path(profile: str | Path) -> Path:
    path = Path(profile)
    if not path.is_absolute() and not path.exists():
        path = PROFILES_DIR / path
    if not path.is_file():
        raise FileNotFoundError(f"simulator profile not found: {profile}")
    return path


class Simulator:
    """A running ``python -m llmsim`` child process listening on 127.0.0.1."""

    def __init__(
        self,
        profile: str | Path,
        *extra_args: str,
        port: int | None = None,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.profile = profile_path(profile)
        self.port = port if port is not None else free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="llmsim-"))
        argv: Sequence[str] = [
            sys.executable,
            "-m",
            "llmsim",
            "--config",
            str(self.profile),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra_args,
        ]
        self.process = ManagedProcess(
            argv, log_dir / f"llmsim-{self.port}.log", env=env, cwd=REPO_ROOT
        )
        try:
            self.process.wait_ready(self._healthy, timeout_s=ready_timeout_s)
        except BaseException:
            self.process.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=0.5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        return self.process.log_text()

    def stop(self) -> int:
        return self.process.stop()


@contextmanager
def running_simulator(
    profile: str | Path,
    *extra_args: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Simulator]:
    """A simulator for the ``with`` block, stopped (by PID) however the block ends."""
    sim = Simulator(profile, *extra_args, log_dir=log_dir, env=env)
    try:
        yield sim
    finally:
        sim.stop()
