"""``extproc bench --admission-leases``: the processor route admits from blocks held in process."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from tests.tools.conftest import TINY, bench, write_scenario

LEASED = {
    **TINY,
    "name": "tiny-leases",
    "routes": ["processor"],
    "load": {**TINY["load"], "levels": [2], "requests": 12},
}


@pytest.mark.parametrize("leases", [True, False], ids=["on", "off"])
def test_admission_leases_on_admit_from_blocks_and_the_run_says_how_many(
    leases: bool, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    path = write_scenario(tmp_path / "leases.yaml", LEASED)
    flag = "--admission-leases" if leases else "--no-admission-leases"
    done = bench(path, flag, "--out", out, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = orjson.loads((out / "summary.json").read_bytes())
    [row] = doc["results"]
    assert row["outcomes"] == {"ok": 12}
    metrics = doc["run"]["processor_metrics"]
    assert metrics["admitted"] == 12 + LEASED["load"]["warmup_requests"]
    if leases:
        # A tenant's first admission goes to Redis and takes a block; later ones use it.
        assert 0 < metrics["admitted_from_blocks"] < metrics["admitted"]
    else:
        assert metrics["admitted_from_blocks"] == 0
    recorded = yaml.safe_load((out / "scenario.yaml").read_text())
    assert recorded["processor"]["admission_leases"] is leases
