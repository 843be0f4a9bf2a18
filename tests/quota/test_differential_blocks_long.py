"""The admission-block machine of ``test_differential`` over long runs, in a file of its
own for the same reason as ``test_differential_long``."""

from __future__ import annotations

import pytest

from loadlab.redis_server import RedisServer
from tests.quota.test_differential import BlockDifferential, _profile, run_differential

pytestmark = pytest.mark.slow


def test_memory_and_redis_backends_agree_on_admission_blocks_over_long_runs(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_differential(redis_server, monkeypatch, _profile(300, 60), BlockDifferential)
