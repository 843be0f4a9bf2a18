"""The differential machine of ``test_differential`` over long runs: a file of its own, so
the parallel suite (by file) runs it beside the step-by-step runs, not after them."""

from __future__ import annotations

import pytest

from loadlab.redis_server import RedisServer
from tests.quota.test_differential import _profile, run_differential

pytestmark = pytest.mark.slow


def test_memory_and_redis_backends_agree_over_long_runs(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_differential(redis_server, monkeypatch, _profile(examples=300, steps=60))
