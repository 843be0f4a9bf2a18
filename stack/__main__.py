"""Start the local stack in the foreground; Ctrl-C (or SIGTERM) stops every process by PID.

Envoy on :10000 → processor on :50051 → two simulators (:8001, :8002) and redis-server on
:6390 when it is installed, else the processor's in-memory backend.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stack.envoy import EnvoyPorts, envoy_argv, render_bootstrap

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "simulator_profiles" / "fast.yaml"


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{what} did not open port {port}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__)
    parser.add_argument("--listen-port", type=int, default=10000)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--processor-port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=9464)
    parser.add_argument("--simulator-ports", type=int, nargs=2, default=[8001, 8002])
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--config", type=Path, default=ROOT / "stack" / "quota.yaml")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="quota-stack-"))
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(what: str, argv: list[str], port: int) -> None:
        log = open(workdir / f"{what}.log", "wb")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((what, proc))
        _wait_port(port, proc, what)
        print(f"  {what:<12} pid {proc.pid:<7} 127.0.0.1:{port}   log {workdir / (what + '.log')}")

    def stop_all(*_: object) -> None:
        for _what, proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _what, proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop_all)
    print(f"starting the local stack (logs in {workdir})")
    try:
        redis_url = "memory://"
        redis = shutil.which("redis-server")
        if redis:
            start(
                "redis",
                [redis, "--bind", "127.0.0.1", "--port", str(args.redis_port), "--save", "",
                 "--appendonly", "no", "--dir", str(workdir)],
                args.redis_port,
            )  # fmt: skip
            redis_url = f"redis://127.0.0.1:{args.redis_port}/0"
        else:
            print("  redis-server not on PATH: using the in-memory quota backend")
        for i, port in enumerate(args.simulator_ports):
            start(
                f"simulator-{i + 1}",
                [
                    sys.executable,
                    "-m",
                    "llmsim",
                    "--config",
                    str(args.profile),
                    "--port",
                    str(port),
                ],
                port,
            )
        start(
            "processor",
            [sys.executable, "-m", "extproc", "serve", "--config", str(args.config),
             "--listen", f"127.0.0.1:{args.processor_port}", "--redis-url", redis_url,
             "--metrics-listen", f"127.0.0.1:{args.metrics_port}"],
            args.processor_port,
        )  # fmt: skip
        envoy_config = workdir / "envoy.yaml"
        envoy_config.write_text(
            render_bootstrap(
                EnvoyPorts(args.listen_port, args.admin_port),
                [args.processor_port],
                list(args.simulator_ports),
            )
        )
        start("envoy", envoy_argv(envoy_config, base_id=args.listen_port), args.listen_port)
    except (SystemExit, KeyboardInterrupt, OSError) as exc:
        print(f"start-up failed: {exc}", file=sys.stderr)
        stop_all()
        return 1

    url = f"http://127.0.0.1:{args.listen_port}"
    print(
        f"""
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

Ctrl-C stops everything."""
    )
    try:
        while all(proc.poll() is None for _, proc in procs):
            time.sleep(0.5)
        dead = [what for what, proc in procs if proc.poll() is not None]
        print(f"stopped: {', '.join(dead)} exited", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
