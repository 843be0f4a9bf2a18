"""`extproc serve --grpc-threads`: how gRPC's own threads are scheduled (extproc.app.sched).

Read from the kernel (``sched_getscheduler`` of each thread of the running processor), after
real streams through Envoy made the event engine take on its work, so a thread its pool
started under load is checked too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import openai
import pytest
import redis

from extproc.app.sched import resolved, threads_started_as
from loadlab.gateway import Envoy, Processor
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.threads import GRPC_THREAD_NAMES, thread_policies

TENANT = "threads"
TENANTS = {TENANT: {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1000, "tpm": 1_000_000}}}}
STREAMS = 4

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")


def stream_through(tmp_path: Path, processor: Processor, sim: Simulator) -> int:
    """STREAMS streamed answers through Envoy and the processor: their chunks, counted."""
    envoy = Envoy.start(tmp_path, [processor.port], [sim.port])
    try:
        client = openai.OpenAI(
            base_url=envoy.base_url + "/v1", api_key=tenant_key(TENANT), max_retries=0
        )
        chunks = 0
        for _ in range(STREAMS):
            stream = client.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "count to forty"}],
                stream=True,
                max_tokens=40,
            )
            chunks += sum(1 for _ in stream)
        return chunks
    finally:
        envoy.stop()


ONE_CPU = min(os.sched_getaffinity(0))  # pinned: the processor may run on this CPU only
SEVERAL_CPUS = len(os.sched_getaffinity(0)) > 1


@pytest.mark.parametrize(
    ("flag", "pinned", "grpc_policy"),
    [
        (None, True, os.SCHED_BATCH),
        pytest.param(
            None,
            False,
            os.SCHED_OTHER,
            marks=pytest.mark.skipif(not SEVERAL_CPUS, reason="one CPU: auto takes batch"),
        ),
        ("batch", False, os.SCHED_BATCH),
        ("normal", True, os.SCHED_OTHER),
    ],
    ids=["auto-one-cpu", "auto-several-cpus", "batch", "normal-one-cpu"],
)
def test_grpc_threads_run_as_asked_and_the_event_loop_thread_stays_ordinary(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    simulators: list[Simulator],
    flag: str | None,
    pinned: bool,
    grpc_policy: int,
) -> None:
    """By default (``auto``) every gRPC thread (poller, timer, event engine) is SCHED_BATCH
    when the processor may run on one CPU only, ordinary when it may run on several;
    ``batch`` and ``normal`` hold wherever it runs. The loop's thread is SCHED_OTHER in every
    case, and the streams are metered either way."""
    config = write_processor_config(
        tmp_path / "quota.yaml", {f"{TENANT}": TENANTS[TENANT]}, redis_url=redis_server.url
    )
    for key in redis_client.scan_iter(match=f"*{TENANT}*"):
        redis_client.delete(key)
    prefix = ["taskset", "-c", str(ONE_CPU)] if pinned else []
    processor = Processor.start(
        config, tmp_path, prefix=prefix, grpc_threads=flag, log_level="info"
    )
    try:
        chunks = stream_through(tmp_path, processor, simulators[0])
        policies = thread_policies(processor.process.pid)
        serving = [r for r in processor.log_records() if r.get("event") == "serving"]
    finally:
        processor.stop()
    assert [r["grpc_threads"] for r in serving] == [
        "batch" if grpc_policy == os.SCHED_BATCH else "normal"
    ]
    assert chunks >= STREAMS * 2  # every answer streamed (role chunk, content, finish)
    assert counter_value(redis_client, TENANT, "rpm", None) == STREAMS
    main_name, main_policy = policies.pop(processor.process.pid)
    assert main_policy == os.SCHED_OTHER, main_name
    engine = {tid: p for tid, (name, p) in policies.items() if name == "event_engine"}
    assert engine, policies  # the event engine's threads exist and are among those read
    grpc_threads = {tid: (n, p) for tid, (n, p) in policies.items() if n in GRPC_THREAD_NAMES}
    assert {p for _, p in grpc_threads.values()} == {grpc_policy}, grpc_threads


def test_a_thread_started_inside_the_block_takes_the_policy_and_its_starter_keeps_its_own() -> None:
    seen: dict[str, int] = {}

    def note(name: str) -> None:
        seen[name] = os.sched_getscheduler(0)

    before = os.sched_getscheduler(0)
    for policy in ("batch", "normal", "auto"):
        with threads_started_as(policy):
            started = threading.Thread(target=note, args=(policy,))
            started.start()
        started.join()
        assert os.sched_getscheduler(0) == before
    after = threading.Thread(target=note, args=("after",))
    after.start()
    after.join()
    auto = os.SCHED_BATCH if len(os.sched_getaffinity(0)) == 1 else before
    assert seen == {"batch": os.SCHED_BATCH, "normal": before, "auto": auto, "after": before}
    with pytest.raises(ValueError, match="unknown thread policy"), threads_started_as("fifo"):
        pass


def test_auto_takes_batch_only_where_the_process_may_run_on_one_cpu() -> None:
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert resolved("auto") == "batch"
    finally:
        os.sched_setaffinity(0, allowed)
    assert resolved("auto") == ("normal" if len(allowed) > 1 else "batch")
    assert (resolved("batch"), resolved("normal")) == ("batch", "normal")
