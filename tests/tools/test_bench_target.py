"""``extproc bench --target``: an already running gateway, client-side figures only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.rig import BENCH_KEY, MODEL, write_bench_config
from loadlab.simulator import Simulator
from tests.tools.conftest import bench

REQUESTS, WARMUP, ASKED = 6, 2, 15


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    """Redis, a stamping simulator, the processor and Envoy — started by the test."""
    redis = RedisServer.start(tmp_path / "redis")
    sim = None
    gw = None
    try:
        sim = Simulator(
            "fast.yaml", "--inter-token-latency", "5ms", "--ext-stamp-events", "true",
            log_dir=tmp_path,
        )  # fmt: skip
        config = write_bench_config(tmp_path / "quota.yaml", redis.url)
        gw = start_gateway(config, tmp_path, [sim.port], redis.url)
        yield gw
    finally:
        if gw is not None:
            gw.stop()
        if sim is not None:
            sim.stop()
        redis.stop()


def test_target_measures_a_running_gateway_without_starting_parts(
    gateway: Gateway, tmp_path: Path
) -> None:
    out = tmp_path / "results"
    done = bench(
        "--target", gateway.base_url, "--api-key", BENCH_KEY, "--model", MODEL,
        "--levels", "2", "--requests", str(REQUESTS), "--rounds", "1",
        "--output-tokens", str(ASKED), "--warmup-requests", str(WARMUP),
        "--out", out, "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "logs").exists()  # no part was started
    doc = orjson.loads((out / "summary.json").read_bytes())
    assert doc["scenario"]["targets"] == [{"name": "target", "url": gateway.base_url}]
    assert doc["scenario"]["model"] == MODEL
    assert BENCH_KEY.encode() not in (out / "scenario.yaml").read_bytes()
    [row] = doc["results"]
    assert (row["route"], row["level"], row["completed"]) == ("target", 2, REQUESTS)
    assert row["total_output_tokens"] == REQUESTS * ASKED
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert row["added_chunk_latency_ms"] == {"p50": None, "p99": None}  # no direct route
    records = [orjson.loads(x) for x in (out / "records.jsonl").read_bytes().splitlines()]
    assert all(r["outcome"] == "ok" and r["output_tokens"] == ASKED for r in records)
    # What the bench counted is what the gateway's processor admitted and billed.
    processor = gateway.processors[0]
    total = REQUESTS + WARMUP

    def settled() -> bool:
        return processor.metrics().get("extproc_settlements_total", 0) >= total

    assert wait_until(settled, timeout_s=30)
    metrics = processor.metrics()
    assert metrics["extproc_requests_admitted_total"] == total
    assert metrics['extproc_tokens_total{kind="output"}'] == total * ASKED


def test_target_must_be_an_http_or_https_url(tmp_path: Path) -> None:
    done = bench("--target", "127.0.0.1:1", "--out", tmp_path / "r")
    assert done.returncode == 2
    assert "invalid scenario: target.url: must be an http:// or https:// URL" in done.stderr
    done = bench("--target", "http://a:1", "--target", "http://b:1", "--api-key", "k1",
                 "--api-key", "k2", "--api-key", "k3", "--out", tmp_path / "r")  # fmt: skip
    assert done.returncode == 2
    assert "target.api_key: give one --api-key, or one per --target (2)" in done.stderr
