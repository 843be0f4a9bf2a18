"""Start the local stack in the foreground; Ctrl-C (or SIGTERM) stops every process by PID.

Envoy on :10000 → processor on :50051 → two simulators (:8001, :8002) and redis-server on
:6390 when it is installed, else the processor's in-memory backend.

Signals only set flags (a handler that raised could cut a stop short and print a
traceback): the first Ctrl-C or SIGTERM asks every process to stop (SIGTERM) and waits for
it; another one during that SIGKILLs whatever is still running. Each child runs in its own
session, so a terminal's Ctrl-C reaches this process alone and the stop order is ours.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import IO

from stack.envoy import EnvoyPorts, envoy_argv, render_bootstrap

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "simulator_profiles" / "fast.yaml"
STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM: then SIGKILL
TICK_S = 0.05


class StartFailed(Exception):
    pass


def say(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.stop_asked = False  # a first signal
        self.kill_asked = False  # a signal during the stop
        self.stopping = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.stop_asked = True
            return
        self.kill_asked = True
        for _, proc, _ in self.procs:
            if proc.returncode is None:  # not reaped: the PID is still this child's
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)

    def start(self, what: str, argv: list[str], port: int, timeout_s: float = 30) -> None:
        log = open(self.workdir / f"{what}.log", "wb")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((what, proc, log))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.stop_asked:
                raise StartFailed("interrupted")
            if proc.poll() is not None:
                raise StartFailed(f"{what} exited with {proc.returncode}: see {log.name}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise StartFailed(f"{what} did not open port {port}: see {log.name}") from None
                time.sleep(TICK_S)
        say(f"  {what:<12} pid {proc.pid:<7} 127.0.0.1:{port}   log {log.name}")

    def wait(self) -> str | None:
        """Until a signal or a process exits; the exited ones' names, if that was it."""
        while not self.stop_asked:
            dead = [what for what, proc, _ in self.procs if proc.poll() is not None]
            if dead:
                return ", ".join(dead)
            time.sleep(TICK_S)
        return None

    def stop(self) -> None:
        """SIGTERM to each process still running (Envoy first), then wait for all; a signal
        meanwhile, or STOP_TIMEOUT_S, SIGKILLs the rest."""
        self.stopping = True
        running = [(w, p) for w, p, _ in self.procs if p.poll() is None]
        if running:
            say(f"stopping {', '.join(w for w, _ in running)} (Ctrl-C again to kill them)")
        for _, proc in reversed(running):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for what, proc in running:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    say(f"  {what} did not stop in {STOP_TIMEOUT_S:g}s: killed")
                    proc.kill()
                    deadline = float("inf")
                time.sleep(TICK_S)
        for _, _, log in self.procs:
            log.close()
        if self.kill_asked:  # said here, once: the handler itself must not print
            say("interrupted again: killed what was still running")
        if self.procs:
            say(f"stopped: every process exited (logs in {self.workdir})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__)
    parser.add_argument("--listen-port", type=int, default=10000)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--processor-port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=9464)
    parser.add_argument("--simulator-ports", type=int, nargs=2, default=[8001, 8002])
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--config", type=Path, default=ROOT / "stack" / "quota.yaml")
    return parser.parse_args()


def start_all(stack: Stack, args: argparse.Namespace) -> None:
    redis_url = "memory://"
    redis = shutil.which("redis-server")
    if redis:
        stack.start(
            "redis",
            [redis, "--bind", "127.0.0.1", "--port", str(args.redis_port), "--save", "",
             "--appendonly", "no", "--dir", str(stack.workdir)],
            args.redis_port,
        )  # fmt: skip
        redis_url = f"redis://127.0.0.1:{args.redis_port}/0"
    else:
        say("  redis-server not on PATH: using the in-memory quota backend")
    for i, port in enumerate(args.simulator_ports):
        stack.start(
            f"simulator-{i + 1}",
            [sys.executable, "-m", "llmsim", "--config", str(args.profile), "--port", str(port)],
            port,
        )
    stack.start(
        "processor",
        [sys.executable, "-m", "extproc", "serve", "--config", str(args.config),
         "--listen", f"127.0.0.1:{args.processor_port}", "--redis-url", redis_url,
         "--metrics-listen", f"127.0.0.1:{args.metrics_port}"],
        args.processor_port,
    )  # fmt: skip
    envoy_config = stack.workdir / "envoy.yaml"
    envoy_config.write_text(
        render_bootstrap(
            EnvoyPorts(args.listen_port, args.admin_port),
            [args.processor_port],
            list(args.simulator_ports),
        )
    )
    stack.start("envoy", envoy_argv(envoy_config, base_id=args.listen_port), args.listen_port)


def ready_text(args: argparse.Namespace) -> str:
    url = f"http://127.0.0.1:{args.listen_port}"
    return f"""
ready. Envoy listens on {url}; processor metrics on http://127.0.0.1:{args.metrics_port}/metrics

curl:
  curl -sN {url}/v1/chat/completions -H 'Authorization: Bearer sk-demo-free' \\
    -H 'Content-Type: application/json' \\
    -d '{{"model":"gpt-4.1","stream":true,"max_tokens":50,
         "messages":[{{"role":"user","content":"hi"}}]}}'

openai SDK:
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="sk-demo-free")
  for chunk in client.chat.completions.create(model="my-gpt-alias", stream=True, max_tokens=50,
                                              messages=[{{"role": "user", "content": "hi"}}]):
      print(chunk.choices[0].delta.content or "", end="")

benchmark it:
  extproc bench --target {url} --api-key sk-demo-pro --levels 1,10 --requests 20

Ctrl-C stops everything."""


def main() -> int:
    args = parse_args()
    stack = Stack(Path(tempfile.mkdtemp(prefix="quota-stack-")))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stack.on_signal)
    say(f"starting the local stack (logs in {stack.workdir})")
    status = 0
    try:
        start_all(stack, args)
    except (StartFailed, OSError) as exc:
        if stack.stop_asked:
            say("interrupted while starting")
            status = 130
        else:
            say(f"start-up failed: {exc}", err=True)
            status = 1
    else:
        say(ready_text(args))
        dead = stack.wait()
        if dead is not None:
            say(f"stopped: {dead} exited", err=True)
            status = 1
    stack.stop()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
