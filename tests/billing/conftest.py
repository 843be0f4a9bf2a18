"""The recorded simulator stream the meter tests feed, split as Envoy may deliver it."""

from __future__ import annotations

import orjson
import pytest

from loadlab.simulator import Simulator
from tests.billing.streams import REQUEST, ROOT


@pytest.fixture(scope="module")
def recorded_stream(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The simulator's raw SSE bytes for REQUEST, usage chunk included (as admission forces)."""
    import urllib.request

    sim = Simulator(ROOT / "simulator_profiles" / "fast.yaml", log_dir=tmp_path_factory.mktemp("s"))
    try:
        body = orjson.dumps({**REQUEST, "stream_options": {"include_usage": True}})
        request = urllib.request.Request(
            sim.url("/v1/chat/completions"), data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.read()
    finally:
        sim.stop()
