"""Fixtures every test area shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadlab.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests keep apart by tenant or key names."""
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests first, so that parallel workers (scripts/test.sh runs pytest-xdist
    by file) do not end on one long file; within a file the order stays as written."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first_seen: dict[object, int] = {}
    for item in items:
        first_seen.setdefault(item.path, len(first_seen))
    items.sort(key=lambda item: (item.path not in slow_files, first_seen[item.path]))
