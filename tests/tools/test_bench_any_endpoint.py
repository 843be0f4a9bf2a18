"""``extproc bench --target`` against an OpenAI-compatible server that is not llmsim (written
here: ``json.dumps`` spacing, mixed framing, reasoning and tool-call deltas, no stamps), run
as a process; two targets side by side; ``bench compare`` of two results folders."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadlab.redis_server import make_tls_files
from tests.tools.conftest import ROOT
from tests.tools.openai_server import openai_server

ASKED = 12


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "bench", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def target_run(url: str, key: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run(
        "--target", url, "--api-key", key, "--levels", "1,2", "--requests", "4",
        "--rounds", "1", "--output-tokens", str(ASKED), "--warmup-requests", "1",
        "--out", out, "--quiet", *extra,
    )  # fmt: skip


def results(out: Path) -> list[dict]:
    return orjson.loads((out / "summary.json").read_bytes())["results"]


def records(out: Path) -> list[dict]:
    return [orjson.loads(x) for x in (out / "records.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_bench_measures_an_openai_server_that_is_not_llmsim(api: str, tmp_path: Path) -> None:
    with openai_server() as server:
        done = target_run(server.url, server.key, tmp_path / "r", "--api", api)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = results(tmp_path / "r")
    assert [(r["route"], r["level"], r["completed"], r["requests"]) for r in rows] == [
        ("target", 1, 4, 4),
        ("target", 2, 4, 4),
    ]
    for row in rows:
        assert row["total_output_tokens"] == 4 * ASKED  # the server's usage events
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
            assert row[metric]["count"] > 0 and 0 < row[metric]["p50"] <= row[metric]["p99"]
        assert row["itl_ms"]["count"] == 4 * (ASKED - 1)  # every delta kind is a token event
        assert row["chunk_latency_ms"]["count"] == 0  # no stamps: none measured, no crash
        assert row["output_throughput"] > 0
    assert all(r["events"] == ASKED and r["outcome"] == "ok" for r in records(tmp_path / "r"))
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    assert {("messages" in r["body"], "prompt" in r["body"]) for r in server.requests} == {
        (api == "chat", api != "chat")
    }
    assert all(r["body"]["ignore_eos"] is True for r in server.requests), path
    assert "No chunk latency" in done.stdout
    # No plot without data: no stamps, no chunk latency; no direct route, no added latency.
    plots = sorted(p.name for p in (tmp_path / "r" / "plots").iterdir())
    assert plots == ["output_throughput.png", "ttft_cdf.png"]
    assert "chunk_latency_cdf.png skipped: no token event carried a send stamp" in done.stdout
    assert "added_latency.png skipped: no direct route to subtract" in done.stdout


def test_a_run_that_completes_nothing_exits_1_saying_why(tmp_path: Path) -> None:
    with openai_server() as server:
        done = target_run(server.url, "sk-wrong", tmp_path / "r")
    assert done.returncode == 1
    lines = [x for x in done.stderr.splitlines() if x.startswith("extproc bench: ")]
    assert lines == [
        f"extproc bench: no request completed at target @ {level} ({n} sent: error {n}); "
        "the first: HTTP 401: Incorrect API key provided"
        for level, n in ((1, 4), (2, 4))
    ]
    assert len(results(tmp_path / "r")) == 2  # the results are still written


@pytest.mark.slow
def test_ignore_eos_can_be_left_out_for_an_api_that_refuses_it(tmp_path: Path) -> None:
    with openai_server(refuse_ignore_eos=True) as server:
        refused = target_run(server.url, server.key, tmp_path / "a")
        done = target_run(server.url, server.key, tmp_path / "b", "--no-ignore-eos")
    assert refused.returncode == 1
    assert "HTTP 400: Unrecognized request argument supplied: ignore_eos" in refused.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["completed"] for r in results(tmp_path / "b")] == [4, 4]


@pytest.mark.slow
def test_an_https_target_is_verified_with_the_systems_trust_store(tmp_path: Path) -> None:
    import ssl

    ca, crt, key = make_tls_files(tmp_path / "tls")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(crt, key)
    with openai_server(tls=context) as server:
        untrusted = target_run(server.url, server.key, tmp_path / "a")
        done = run(
            "--target", server.url, "--api-key", server.key, "--levels", "1", "--requests", "2",
            "--rounds", "1", "--output-tokens", "5", "--warmup-requests", "0",
            "--out", tmp_path / "b", "--quiet", env={"SSL_CERT_FILE": str(ca)},
        )  # fmt: skip
    assert untrusted.returncode == 1
    assert "connection failed: [SSL: CERTIFICATE_VERIFY_FAILED]" in untrusted.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert results(tmp_path / "b")[0]["completed"] == 2


@pytest.mark.slow
def test_two_targets_run_one_scenario_interleaved_and_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "r"
    with openai_server(itl_s=0.002) as a, openai_server(itl_s=0.006, key="sk-b") as b:
        done = run(
            "--target", f"ours={a.url}", "--target", f"theirs={b.url}/v1",
            "--api-key", a.key, "--api-key", b.key, "--levels", "1,2", "--requests", "4",
            "--rounds", "1", "--output-tokens", str(ASKED), "--warmup-requests", "1",
            "--out", out, "--quiet",
        )  # fmt: skip
        arrived = sorted(
            [("ours", r["request_id"]) for r in a.requests]
            + [("theirs", r["request_id"]) for r in b.requests],
            key=lambda x: int(x[1].rsplit("-", 1)[1]),  # the client's send order (time_ns)
        )
    assert done.returncode == 0, done.stderr[-3000:]
    # Four rounds a level, alternately forward and backward (ABBA ABBA), level by level: a
    # round starts with its request 0 (request ids: route-level-index-time).
    starts = [(who, rid.split("-")[1]) for who, rid in arrived if rid.split("-")[2] == "0"]
    abba = ["ours", "theirs", "theirs", "ours"] * 2
    assert starts[2:] == [(who, level) for level in "12" for who in abba]  # after 2 warm-ups
    rows = {(r["route"], r["level"]): r for r in results(out)}
    assert {k: r["completed"] for k, r in rows.items()} == {
        ("ours", 1): 4,
        ("theirs", 1): 4,
        ("ours", 2): 8,
        ("theirs", 2): 8,
    }  # fmt: skip  (a round of 2 streams sends at least 2)
    assert orjson.loads((out / "summary.json").read_bytes())["scenario"]["targets"] == [
        {"name": "ours", "url": a.url},
        {"name": "theirs", "url": f"{b.url}/v1"},
    ]
    assert b"sk-b" not in (out / "scenario.yaml").read_bytes()
    ratios = orjson.loads((out / "compare.json").read_bytes())
    assert [(r["route"], r["level"]) for r in ratios] == [("theirs", 1), ("theirs", 2)]
    for r in ratios:
        mine, base = rows[("theirs", r["level"])], rows[("ours", r["level"])]
        # Five significant figures, as compare.json keeps them (a ratio below 1 has 5 decimals).
        ratio = mine["itl_ms"]["p99"] / base["itl_ms"]["p99"]
        assert r["itl_ms.p99.ratio"] == float(f"{ratio:.5g}")
        assert r["tpot_ms.p50.ratio"] > 1  # 6 ms against 2 ms between tokens
    with open(out / "compare.csv", newline="") as f:
        assert [row["route"] for row in csv.DictReader(f)] == ["theirs", "theirs"]
    assert "B/A ratios — A: ours  B: theirs" in done.stdout


@pytest.mark.slow
def test_compare_of_two_folders_warns_of_what_differs_and_drops_nothing_silently(
    tmp_path: Path,
) -> None:
    with openai_server() as server:
        a = target_run(server.url, server.key, tmp_path / "a")
        b = run(
            "--target", server.url, "--api-key", server.key, "--levels", "2,3",
            "--requests", "4", "--rounds", "1", "--output-tokens", "8",
            "--warmup-requests", "1", "--out", tmp_path / "b", "--quiet",
        )  # fmt: skip
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "bench", "compare", tmp_path / "a", tmp_path / "b"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    warnings = [x for x in done.stdout.splitlines() if x.startswith("warning: ")]
    assert warnings[0].startswith("warning: the two runs used different scenarios: ")
    assert "load.levels: [1, 2] vs [2, 3]" in warnings[0]
    assert "load.output_tokens: 12 vs 8" in warnings[0]
    assert "warning: levels only in A, not compared: 1" in warnings
    assert "warning: levels only in B, not compared: 3" in warnings
    ratios = orjson.loads((tmp_path / "b" / "compare.json").read_bytes())
    assert [(r["route"], r["level"]) for r in ratios] == [("target", 2)]
    assert not re.search(r"…", done.stdout)  # a pipe: nothing cut, whatever COLUMNS says
