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
