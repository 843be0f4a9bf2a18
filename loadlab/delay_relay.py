"""A delaying TCP relay: a server far away, seen from loopback.

    python -m loadlab.delay_relay --upstream 127.0.0.1:6379 --listen 127.0.0.1:7000 --rtt-ms 50

Every connection accepted on ``--listen`` gets one of its own to ``--upstream``; the bytes
each way are written ``rtt / 2`` after they arrived, so a request and its reply take at
least ``rtt`` more than direct. Order is kept per direction (one queue and one timer each,
never a timer per chunk: asyncio does not order timers due at the same instant), and
nothing is merged or split that a byte stream could tell apart. A half-close or close is
passed on after the same delay, behind the bytes sent before it.

A timer fires late on a busy machine, never early: the relay records how late each chunk
went out (``lateness``), written as JSON to ``--stats`` when it stops (SIGTERM), so a
benchmark can tell what the relay added beyond the delay it was given. ``RelayProcess``
starts one as a child process (its own core time, off the load generator's event loop) and
``ping_rtt_ms`` times Redis PINGs through it.

No back-pressure: meant for request/reply protocols such as Redis, not bulk transfers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import selectors
import signal
import socket
import sys
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from loadlab.procs import ManagedProcess, free_port

# Queued after the bytes: the peer half-closed (FIN) / its connection ended.
_EOF, _CLOSE = "eof", "close"


class _Direction:
    """The bytes of one direction of one connection, each chunk written ``delay_s`` after it
    arrived, in arrival order."""

    def __init__(self, relay: DelayRelay) -> None:
        self.relay = relay
        self.loop = asyncio.get_running_loop()
        self.queue: deque[tuple[float, bytes | str]] = deque()
        self.target: asyncio.Transport | None = None  # None until the upstream is connected
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False

    def push(self, data: bytes | str) -> None:
        self.queue.append((self.loop.time() + self.relay.delay_s, data))
        self._arm()

    def attach(self, target: asyncio.Transport) -> None:
        self.target = target
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and self.queue and self.target is not None and not self.closed:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        assert self.target is not None
        now = self.loop.time()
        # asyncio may run a timer up to its clock resolution early: a chunk not yet due
        # waits for the next turn, so none ever goes out before its delay.
        while self.queue and self.queue[0][0] <= now:
            due, data = self.queue.popleft()
            if isinstance(data, str) and data == _CLOSE:
                self.closed = True
                self.queue.clear()
                self.target.close()  # written what it holds, then closed
                return
            if isinstance(data, str):  # _EOF
                if self.target.can_write_eof():
                    self.target.write_eof()
                continue
            self.relay.lateness.append(now - due)
            self.target.write(data)
            self.relay.bytes_relayed += len(data)
        self._arm()


class _Side(asyncio.Protocol):
    """One end of a relayed connection: what it receives goes to ``out``."""

    def __init__(self, out: _Direction) -> None:
        self.out = out

    def data_received(self, data: bytes) -> None:
        self.out.push(data)

    def eof_received(self) -> bool:
        self.out.push(_EOF)
        return True  # half-closed: the other way may still carry replies

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.out.closed:
            self.out.push(_CLOSE)


class DelayRelay:
    """The relay inside this process's event loop (``await relay.start()``)."""

    def __init__(
        self, upstream: tuple[str, int], rtt_ms: float, listen: tuple[str, int] = ("127.0.0.1", 0)
    ) -> None:
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        self.upstream = upstream
        self.listen = listen
        self.delay_s = rtt_ms / 2000  # each way
        self.lateness = array("d")  # seconds past due, per chunk written
        self.bytes_relayed = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._accept, *self.listen)

    def _accept(self) -> _Side:
        self.connections += 1
        up, down = _Direction(self), _Direction(self)  # client → upstream, upstream → client
        return _Client(self, up, down)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def stats(self) -> dict[str, Any]:
        late = sorted(self.lateness)

        def at(p: float) -> float | None:
            return round(late[min(len(late) - 1, int(p * len(late)))] * 1000, 3) if late else None

        return {
            "rtt_ms": self.delay_s * 2000,
            "connections": self.connections,
            "chunks": len(late),
            "bytes": self.bytes_relayed,
            "lateness_ms": {"p50": at(0.5), "p99": at(0.99), "max": at(1.0)},
        }


class _Client(_Side):
    """The accepted end: connects its own upstream, which gets what arrived meanwhile."""

    def __init__(self, relay: DelayRelay, up: _Direction, down: _Direction) -> None:
        super().__init__(up)
        self.relay, self.down = relay, down
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.down.attach(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(
                lambda: _Side(self.down), *self.relay.upstream
            )
        except OSError:
            assert self.transport is not None
            self.transport.close()
            return
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out.attach(transport)


# -- as a process --------------------------------------------------------------------------


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _serve(args: argparse.Namespace) -> None:
    relay = DelayRelay(_address(args.upstream), args.rtt_ms, _address(args.listen))
    await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"relaying 127.0.0.1:{relay.port} -> {args.upstream}, rtt {args.rtt_ms:g} ms", flush=True)
    await stop.wait()
    await relay.close()
    if args.stats is not None:
        Path(args.stats).write_text(json.dumps(relay.stats()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadlab.delay_relay", description=__doc__)
    p.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (default: a free port)")
    p.add_argument("--rtt-ms", type=float, required=True, help="round trip added (rtt/2 each way)")
    p.add_argument("--stats", help="write the relay's figures here as JSON when it stops")
    args = p.parse_args(argv)

    # select() takes its timeout in µs; epoll and poll round it up to whole ms, which would
    # add up to a millisecond each way to a 1 ms round trip. A relay holds few sockets.
    def loop_factory() -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.SelectSelector())

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(args))
    return 0


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class RelayProcess:
    """``python -m loadlab.delay_relay`` as a child process on a free loopback port."""

    def __init__(self, upstream_port: int, rtt_ms: float, log_dir: Path) -> None:
        self.rtt_ms = rtt_ms
        self.port = free_port()
        self.stats_path = log_dir / f"relay-{self.port}.json"
        argv = [
            sys.executable, "-m", "loadlab.delay_relay",
            "--upstream", f"127.0.0.1:{upstream_port}",
            "--listen", f"127.0.0.1:{self.port}",
            "--rtt-ms", str(rtt_ms),
            "--stats", str(self.stats_path),
        ]  # fmt: skip
        self.process = ManagedProcess(argv, log_dir / f"relay-{self.port}.log")
        try:
            self.process.wait_ready(lambda: _accepts(self.port), timeout_s=15)
        except BaseException:
            self.process.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> int:
        return self.process.stop()

    def stats(self) -> dict[str, Any] | None:
        """The figures it wrote when it stopped (None: not stopped, or it wrote none)."""
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(self.stats_path.read_text()))
        return None


def ping_rtt_ms(port: int, count: int = 20, timeout_s: float = 10.0) -> list[float]:
    """Wall-clock ms of ``count`` Redis PINGs in turn on one connection to ``port``."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            started = time.perf_counter()
            sock.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    raise ConnectionError("closed before +PONG")
                reply += chunk
            out.append((time.perf_counter() - started) * 1000)
            if reply != b"+PONG\r\n":
                raise ConnectionError(f"not a PONG: {reply!r}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
