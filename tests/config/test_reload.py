"""Hot configuration reload against a real processor process (``extproc serve``): SIGHUP,
the content poll (an edit, a ConfigMap symlink swap), bad files and restart-only fields."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadlab.gateway import Processor, key_hash, write_config
from loadlab.procs import free_port_run
from loadlab.redis_server import RedisServer
from tests.support.reloading import (
    ADMITTED,
    ConfigMapDir,
    admit,
    metric,
    records,
    start_processor,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
WINDOW_S = 3600  # no limit resets in the middle of a test
MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 64}}


def key(tenant: str) -> str:
    return f"sk-reload-{tenant}"


def config(limits: dict[str, int], **top: Any) -> dict[str, Any]:
    """One tenant per entry of ``limits`` (tenant -> rpm), each with its own plan and key."""
    return {
        "redis_url": "memory://",
        "drain_delay_s": 0,
        "models": MODELS,
        "plans": {
            t: {"window_s": WINDOW_S, "limits": {"*": {"rpm": n}}} for t, n in limits.items()
        },
        "tenants": {t: {"plan": t, "key_sha256": [key_hash(key(t))]} for t in limits},
        **top,
    }


def config_hash(path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(path)],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    return orjson.loads(out.stdout)["config_hash"]


@pytest.fixture()
def processors() -> Iterator[list[Processor]]:
    started: list[Processor] = []
    yield started
    for p in started:
        p.stop()


def sighup_and_wait(processor: Processor, counter: str) -> None:
    """SIGHUP, then wait until ``counter`` (reloads or failures) went up by one."""
    before = metric(processor, counter)
    processor.process.signal(signal.SIGHUP)
    wait_for(lambda: metric(processor, counter) == before + 1, f"{counter} > {before}")


def test_sighup_installs_new_limits_removes_and_adds_keys(
    tmp_path: Path, processors: list[Processor]
) -> None:
    path = write_config(tmp_path / "quota.yaml", config({"alpha": 100, "gone": 100}))
    hash_a = config_hash(path)
    processors.append(p := start_processor(path, tmp_path))
    assert [admit(p.port, key("alpha"))[0] for _ in range(3)] == [ADMITTED] * 3
    assert admit(p.port, key("gone"))[0] == ADMITTED
    assert admit(p.port, key("fresh"))[0] == 401

    # B: alpha's RPM below what it used already, "gone" removed, "fresh" added.
    write_config(path, config({"alpha": 2, "fresh": 100}))
    hash_b = config_hash(path)
    sighup_and_wait(p, "config_reloads_total")

    status, body = admit(p.port, key("alpha"))
    assert (status, body["error"]["code"]) == (429, "rpm_limit_exceeded")
    assert "limit 2 requests per hour" in body["error"]["message"]
    assert admit(p.port, key("gone"))[0] == 401
    assert admit(p.port, key("fresh"))[0] == ADMITTED
    [line] = records(p, "config_reloaded")
    assert (line["old_hash"], line["new_hash"], line["trigger"]) == (hash_a, hash_b, "sighup")
    assert metric(p, "config_reload_failures_total") == 0

    # The same content again: nothing to install, not counted as a reload.
    p.process.signal(signal.SIGHUP)
    wait_for(lambda: len(records(p, "config_unchanged")) == 1, "config_unchanged")
    assert metric(p, "config_reloads_total") == 1
    assert records(p, "config_unchanged")[0]["hash"] == hash_b


def test_an_edited_file_and_a_configmap_symlink_swap_are_reloaded_without_a_signal(
    tmp_path: Path, processors: list[Processor]
) -> None:
    mount = ConfigMapDir(tmp_path / "mount", config({"alpha": 100}))
    processors.append(p := start_processor(mount.path, tmp_path, poll_s=0.05))
    assert admit(p.port, key("alpha"))[0] == ADMITTED
    assert admit(p.port, key("beta"))[0] == 401

    # The kubelet's update: a new directory, then ..data renamed over in one step.
    mount.update(config({"alpha": 100, "beta": 100}))
    wait_for(lambda: metric(p, "config_reloads_total") == 1, "the swap to be reloaded")
    assert admit(p.port, key("beta"))[0] == ADMITTED
    assert records(p, "config_reloaded")[-1]["trigger"] == "file_change"

    # An edit in place of the file the symlinks lead to.
    write_config(mount.root / "..data" / "quota.yaml", config({"beta": 100}))
    wait_for(lambda: metric(p, "config_reloads_total") == 2, "the edit to be reloaded")
    assert admit(p.port, key("alpha"))[0] == 401
    assert admit(p.port, key("beta"))[0] == ADMITTED
    assert metric(p, "config_reload_failures_total") == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plans: [unclosed\n", "invalid YAML"),
        (orjson.dumps(config({"alpha": 1}, retry_budget=3)).decode(), "retry_budget: unknown"),
        (
            orjson.dumps(
                config({"alpha": 1}, models={"gpt-4.1": {"tokenizer": "o300k_base"}})
            ).decode(),
            "tokenizer 'o300k_base' cannot be loaded",
        ),
    ],
    ids=["yaml_error", "schema_error", "unknown_tokenizer"],
)
def test_a_bad_file_is_logged_counted_and_the_old_configuration_stays(
    tmp_path: Path, processors: list[Processor], text: str, message: str
) -> None:
    path = write_config(tmp_path / "quota.yaml", config({"alpha": 100, "beta": 100}))
    hash_a = config_hash(path)
    processors.append(p := start_processor(path, tmp_path, poll_s=0.05))
    assert admit(p.port, key("alpha"))[0] == ADMITTED

    path.write_text(text)  # seen by the poll: reported once, not at every poll
    wait_for(lambda: metric(p, "config_reload_failures_total") == 1, "the failure")
    [failure] = records(p, "config_reload_failed")
    assert message in failure["error"], failure
    assert failure["hash"] == hash_a
    # A's limits (alpha: 100 RPM) and keys (beta) still hold.
    assert [admit(p.port, key("alpha"))[0] for _ in range(3)] == [ADMITTED] * 3
    assert admit(p.port, key("beta"))[0] == ADMITTED
    sighup_and_wait(p, "config_reload_failures_total")  # asked again: refused again
    assert metric(p, "config_reload_failures_total") == 2
    assert metric(p, "config_reloads_total") == 0


def test_a_restart_only_field_is_refused_naming_it(
    tmp_path: Path, processors: list[Processor]
) -> None:
    path = write_config(tmp_path / "quota.yaml", config({"alpha": 100}))
    processors.append(p := start_processor(path, tmp_path))
    # Limits change too: nothing of the file applies when one field can't.
    write_config(path, config({"alpha": 1, "beta": 100}, key_prefix="tq2", quota_timeout_ms=500))
    sighup_and_wait(p, "config_reload_failures_total")
    [failure] = records(p, "config_reload_failed")
    assert failure["error"] == (
        "key_prefix, quota_timeout_ms: cannot change while running (needs a restart)"
    )
    assert [admit(p.port, key("alpha"))[0] for _ in range(2)] == [ADMITTED] * 2
    assert admit(p.port, key("beta"))[0] == 401
    assert metric(p, "config_reloads_total") == 0


def test_the_supervisor_passes_sighup_to_every_worker(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    from loadlab.gateway import grpc_serving, http_get
    from loadlab.procs import ManagedProcess

    path = write_config(tmp_path / "quota.yaml", config({"alpha": 100}, redis_url=redis_server.url))
    port, metrics = free_port_run(1), free_port_run(2)
    supervisor = ManagedProcess(
        [
            sys.executable, "-m", "extproc", "serve", "--workers", "2",
            "--config", str(path),
            "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", f"127.0.0.1:{metrics}",
            "--config-poll-s", "0",  # only the signal can reload
        ],
        tmp_path / "supervisor.log",
        cwd=ROOT,
    )  # fmt: skip

    def reloads(worker: int) -> float | None:
        try:
            _, text = http_get(f"http://127.0.0.1:{metrics + worker}/metrics", 1.0)
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("extproc_config_reloads_total "):
                return float(line.split()[1])
        return None

    try:
        supervisor.wait_ready(
            lambda: grpc_serving(port) and reloads(0) == 0 and reloads(1) == 0, timeout_s=60
        )
        assert admit(port, key("beta"))[0] == 401
        write_config(path, config({"alpha": 100, "beta": 100}, redis_url=redis_server.url))
        supervisor.signal(signal.SIGHUP)
        wait_for(lambda: reloads(0) == 1 and reloads(1) == 1, "both workers to reload")
        # Whichever worker takes the connection knows the new key.
        assert [admit(port, key("beta"))[0] for _ in range(4)] == [ADMITTED] * 4
        assert supervisor.proc.poll() is None
    finally:
        assert supervisor.stop(30) == 0


def test_a_rotated_upstream_key_file_is_read_again_on_sighup_with_the_same_hash(
    tmp_path: Path, processors: list[Processor]
) -> None:
    secret = tmp_path / "upstream.key"
    secret.write_text("sk-upstream-1\n")
    models = {"gpt-4.1": {**MODELS["gpt-4.1"], "upstream_api_key_file": str(secret)}}
    path = write_config(tmp_path / "quota.yaml", config({"alpha": 100}, models=models))
    processors.append(p := start_processor(path, tmp_path))
    assert admit(p.port, key("alpha"))[1]["authorization"] == "Bearer sk-upstream-1"

    secret.write_text("sk-upstream-2\n")  # only the secret changed: the hash doesn't show it
    sighup_and_wait(p, "config_reloads_total")
    [line] = records(p, "config_reloaded")
    assert line["old_hash"] == line["new_hash"]
    assert admit(p.port, key("alpha"))[1]["authorization"] == "Bearer sk-upstream-2"
