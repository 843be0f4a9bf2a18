"""``bench_ttft_hops.py`` runs end to end: every route measured, Envoy's per-phase timings
read for each ext_proc route (the header phases skipped on one), and the leases route
admitting from a block; and
``bench_cold_phases.py`` timing every phase of both backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_every_route_and_every_ext_proc_phase(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_ttft_hops.py", "--requests", "6", "--rounds", "2",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    routes = json.loads(out.read_text())["routes"]
    assert set(routes) == {"envoy", "noop", "billing", "leases", "noop-body-only"}
    assert {r["requests"] for r in routes.values()} == {6}
    assert set(routes["envoy"]["phases_ms"].values()) == {None}  # no ext_proc there
    for name in ("noop", "billing", "leases"):
        phases = routes[name]["phases_ms"]
        assert all(v is not None and v > 0 for v in phases.values()), (name, phases)
    # Its header phases skipped, the no-op sees the body alone: Envoy times only that phase.
    body_only = routes["noop-body-only"]["phases_ms"]
    assert body_only["request headers"] is None and body_only["response headers"] is None
    assert body_only["request body"] is not None and body_only["request body"] > 0
    assert routes["leases"]["local_admissions"] > 0


def test_the_cold_phases_benchmark_times_every_phase_of_both_backends() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_cold_phases.py", "--exchanges", "8", "--rounds", "2",
         "--evict-mib", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("redis", "le"))]
    assert sorted({row[0] for row in rows}) == ["leases", "redis"]
    assert len(rows) == 2 * 6  # five phases and their sum before the first token, each
