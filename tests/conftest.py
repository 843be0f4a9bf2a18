"""Fixtures every test area shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadlab.redis_server import RedisServer
from tests.support.boundary import pytest_runtest_protocol  # noqa: F401 (a hook)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests keep apart by tenant or key names."""
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


# The costliest files, longest first (seconds on 2 cores, docs/results.md#test-suite). The
# suite runs in parallel by file (scripts/test.sh: xdist --dist loadfile, in this order):
# started first, they do not leave one worker busy at the end while the others idle.
COSTLIEST_FIRST = (
    "quota/test_topologies.py",  # 97
    "quota/test_differential_blocks_long.py",  # 81
    "tools/test_chaos_interrupt.py",  # 79
    "gateway/test_workers.py",  # 65
    "tools/test_chaos_integrity.py",  # 64
    "tools/test_chaos_crash.py",  # 64
    "quota/test_differential_long.py",  # 63
    "tools/test_chaos_errors.py",  # 58
    "gateway/test_crash_books.py",  # 54
    "quota/test_differential.py",  # 53
    "tools/test_bench_interrupt.py",  # 44
    "deploy/test_docker_context.py",  # 41
    "gateway/test_limits_e2e.py",  # 40
    "tools/test_chaos_leases.py",  # 40
    "tools/test_redis_latency_bench.py",  # 40
    "quota/test_acl.py",  # 38
    "tools/test_bench_run.py",  # 38
    "gateway/test_worker_supervision.py",  # 37
    "tools/test_bench_any_endpoint.py",  # 37
    "config/test_reload.py",  # 36
    "gateway/test_streaming.py",  # 33
    "tools/test_chaos_faults.py",  # 33
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The costliest files first, then the other files with slow tests, then the rest;
    within a file the order stays as written."""
    tests = Path(__file__).parent
    rank = {tests / name: i for i, name in enumerate(COSTLIEST_FIRST)}
    missing = [str(path) for path in rank if not path.exists()]
    if missing:
        raise pytest.UsageError(f"COSTLIEST_FIRST names files that are gone: {missing}")
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first_seen: dict[object, int] = {}
    for item in items:
        first_seen.setdefault(item.path, len(first_seen))
    items.sort(
        key=lambda item: (
            rank.get(item.path, len(rank)),
            item.path not in slow_files,
            first_seen[item.path],
        )
    )
