"""``extproc bench --admission-leases``: the processor route admits from blocks held in process."""

from __future__ import annotations

from pathlib import Path

import orjson
import yaml

from tests.tools.conftest import TINY, bench, write_scenario

LEASED = {
    **TINY,
    "name": "tiny-leases",
    "routes": ["processor"],
    "load": {**TINY["load"], "levels": [2], "requests": 12},
}


def test_a_run_with_admission_leases_admits_from_blocks_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = write_scenario(tmp_path / "leases.yaml", LEASED)
    done = bench(path, "--admission-leases", "--out", out, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = orjson.loads((out / "summary.json").read_bytes())
    [row] = doc["results"]
    assert row["outcomes"] == {"ok": 12}
    metrics = doc["run"]["processor_metrics"]
    assert metrics["admitted"] == 12 + LEASED["load"]["warmup_requests"]
    # The tenant's first admission goes to Redis and takes a block; later ones come from it.
    assert 0 < metrics["admitted_from_blocks"] < metrics["admitted"]
    recorded = yaml.safe_load((out / "scenario.yaml").read_text())
    assert recorded["processor"]["admission_leases"] is True


def test_a_run_without_admission_leases_admits_every_request_in_redis(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = write_scenario(tmp_path / "leases.yaml", LEASED)
    done = bench(path, "--no-admission-leases", "--out", out, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = orjson.loads((out / "summary.json").read_bytes())
    metrics = doc["run"]["processor_metrics"]
    assert metrics["admitted"] == 12 + LEASED["load"]["warmup_requests"]
    assert metrics["admitted_from_blocks"] == 0
    recorded = yaml.safe_load((out / "scenario.yaml").read_text())
    assert recorded["processor"]["admission_leases"] is False
