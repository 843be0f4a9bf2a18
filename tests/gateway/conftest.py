"""Real parts for gateway tests: redis-server, simulators, processors and Envoy.

One redis-server and two simulators serve the whole session; each test module starts its
own gateway (processor + Envoy) with the tenants it needs. Every tenant in a module has
its own counters, so tests in a module don't see each other's charges.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadlab.gateway import key_hash, write_config
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.support import boundary
from tests.support.scripted_upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parents[2]
FAST_PROFILE = ROOT / "simulator_profiles" / "fast.yaml"

MODELS: dict[str, Any] = {
    "gpt-4.1": {
        "aliases": ["gpt-4.1-2025-04-14", "my-gpt-alias"],
        "tokenizer": "o200k_base",
        "max_tokens": 64,
        "default_max_tokens": 16,
    },
}


def tenant_key(name: str) -> str:
    return f"sk-test-{name}"


def processor_config(tenants: dict[str, dict[str, Any]], **top: Any) -> dict[str, Any]:
    """A config where each tenant ``name`` has key ``sk-test-<name>`` and its own plan."""
    return {
        "redis_url": "memory://",
        "models": top.pop("models", MODELS),
        "plans": {name: spec for name, spec in tenants.items()},
        "tenants": {
            name: {"plan": name, "key_sha256": [key_hash(tenant_key(name))]} for name in tenants
        },
        **top,
    }


@pytest.fixture(scope="session")
def simulators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Simulator]]:
    log_dir = tmp_path_factory.mktemp("simulators")
    started: list[Simulator] = []
    try:
        for _ in range(2):
            started.append(Simulator(FAST_PROFILE, log_dir=log_dir))
        yield started
    finally:
        for sim in started:
            sim.stop()


@pytest.fixture()
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    yield client
    client.close()


def write_processor_config(path: Path, tenants: dict[str, dict[str, Any]], **top: Any) -> Path:
    return write_config(path, processor_config(tenants, **top))


# Hour-long windows: a limit resets in the middle of a test only when it runs across the
# hour, and a test that fails then runs once more (tests/support/boundary.py).
WINDOW_S = boundary.WINDOW_S


def counter_value(
    client: redis.Redis, tenant: str, kind: str, model: str | None, window_s: int = WINDOW_S
) -> int:
    """Sum over every live window of one counter (a test spans at most two windows)."""
    from extproc.quota import keys

    window = 86400 if kind == "daily" else window_s
    prefix = keys.counter_key(tenant, kind, model, window)  # type: ignore[arg-type]
    return sum(int(client.get(k) or 0) for k in client.scan_iter(match=prefix + ":*"))


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    """A scripted upstream of the module's own (tests set its ``reply``)."""
    server = ScriptedUpstream()
    yield server
    server.stop()
