"""The run harness ``extproc bench`` and ``extproc chaos`` share: a results folder, the parts
started inside a progress display and stopped by PID however the run ends (a part that
fails, Ctrl-C, SIGTERM), and a part's failure told in one line.

    run = Run.begin("extproc bench", args.out, scenario.name)
    parts = Parts(scenario, run.logs)
    result = run.with_parts(parts, args.quiet, lambda live: ...)
    if result is None:
        return run.exit_code
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from loadlab.procs import Stoppable
from loadlab.report import Live, machine_info

R = TypeVar("R")


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so every part is stopped on the way out. A
    KeyboardInterrupt because asyncio re-raises only that (and SystemExit) from its
    callbacks: an Exception raised inside a transport's write was logged and swallowed."""


def raise_on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def raise_on_sigint(signum: int, frame: object) -> None:
    # Not asyncio.run's own handler: that one cancels the main task, and a cancellation that
    # meets a finishing timeout or wait_for inside it can be lost, so the run went on to the
    # end and exited 0 (seen under load). Raised here, it ends the loop as SIGTERM does.
    raise KeyboardInterrupt()


def shield_stops() -> None:
    """While the parts are stopped, a second Ctrl-C or SIGTERM mustn't cut the stops short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def one_line(exc: BaseException) -> str:
    """An error in one line: a part's failure carries its log's tail, whose last line says
    why, so the first line and the last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


@dataclass
class Run:
    """One run of a tool: where its results go and what it says of the run."""

    tool: str  # "extproc bench": how its messages start
    out: Path
    stamp: str  # UTC, the results folder's default suffix
    started: float = field(default_factory=time.monotonic)
    exit_code: int = 0  # once ``with_parts`` returned None: 1 a part failed, 130 interrupted

    @classmethod
    def begin(cls, tool: str, out: Path | None, name: str) -> Run:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        run = cls(tool, out or Path("results") / f"{name}-{stamp}", stamp)
        run.out.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def info(self) -> dict[str, Any]:
        """What ``summary.json``'s ``run`` starts with."""
        return {"started_utc": self.stamp, "machine": machine_info()}

    def finished(self) -> dict[str, Any]:
        """… and ends with."""
        return {
            "finished_load_average": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - self.started, 1),
        }

    def with_parts(self, parts: Stoppable, quiet: bool, work: Callable[[Live], R]) -> R | None:
        """``work(live)`` (it starts the parts and runs the load), SIGTERM turned into an
        interrupt; the parts stopped by PID whatever happens. None when it did not finish:
        ``exit_code`` says why and the reason is printed."""
        previous = signal.signal(signal.SIGTERM, raise_on_sigterm)
        signal.signal(signal.SIGINT, raise_on_sigint)
        try:
            with Live(quiet) as live:
                return work(live)
        except (KeyboardInterrupt, Terminated):
            shield_stops()
            parts.stop()
            print(f"{self.tool}: interrupted; every part stopped", file=sys.stderr)
            self.exit_code = 130
        except (RuntimeError, TimeoutError, OSError) as exc:
            shield_stops()
            parts.stop()
            print(f"{self.tool}: {one_line(exc)}", file=sys.stderr)
            print(f"  (part logs in {self.logs})", file=sys.stderr)
            self.exit_code = 1
        finally:
            shield_stops()
            parts.stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
        return None
