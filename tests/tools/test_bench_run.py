"""``extproc bench`` end to end: a tiny scenario as a subprocess, and the files it leaves."""

from __future__ import annotations

import csv
import itertools
import struct
import subprocess
from pathlib import Path

import orjson
import pytest
import yaml

from loadlab.compare import ratio_row
from loadlab.scenario import parse_scenario
from loadlab.stats import CSV_COLUMNS
from tests.tools.conftest import PNG_SIGNATURE, TINY, bench, write_scenario

ROUTES = ["direct", "envoy", "noop", "processor"]
LEVELS = [1, 3]
REQUESTS = 3  # per route and level: max(requests 3, rounds 1 × level)
ASKED = TINY["load"]["output_tokens"]
PLOTS = ["chunk_latency_cdf", "ttft_cdf", "added_latency", "added_latency_p99", "output_throughput"]
RECORD_KEYS = {
    "route", "level", "index", "start_ns", "status", "outcome", "prompt_tokens", "max_tokens",
    "output_tokens", "events", "ttft_ms", "e2el_ms", "tpot_ms", "itl_ms", "chunk_latency_us",
    "chunk_arrival_ms", "error_code", "retry_after_s", "detail",
}  # fmt: skip
DISTRIBUTIONS = ["ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "chunk_latency_ms"]


def records(out: Path) -> list[dict]:
    return [orjson.loads(line) for line in (out / "records.jsonl").read_bytes().splitlines()]


def summary(out: Path) -> dict:
    return orjson.loads((out / "summary.json").read_bytes())


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def run(tiny_run: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    out, done = tiny_run
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_tiny_scenario_exits_0_and_writes_every_result_file(run: Path) -> None:
    for name in ("records.jsonl", "summary.json", "summary.csv", "scenario.yaml"):
        assert (run / name).stat().st_size > 0, name
    for name in PLOTS:
        width, height = png_size(run / "plots" / f"{name}.png")
        assert width > 100 and height > 100, name


def test_records_hold_one_line_per_request_with_every_chunk(run: Path) -> None:
    rows = records(run)
    assert len(rows) == len(ROUTES) * len(LEVELS) * REQUESTS
    assert {(r["route"], r["level"]) for r in rows} == {(a, b) for a in ROUTES for b in LEVELS}
    for r in rows:
        assert set(r) == RECORD_KEYS
        assert (r["status"], r["outcome"], r["error_code"]) == (200, "ok", None), r
        assert r["max_tokens"] == r["output_tokens"] == r["events"] == ASKED
        assert len(r["chunk_latency_us"]) == len(r["chunk_arrival_ms"]) == ASKED
        assert len(r["itl_ms"]) == ASKED - 1
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        assert r["chunk_arrival_ms"][0] == pytest.approx(r["ttft_ms"], abs=0.001)
        assert r["chunk_arrival_ms"][-1] == pytest.approx(r["e2el_ms"], abs=0.001)
        # The usage event's prompt count: 10 words + the chat template's 7.
        assert r["prompt_tokens"] == 17


def test_send_stamps_are_exact_one_way_latencies(run: Path) -> None:
    """Each chunk's latency is arrival − the simulator's send stamp: never negative, the
    send times (arrival − latency) follow the client's receive order and come after the
    request was written, on every route (each hop forwards the stamp unchanged)."""
    for r in records(run):
        latencies = r["chunk_latency_us"]
        sent_us = [a * 1000 - lat for a, lat in zip(r["chunk_arrival_ms"], latencies, strict=True)]
        assert min(latencies) >= 0, r["route"]
        assert sent_us[0] >= -1.1, r["route"]  # rounding: arrivals 1 µs, latencies 0.1 µs
        assert all(b >= a - 1.1 for a, b in itertools.pairwise(sent_us)), r["route"]
        assert r["chunk_arrival_ms"] == sorted(r["chunk_arrival_ms"])


def test_summary_has_plausible_figures_per_route_and_level(run: Path) -> None:
    doc = summary(run)
    rows = doc["results"]
    assert [(r["route"], r["level"]) for r in rows] == [(a, b) for b in LEVELS for a in ROUTES]
    for r in rows:
        assert (r["requests"], r["completed"]) == (REQUESTS, REQUESTS)
        assert r["outcomes"] == {"ok": REQUESTS}
        assert r["total_output_tokens"] == REQUESTS * ASKED
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        for name in DISTRIBUTIONS:
            d = r[name]
            assert 0 <= d["p50"] <= d["p90"] <= d["p99"], (r["route"], name)
        assert r["ttft_ms"]["p50"] > 0
        assert r["chunk_latency_ms"]["count"] == REQUESTS * ASKED
        assert r["tpot_ms"]["count"] == REQUESTS
        added = r["added_chunk_latency_ms"]
        if r["route"] == "direct":
            assert added == {"p50": 0.0, "p99": 0.0}
        else:
            direct = next(x for x in rows if x["route"] == "direct" and x["level"] == r["level"])
            expected = r["chunk_latency_ms"]["p50"] - direct["chunk_latency_ms"]["p50"]
            assert added["p50"] == pytest.approx(expected, abs=1e-3)
        assert set(r["cpu_share"]) >= {"client", "simulator", "machine"}
    assert doc["run"]["machine"]["cpus"] >= 1


def test_summary_csv_has_a_row_per_route_and_level(run: Path) -> None:
    with open(run / "summary.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    assert len(rows) == len(ROUTES) * len(LEVELS)
    assert {r["added_chunk_latency_ms_p50"] for r in rows if r["route"] == "direct"} == {"0.0"}


def test_scenario_yaml_records_the_run_and_runs_again_as_it_is(run: Path) -> None:
    doc = yaml.safe_load((run / "scenario.yaml").read_text())
    assert doc["run"]["machine"]["versions"]["token-quota-extproc"]
    assert doc["load"]["levels"] == LEVELS
    again = parse_scenario(doc)
    assert again.to_doc() == {k: v for k, v in doc.items() if k != "run"}


def test_compare_gives_b_over_a_per_route_and_level(run: Path, tmp_path: Path) -> None:
    small = {**TINY, "routes": ["direct", "processor"], "load": {**TINY["load"], "levels": [1]}}
    second = tmp_path / "b"
    done = bench(write_scenario(tmp_path / "b.yaml", small), "--out", second, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    compared = bench("compare", run, second, "--out", tmp_path / "cmp")
    assert compared.returncode == 0, compared.stderr
    rows = orjson.loads((tmp_path / "cmp" / "compare.json").read_bytes())
    assert [(r["route"], r["level"]) for r in rows] == [("direct", 1), ("processor", 1)]
    a = {(r["route"], r["level"]): r for r in summary(run)["results"]}
    b = {(r["route"], r["level"]): r for r in summary(second)["results"]}
    for row in rows:
        key = (row["route"], row["level"])
        for metric in ("ttft_ms", "e2el_ms", "chunk_latency_ms"):
            va, vb = a[key][metric]["p50"], b[key][metric]["p50"]
            assert row[f"{metric}.p50.ratio"] == pytest.approx(vb / va, rel=1e-4)
        ratio = b[key]["output_throughput"] / a[key]["output_throughput"]
        assert row["output_throughput.ratio"] == pytest.approx(ratio, rel=1e-4)
    assert (tmp_path / "cmp" / "compare.csv").read_text().startswith("route,level,")
    assert "processor" in compared.stdout


@pytest.mark.parametrize("a, b", [(38.83, 1.0), (0.626, 1.0377), (1.0, 123456.7)])
def test_a_ratio_keeps_five_significant_figures_however_small_or_large(a: float, b: float) -> None:
    row = ratio_row("processor", 1, {"ttft_ms": {"p50": a}}, {"ttft_ms": {"p50": b}})
    assert row["ttft_ms.p50.ratio"] == pytest.approx(b / a, rel=5e-5)


def test_compare_of_one_folder_divides_its_routes_by_the_baseline(
    run: Path, tmp_path: Path
) -> None:
    done = bench("compare", run, "--baseline", "direct", "--out", tmp_path / "cmp")
    assert done.returncode == 0, done.stderr
    rows = orjson.loads((tmp_path / "cmp" / "compare.json").read_bytes())
    by = {(r["route"], r["level"]): r for r in summary(run)["results"]}
    assert [(r["route"], r["level"]) for r in rows] == [
        (route, level) for route in ROUTES[1:] for level in LEVELS
    ]
    for row in rows:
        mine, base = by[(row["route"], row["level"])], by[("direct", row["level"])]
        ratio = mine["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]
        assert row["ttft_ms.p50.ratio"] == pytest.approx(ratio, rel=1e-4)  # 5 figures
    assert "B/A ratios — A: direct  B: envoy, noop, processor" in done.stdout
    unknown = bench("compare", run, "--baseline", "nowhere")
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (
        "extproc bench compare: no route 'nowhere' (routes: direct, envoy, noop, processor)"
    )
