"""The deployment's own files run together on loopback (the ``deployed`` fixture): Envoy on
deploy/envoy/envoy.yaml, two processors on deploy/extproc/quota.yaml sharing one Redis, llmsim
on deploy/llm-sim/fast.yaml. Then the local stack of ``bash scripts/stack.sh`` as a user runs
it: benchmarked through its front door, and stopped with Ctrl-C twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import openai
import pytest
import yaml

from loadlab.procs import free_port
from tests.deploy.conftest import DEPLOY, PRO_KEY, ROOT, Deployed
from tests.tools.conftest import alive, children


def test_both_processors_are_health_checked_endpoints_of_envoy(deployed: Deployed):
    assert [deployed.envoy.processor_health(p.port) for p in deployed.processors] == [
        "healthy",
        "healthy",
    ]


def test_a_streamed_request_through_the_deployed_files_is_metered(deployed: Deployed):
    client = openai.OpenAI(base_url=f"{deployed.base_url}/v1", api_key=PRO_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="my-gpt-alias",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    # fast.yaml: one token per event, so the usage the client is shown counts the events.
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(pieces) >= 1
    assert {c.model for c in chunks} == {"gpt-4.1"}  # the quota model's upstream name


def test_the_deployed_quota_file_authenticates_and_answers_openai_errors(deployed: Deployed):
    body = json.dumps({"model": "gpt-4.1", "messages": [{"role": "user", "content": "x"}]})
    request = urllib.request.Request(
        f"{deployed.base_url}/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-not-a-key"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["type"]
    request.add_header("Authorization", f"Bearer {PRO_KEY}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["x-ratelimit-limit-requests"]
        assert json.loads(reply.read())["usage"]["completion_tokens"] >= 1


def test_the_deployed_profile_serves_the_quota_files_models(deployed: Deployed):
    with urllib.request.urlopen(deployed.sim.url("/v1/models"), timeout=30) as reply:
        served = {m["id"] for m in json.loads(reply.read())["data"]}
    quota = yaml.safe_load((DEPLOY / "extproc" / "quota.yaml").read_text())
    for name, model in quota["models"].items():
        assert {name, *model.get("aliases", [])} <= served
    assert Path(deployed.sim.profile) == DEPLOY / "llm-sim" / "fast.yaml"


# --- the local stack (bash scripts/stack.sh), as a user starts and stops it ----------------


class Lines:
    """A child's output lines as they come, read by a thread; ``wait_for`` a line."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<eof>")
            self._changed.notify_all()

    def wait_for(self, start: str, timeout_s: float = 180) -> str:
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(x.startswith((start, "<eof>")) for x in self.lines), timeout_s
            )
            line = next((x for x in self.lines if x.startswith((start, "<eof>"))), "")
        assert found and line != "<eof>", "\n".join(self.lines[-40:])
        return line

    def text(self) -> str:
        self._thread.join(30)
        return "\n".join(self.lines)


@dataclass
class LocalStack:
    proc: subprocess.Popen[str]
    out: Lines
    err: Lines
    url: str
    pids: dict[str, int]


@pytest.fixture(scope="module")
def local_stack() -> Iterator[LocalStack]:
    ports = [free_port() for _ in range(7)]
    argv = [
        "bash", str(ROOT / "scripts" / "stack.sh"),
        "--listen-port", str(ports[0]), "--admin-port", str(ports[1]),
        "--processor-port", str(ports[2]), "--metrics-port", str(ports[3]),
        "--simulator-ports", str(ports[4]), str(ports[5]), "--redis-port", str(ports[6]),
    ]  # fmt: skip
    # Its own session and process group: a terminal's Ctrl-C goes to the group.
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, err = Lines(proc.stdout), Lines(proc.stderr)  # type: ignore[arg-type]
    pids: dict[str, int] = {}
    try:
        out.wait_for("ready.")
        for line in out.lines:
            words = line.split()
            if len(words) > 2 and words[1] == "pid":
                pids[words[0]] = int(words[2])
        yield LocalStack(proc, out, err, f"http://127.0.0.1:{ports[0]}", pids)
    finally:
        leftovers = children(proc.pid) | set(pids.values())
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in leftovers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_bench_measures_the_running_stack(local_stack: LocalStack, tmp_path: Path) -> None:
    """The README's stack through its front door, as a user benchmarks a gateway: its
    simulators stamp nothing, so the client's own figures are all there is."""
    assert set(local_stack.pids) == {"redis", "simulator-1", "simulator-2", "processor", "envoy"}
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "bench", "--target", local_stack.url,
         "--api-key", PRO_KEY, "--levels", "1,2", "--requests", "4", "--rounds", "1",
         "--output-tokens", "12", "--warmup-requests", "1", "--out", str(tmp_path / "r"),
         "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "r" / "summary.json").read_text())["results"]
    assert [(r["level"], r["completed"], r["total_output_tokens"]) for r in rows] == [
        (1, 4, 48),
        (2, 4, 48),
    ]
    for row in rows:
        assert 0 < row["ttft_ms"]["p50"] <= row["e2el_ms"]["p50"]
        assert row["itl_ms"]["count"] == 4 * 11 and row["chunk_latency_ms"]["count"] == 0


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_stop_kills_the_rest_quietly(local_stack: LocalStack) -> None:
    """Ctrl-C, and Ctrl-C again while the processor drains (its 3 s drain delay): every
    process is gone, nothing printed a traceback. Last in this file: it stops the stack."""
    pids = set(local_stack.pids.values()) | children(local_stack.proc.pid)
    assert len(pids) >= 5 and all(alive(p) for p in pids)
    os.killpg(local_stack.proc.pid, signal.SIGINT)
    local_stack.out.wait_for("stopping ")
    os.killpg(local_stack.proc.pid, signal.SIGINT)  # during the stop: the drain takes 3 s
    assert local_stack.proc.wait(60) == 0
    out, err = local_stack.out.text(), local_stack.err.text()
    assert "interrupted again: killed what was still running" in out
    assert "stopped: every process exited" in out
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert [p for p in pids if alive(p)] == []
