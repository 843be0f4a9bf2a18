"""``extproc usage export`` and ``summary``, run as the real command against redis-server."""

from __future__ import annotations

import asyncio
import csv
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
import redis

from extproc.quota.base import LEDGER_FIELDS, AdmitRequest, Counter, UsageTags
from extproc.quota.keys import block_key, counter_key, reservation_key
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.usage.ledger import COLUMNS
from loadlab.procs import ManagedProcess, free_port
from loadlab.redis_server import RedisServer
from tests.usage.conftest import TENANTS, all_entries, fill_ledger

ROOT = Path(__file__).resolve().parents[2]
INTS = {"prompt_tokens", "output_tokens", "reserved", "used", "refunded"}


def usage(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "usage", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def export_args(server: RedisServer, output: Path, fmt: str = "jsonl", *extra: str) -> list[str]:
    return [
        "export",
        "--redis-url",
        server.url,
        "--group",
        "billing",
        "--consumer",
        "exporter-1",
        "--format",
        fmt,
        "--output",
        str(output),
        *extra,
    ]


def jsonl_records(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_text().splitlines()]


def pending(client: redis.Redis) -> int:
    return sum(
        client.xpending(stream, "billing")["pending"]
        for stream in client.scan_iter(match="tq:{*}:usage", _type="stream")
    )


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def test_jsonl_export_writes_every_entry_with_its_fields_and_acknowledges_all(
    usage_redis: RedisServer, plain: redis.Redis, tmp_path: Path
) -> None:
    fill_ledger(usage_redis, 300)
    out = tmp_path / "usage.jsonl"
    done = usage(*export_args(usage_redis, out))
    assert done.returncode == 0, done.stderr

    records = jsonl_records(out)
    entries = all_entries(plain)
    assert len(records) == len(entries) == 300
    for rec in records:
        fields = entries[(rec["stream"], rec["id"])]
        assert list(rec) == list(COLUMNS)
        for name in LEDGER_FIELDS:
            assert str(rec[name]) == fields[name]
        assert all(isinstance(rec[n], int) for n in INTS)
    assert {r["tenant"] for r in records} == set(TENANTS)
    assert pending(plain) == 0
    # Nothing new: a second run writes nothing.
    again = usage(*export_args(usage_redis, out))
    assert again.returncode == 0 and len(jsonl_records(out)) == 300
    assert orjson.loads(again.stderr.splitlines()[-1])["written"] == 0


def test_csv_export_has_one_header_and_one_row_per_entry(
    usage_redis: RedisServer, plain: redis.Redis, tmp_path: Path
) -> None:
    fill_ledger(usage_redis, 120, seed=2)
    out = tmp_path / "usage.csv"
    assert usage(*export_args(usage_redis, out, "csv")).returncode == 0
    fill_ledger(usage_redis, 30, seed=3)  # more arrive; the next run appends them
    assert usage(*export_args(usage_redis, out, "csv")).returncode == 0

    with out.open(newline="") as f:
        reader = csv.reader(f)
        assert tuple(next(reader)) == COLUMNS
        rows = [dict(zip(COLUMNS, row, strict=True)) for row in reader]
    entries = all_entries(plain)
    assert len(rows) == len(entries) == 150
    for row in rows:
        fields = entries[(row["stream"], row["id"])]
        assert {n: row[n] for n in LEDGER_FIELDS} == fields
    assert pending(plain) == 0


def test_an_export_killed_midway_resumes_with_every_entry_exactly_once(
    usage_redis: RedisServer, plain: redis.Redis, tmp_path: Path
) -> None:
    fill_ledger(usage_redis, 3000, seed=4)
    out = tmp_path / "usage.jsonl"
    argv = [sys.executable, "-m", "extproc", "usage", *export_args(usage_redis, out)]
    killed = ManagedProcess([*argv, "--batch", "1"], tmp_path / "export-1.log", cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 200):
            assert killed.proc.poll() is None, killed.log_text()
            assert time.monotonic() < deadline, "the export wrote nothing"
            time.sleep(0.002)
        killed.signal(signal.SIGKILL)
        assert killed.proc.wait(10) == -signal.SIGKILL
    finally:
        killed.stop()
    lines_at_kill = out.read_bytes().count(b"\n")
    assert lines_at_kill < 3000

    resumed = usage(*export_args(usage_redis, out))
    assert resumed.returncode == 0, resumed.stderr
    records = jsonl_records(out)
    ids = [(r["stream"], r["id"]) for r in records]
    assert len(ids) == len(set(ids)) == 3000
    assert set(ids) == set(all_entries(plain))
    assert pending(plain) == 0


def test_a_torn_last_line_is_cut_and_its_entry_written_again(
    usage_redis: RedisServer, plain: redis.Redis, tmp_path: Path
) -> None:
    fill_ledger(usage_redis, 50, seed=5)
    out = tmp_path / "usage.jsonl"
    assert usage(*export_args(usage_redis, out)).returncode == 0
    full = out.read_bytes()
    last = orjson.loads(full.splitlines()[-1])
    # As if killed mid-write: the last record half there. The group delivers that stream
    # again from its start: every entry but the torn one is already in the file.
    out.write_bytes(full[: full.rfind(b"\n", 0, len(full) - 1) + 1] + b'{"stream": "tq:{ac')
    plain.execute_command("XGROUP", "SETID", last["stream"], "billing", "0")
    resumed = usage(*export_args(usage_redis, out))
    assert resumed.returncode == 0, resumed.stderr
    ids = [(r["stream"], r["id"]) for r in jsonl_records(out)]
    assert len(ids) == len(set(ids)) == 50
    assert ids[-1] == (last["stream"], last["id"])


def test_until_leaves_later_entries_pending_for_a_later_run(
    usage_redis: RedisServer, plain: redis.Redis, tmp_path: Path
) -> None:
    fill_ledger(usage_redis, 200, seed=6)
    entries = sorted(all_entries(plain), key=lambda k: tuple(map(int, k[1].split("-"))))
    cut_ms = int(entries[100][1].split("-")[0])
    out = tmp_path / "usage.jsonl"
    assert usage(*export_args(usage_redis, out, "jsonl", "--until", iso(cut_ms))).returncode == 0
    first = jsonl_records(out)
    assert first and all(int(str(r["id"]).split("-")[0]) < cut_ms for r in first)
    assert usage(*export_args(usage_redis, out)).returncode == 0
    ids = [(r["stream"], r["id"]) for r in jsonl_records(out)]
    assert len(ids) == len(set(ids)) == 200
    assert pending(plain) == 0


def test_summary_over_a_range_equals_the_sums_of_its_records(
    usage_redis: RedisServer, plain: redis.Redis
) -> None:
    fill_ledger(usage_redis, 600, seed=7)
    entries = all_entries(plain)
    times = sorted(int(i.split("-")[0]) for _, i in entries)
    since_ms, until_ms = times[100], times[500]
    expected: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (_, entry_id), fields in entries.items():
        if since_ms <= int(entry_id.split("-")[0]) < until_ms:
            group = expected[(fields["tenant"], fields["model"])]
            group["requests"] += 1
            for name in ("prompt_tokens", "output_tokens", "used", "reserved", "refunded"):
                group[name] += int(fields[name])

    done = usage(
        "summary",
        "--redis-url",
        usage_redis.url,
        "--since",
        iso(since_ms),
        "--until",
        iso(until_ms),
        "--format",
        "json",
    )
    assert done.returncode == 0, done.stderr
    rows = orjson.loads(done.stdout)
    got = {(r.pop("tenant"), r.pop("model")): r for r in rows}
    assert got == {k: dict(v) for k, v in expected.items()}
    assert sum(r["requests"] for r in got.values()) == sum(
        1 for t in times if since_ms <= t < until_ms
    )

    table = usage(
        "summary", "--redis-url", usage_redis.url, "--since", iso(since_ms), "--until",
        iso(until_ms), "--by", "tenant",
    )  # fmt: skip
    assert table.returncode == 0
    header, *lines = table.stdout.splitlines()
    assert header.split() == [
        "tenant",
        "requests",
        *(["prompt_tokens", "output_tokens", "used", "reserved", "refunded"]),
    ]
    assert len(lines) == len({t for t, _ in expected})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--redis-url", "http://localhost:6379"], "not a Redis URL"),
        (["--redis-url", "redis://127.0.0.1:{port}", "--since", "yesterday"], "not an ISO 8601"),
        (["--redis-url", "redis://127.0.0.1:{dead}"], "cannot reach Redis"),
        (
            [
                "--redis-url",
                "redis://127.0.0.1:{port}",
                "--since",
                "2026-02-01",
                "--until",
                "2026-01-01",
            ],
            "must be before",
        ),
        (["--redis-url", "redis://127.0.0.1:{port}", "--by", "colour"], "--by takes"),
    ],
)
def test_bad_input_and_unreachable_redis_exit_2_with_one_line(
    usage_redis: RedisServer, args: list[str], message: str
) -> None:
    filled = [a.format(port=usage_redis.port, dead=free_port()) for a in args]
    if "--since" not in filled:
        filled += ["--since", "2026-01-01", "--until", "2026-02-01"]
    elif "--until" not in filled:
        filled += ["--until", "2026-02-01"]
    done = usage("summary", *filled)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


def test_summary_counts_an_admission_blocks_entry_in_the_sums_not_as_a_request(
    usage_redis: RedisServer, plain: redis.Redis
) -> None:
    """A block taken, one request admitted out of it, both settled: two ledger entries,
    one request; the tokens of both in the sums."""
    tpm = Counter("tpm", counter_key("blocky", "tpm", "gpt-4.1", 3600), 10**9, 3600)

    async def run() -> None:
        backend = RedisQuotaBackend.from_url(usage_redis.url)
        tags = UsageTags("pro", "gpt-4.1", "", 0)
        block = block_key("blocky", "owner", 1)
        request = reservation_key("blocky", "req-1")
        try:
            taken = await backend.take_block(AdmitRequest(block, (), (tpm,), 500, usage=tags), 5)
            assert taken.verdict.admitted
            used = AdmitRequest(request, (), (tpm,), 52, usage=UsageTags("pro", "gpt-4.1", "c", 20))
            assert (await backend.admit_from_block(block, used)).from_block
            await backend.settle(request, (tpm,), 30, output_tokens=10)
            await backend.return_block(block, (), (tpm,))
        finally:
            await backend.close()

    asyncio.run(run())
    assert len(all_entries(plain)) == 2
    times = sorted(int(i.split("-")[0]) for _, i in all_entries(plain))
    span = ("--since", iso(times[0]), "--until", iso(times[-1] + 1))
    done = usage("summary", "--redis-url", usage_redis.url, *span, "--format", "json")
    assert done.returncode == 0, done.stderr
    (row,) = orjson.loads(done.stdout)
    assert row["requests"] == 1
    assert row["used"] == 30
    assert row["reserved"] == 500  # the request's 52 and the block's 448 left
