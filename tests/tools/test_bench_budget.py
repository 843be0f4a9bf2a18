"""A budget that runs out: the quota-accuracy figures of ``extproc bench``."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.tools.conftest import TINY, bench, write_scenario

TPM = 600  # 12 requests of 17 prompt + 40 output tokens ask for 684
BUDGET = {
    **TINY,
    "name": "tiny-budget",
    "routes": ["processor"],
    "processor": {"charge_modes": ["incremental"], "batch_tokens": [8],
                  "budget": {"tpm": TPM, "window_s": 3600}},
    "load": {**TINY["load"], "levels": [3], "requests": 12, "output_tokens": 40,
             "warmup_requests": 0},
}  # fmt: skip


def test_a_budget_that_runs_out_is_charged_per_window_never_above_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = bench(write_scenario(tmp_path / "budget.yaml", BUDGET), "--out", out, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = orjson.loads((out / "summary.json").read_bytes())
    [row] = doc["results"]
    budget = row["budget"]
    assert budget["utilisation_basis"] == "charged"
    windows = budget["windows"]
    assert windows and all(0 < w["charged_tokens"] <= TPM for w in windows)
    assert budget["windows_over_budget"] == 0
    # The budget ran out: some streams were cut or refused, and what was charged covers
    # what reached the client (equal within one window: nothing left unrefunded).
    outcomes = row["outcomes"]
    assert outcomes.get("cut", 0) + outcomes.get("refused", 0) > 0
    assert set(outcomes) <= {"ok", "cut", "refused"}
    assert budget["streams_cut"] == outcomes.get("cut", 0)
    assert budget["refused_429"] == outcomes.get("refused", 0)
    assert budget["charged_tokens"] >= budget["delivered_tokens"] > 0
    if len(windows) == 1:
        assert budget["charged_minus_delivered"] == 0
        assert budget["max_utilisation"] == windows[0]["charged_tokens"] / TPM
    # The processor's own counts agree with the client's.
    metrics = doc["run"]["processor_metrics"]
    assert metrics["cutoffs"] == outcomes.get("cut", 0)
    assert metrics["admitted"] == outcomes.get("ok", 0) + outcomes.get("cut", 0)
    records = [orjson.loads(x) for x in (out / "records.jsonl").read_bytes().splitlines()]
    for r in records:
        if r["outcome"] == "cut":
            assert r["error_code"] == "tpm_limit_exceeded"
            assert r["output_tokens"] == r["events"] < r["max_tokens"]
        if r["outcome"] == "refused":
            assert r["status"] == 429 and r["events"] == 0
    png = (out / "plots" / "budget_use.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    # No empty plot: a budget run of the processor route alone has no added latency.
    assert not (out / "plots" / "added_latency.png").exists()
    assert "added_latency.png skipped: no direct route to subtract" in done.stdout
