"""Running ``extproc chaos`` as a subprocess, as a user (or CI) would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tools.conftest import ROOT, write_scenario

# Seconds, not minutes: 6 s of load at 8 req/s on budgets that run out, the simulator
# failing, cutting streams and sending malformed events, clients hanging up, a Redis pause
# and a processor SIGKILL.
TINY_CHAOS: dict[str, Any] = {
    "name": "tiny",
    "duration_s": 6,
    "simulator": {
        "itl_ms": 5,
        "failure_injection_rate": 10,
        "disconnect_rate": 10,
        "malformed_rate": 25,
    },
    "processor": {
        "count": 2,
        "budget": {"tpm": 400, "window_s": 2},
        "heartbeat_ttl_s": 1,
        "orphan_sweep_s": 0.5,
    },
    "load": {
        "rate": 8,
        "prompt_tokens": 10,
        "output_tokens": {"dist": "uniform", "min": 20, "max": 60},
    },
    "clients": {"disconnect_rate": 10, "retries": 1, "backoff_s": "100ms"},
    "faults": [
        {"at": "1.5s", "fault": "redis_pause", "for": "1s"},
        {"at": "3.5s", "fault": "processor_kill", "processor": 1},
    ],
}
INVARIANTS = [
    "tokens_within_budget",
    "settled_exactly_once",
    "no_open_reservations",
    "counters_equal_ledger",
    "well_formed_outcomes",
    "processor_resources",
]


def chaos(*args: str | Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "chaos", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def chaos_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, doc: dict[str, Any], timeout_s: float = 240
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A module's one ``extproc chaos --quiet`` run of ``doc``: its results folder, and the
    process."""
    base = tmp_path_factory.mktemp(name)
    out = base / "results"
    scenario = write_scenario(base / f"{name}.yaml", doc)
    return out, chaos(scenario, "--out", out, "--quiet", timeout_s=timeout_s)


def load(out: Path, name: str) -> Any:
    """A JSON file of a results folder."""
    return json.loads((out / name).read_text())
