"""A bad chaos scenario or flag: exit 2, one line naming the key, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadlab.chaos import main
from loadlab.chaos_scenario import load_chaos
from tests.tools.chaos_support import TINY_CHAOS, chaos
from tests.tools.conftest import ROOT, write_scenario


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"faults": [{"at": "1s", "fault": "redis_explode"}]}, "faults[0].fault"),
        ({"faults": [{"at": "9s", "fault": "redis_kill"}]}, "faults[0].at"),
        ({"faults": [{"at": "soon", "fault": "redis_kill"}]}, "faults[0].at"),
        ({"faults": [{"at": "1s", "fault": "redis_pause"}]}, "faults[0].for"),
        ({"faults": [{"at": "1s", "fault": "processor_kill", "processor": 2}]},
         "faults[0].processor"),
        ({"simulator": {"failure_types": ["meteor"]}}, "simulator.failure_types"),
        ({"simulator": {"disconnect_rate": 150}}, "simulator.disconnect_rate"),
        ({"processor": {"count": 1}, "faults": [{"at": "1s", "fault": "processor_kill"}]},
         "processor.count"),
        ({"clients": {"retries": -1}}, "clients.retries"),
        ({"simulator": {"profile": "llm-d-v0.10.2.yaml", "malformed_rate": 5}},
         "simulator.malformed_rate"),  # the real simulator has no such chaos
        ({"simulator": {"profile": "no-such-profile.yaml"}}, "simulator.profile"),
        ({"load": {"rats": 3}}, "load.rats"),
        # A cluster and workers (benchmarks/chaos/crash.yaml)
        ({"redis": {"mode": "sharded"}}, "redis.mode"),
        ({"redis": {"masters": 3}}, "redis.masters"),  # without mode: cluster
        ({"redis": {"mode": "cluster", "masters": 2}}, "redis.masters"),
        ({"redis": {"mode": "cluster", "replicas": 2}}, "redis.replicas"),
        ({"redis": {"mode": "cluster"}, "faults": []}, "processor.tenants"),  # 2 for 3 masters
        ({"faults": [{"at": "1s", "fault": "redis_kill", "master": 0}]}, "faults[0].master"),
        ({"redis": {"mode": "cluster"}, "processor": {"tenants": 3},
          "faults": [{"at": "1s", "fault": "redis_pause", "for": "1s"}]}, "faults[0].fault"),
        ({"redis": {"mode": "cluster"}, "processor": {"tenants": 3},
          "faults": [{"at": "1s", "fault": "redis_kill", "master": 3}]}, "faults[0].master"),
        ({"processor": {"workers": 0}}, "processor.workers"),
        ({"processor": {"workers": 2}, "faults": [{"at": "1s", "fault": "processor_kill"}]},
         "faults[0].worker"),
        ({"processor": {"workers": 2},
          "faults": [{"at": "1s", "fault": "processor_kill", "worker": 2}]}, "faults[0].worker"),
        ({"processor": {"workers": 2},
          "faults": [{"at": "1s", "fault": "processor_term", "worker": 0}]}, "faults[0].worker"),
        ({"faults": [{"at": "1s", "fault": "processor_kill", "min_open": 2}]},
         "faults[0].min_open"),
        ({"faults": [{"at": "1s", "fault": "processor_kill", "min_blocks": 1}]},
         "faults[0].min_blocks"),
        ({"faults": [{"at": "1s", "fault": "redis_pause", "for": "1s", "min_blocks": 1}]},
         "faults[0].min_blocks"),
        ({"processor": {"admission_leases": {"fraction": 0.5}}},
         "processor.admission_leases.fraction"),
    ],
)  # fmt: skip
def test_a_bad_scenario_exits_2_naming_the_key(
    change: dict[str, Any], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process (no part is reached); the subprocess path is tested below.
    doc = {**TINY_CHAOS, **change}
    status = main([str(write_scenario(tmp_path / "bad.yaml", doc)), "--out", str(tmp_path / "out")])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"extproc chaos: invalid scenario: {key}: ")
    assert not (tmp_path / "out").exists()


def test_the_profile_flag_overrides_the_scenarios(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "tiny.yaml", TINY_CHAOS)  # llmsim's chaos keys set
    done = chaos(scenario, "--profile", "llm-d-v0.10.2.yaml", "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("extproc chaos: invalid scenario: simulator.disconnect_rate: ")
    assert "llm-d-inference-sim" in done.stderr


def test_a_missing_scenario_file_exits_2(tmp_path: Path) -> None:
    done = chaos(tmp_path / "nope.yaml")
    assert done.returncode == 2
    assert "invalid scenario: scenario: cannot read" in done.stderr


def test_an_unknown_tamper_is_a_usage_error(tmp_path: Path) -> None:
    done = chaos("--tamper", "everything", "--out", tmp_path / "out")
    assert done.returncode == 2
    assert "--tamper" in done.stderr


def test_chaos_is_listed_and_has_its_own_help() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "extproc", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert "chaos" in listed.stdout
    done = chaos("--help")
    assert done.returncode == 0
    assert "docs/benchmarking.md" in done.stdout  # where the scenario format is described
    assert "--tamper" not in done.stdout  # a test hook, not an option for users


@pytest.mark.parametrize(
    "path", sorted((ROOT / "benchmarks" / "chaos").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_scenario_loads(path: Path) -> None:
    assert load_chaos(path).name == path.stem
