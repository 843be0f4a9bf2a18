"""A real Redis Cluster (3 masters, 1 replica each) and a Sentinel set-up, stopped by PID.

Every process is a ``redis-server`` on a free loopback port with its data directory under
the test's tmp path and persistence off. Readiness and failovers are waited for on what the
servers report (``CLUSTER INFO``, ``CLUSTER NODES``, ``ROLE``, ``SENTINEL
get-master-addr-by-name``), polled with generous deadlines, never fixed sleeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from extproc.quota.keys import tenant_tag
from loadlab.procs import ManagedProcess, free_port
from loadlab.redis_server import REDIS_SERVER, accepts_connections

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000  # cluster-node-timeout: a dead master is failed over ~2-3 s later
DOWN_AFTER_MS = 1000  # Sentinel's down-after-milliseconds
FAILOVER_TIMEOUT_MS = 3000


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """Poll ``check`` until it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (redis.RedisError, OSError) as exc:
            last = exc
        else:
            if result:
                return result
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached after {timeout_s}s (last error: {last!r})")


def _client(port: int) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2,
        socket_connect_timeout=2,
    )  # fmt: skip


@dataclass
class Node:
    port: int
    process: ManagedProcess
    stopped: bool = False  # SIGSTOPped by a test

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return _client(self.port)

    def pause(self) -> None:
        self.process.signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.process.signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        self.process.signal(signal.SIGKILL)
        self.process.proc.wait(10)

    def restart(self) -> ManagedProcess:
        """A killed node started again on its port and data directory (empty: persistence
        off; its cluster config file says who it was). Returns the new process."""
        log = self.process.log_path
        self.process.stop()
        self.process = ManagedProcess(self.process.argv, log.with_name(f"{log.stem}-again.log"))
        self.stopped = False
        try:
            self.process.wait_ready(lambda: accepts_connections(self.port), timeout_s=15.0)
        except BaseException:
            self.process.stop()
            raise
        return self.process

    def stop(self) -> None:
        if self.stopped:
            self.resume()
        self.process.stop()


def _start_server(directory: Path, port: int, extra: list[str]) -> Node:
    directory.mkdir(parents=True, exist_ok=True)
    argv = [
        REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
        "--appendonly", "no", "--dir", str(directory), *extra,
    ]  # fmt: skip
    process = ManagedProcess(argv, directory / "redis.log")
    node = Node(port, process)
    try:
        process.wait_ready(lambda: accepts_connections(port), timeout_s=15.0)
    except BaseException:
        process.stop()
        raise
    return node


class RedisClusterSet:
    """Six ``--cluster-enabled`` servers joined by ``redis-cli --cluster create``."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    @classmethod
    def start(cls, directory: Path, masters: int = 3) -> RedisClusterSet:
        nodes: list[Node] = []
        try:
            for i in range(masters * 2):
                port = free_port()
                nodes.append(
                    _start_server(
                        directory / f"node-{i}",
                        port,
                        [
                            "--cluster-enabled", "yes",
                            "--cluster-config-file", f"nodes-{port}.conf",
                            # Its own free bus port: port + 10000 may be taken or too high.
                            "--cluster-port", str(free_port()),
                            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                            # A replica may be promoted however long its link was down.
                            "--cluster-replica-validity-factor", "0",
                            # The other masters keep serving their slots while one is
                            # failed (the default, yes, refuses every slot meanwhile).
                            "--cluster-require-full-coverage", "no",
                        ],
                    )
                )  # fmt: skip
            cluster = cls(nodes)
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(n.address for n in nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
            cluster.wait_healthy(masters)
            return cluster
        except BaseException:
            for node in nodes:
                node.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.process.proc.poll() is None and not n.stopped]

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def topology(self) -> dict[int, list[int]]:
        """Live master port → its live replicas' ports, from ``CLUSTER NODES`` of a live node."""
        for node in self.live_nodes():
            try:
                nodes = node.client().execute_command("CLUSTER NODES")
            except redis.RedisError:
                continue
            ports = {v["node_id"]: int(addr.rsplit(":", 1)[1]) for addr, v in nodes.items()}
            masters: dict[int, list[int]] = {}
            for v in nodes.values():
                flags = v["flags"].split(",")
                if "master" in flags and "fail" not in flags and v["slots"]:
                    masters[ports[v["node_id"]]] = []
            for v in nodes.values():
                flags = v["flags"].split(",")
                master = ports.get(v["master_id"])
                if "slave" in flags and "fail" not in flags and master in masters:
                    masters[master].append(ports[v["node_id"]])
            return masters
        raise RuntimeError("no live cluster node answers")

    def _all_ok(self) -> bool:
        """Every live node says the cluster is ok and every slot served by a live master
        (with ``cluster-require-full-coverage no`` the state stays ok without the latter)."""

        def ok(info: dict[str, Any]) -> bool:
            return info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == 16384

        return all(ok(n.client().execute_command("CLUSTER INFO")) for n in self.live_nodes())

    def wait_healthy(self, masters: int = 3, timeout_s: float = 60.0) -> None:
        """``cluster_state:ok`` on every live node, ``masters`` masters with slots."""

        def healthy() -> bool:
            return self._all_ok() and len(self.topology()) == masters

        wait_for(healthy, "cluster_state:ok on every node", timeout_s)

    def wait_replicas_synced(self, timeout_s: float = 60.0) -> None:
        """Every master has a replica whose link is up (ROLE), so a failover can happen."""

        def synced() -> bool:
            topology = self.topology()
            for master, replicas in topology.items():
                if not replicas:
                    return False
                for port in replicas:
                    role = self.node(port).client().execute_command("ROLE")
                    if role[0] != "slave" or role[3] != "connected":
                        return False
                del master
            return True

        wait_for(synced, "every replica connected", timeout_s)

    def master_of(self, key: str) -> int:
        """Port of the master that holds ``key``'s slot now."""
        slot = int(self.live_nodes()[0].client().execute_command("CLUSTER KEYSLOT", key))
        for node in self.live_nodes():
            try:
                shards = node.client().execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            for start, end, master, *_ in shards:
                if start <= slot <= end:
                    return int(master[1])
        raise RuntimeError(f"no master holds slot {slot}")

    def tenants_on_masters(
        self, per_master: int = 2, stem: str = "tenant-"
    ) -> dict[int, list[str]]:
        """Tenant names (``<stem><i>``) whose hash tags land on each master, ``per_master``
        each (checked with CLUSTER KEYSLOT / SLOTS)."""
        by_master: dict[int, list[str]] = {port: [] for port in self.topology()}
        i = 0
        while any(len(v) < per_master for v in by_master.values()):
            tenant = f"{stem}{i}"
            i += 1
            found = by_master.setdefault(self.master_of(tenant_tag(tenant)), [])
            if len(found) < per_master:
                found.append(tenant)
        return by_master

    def wait_master_changed(self, old_port: int, timeout_s: float = 60.0) -> int:
        """Once ``old_port``'s former slots are served by a new master, every node agreeing."""

        def changed() -> bool:
            return old_port not in self.topology() and self._all_ok()

        wait_for(changed, f"master {old_port} failed over", timeout_s)
        return 0

    def wait_rejoined(self, port: int, master: int, timeout_s: float = 60.0) -> None:
        """Once the node on ``port`` is a connected replica of ``master`` and every node
        says the cluster is ok (a restarted master learns from its peers that it lost its
        slots, and syncs from the replica that took them)."""

        def rejoined() -> bool:
            role = self.node(port).client().execute_command("ROLE")
            return (
                role[0] == "slave"
                and int(role[2]) == master
                and role[3] == "connected"
                and port in self.topology().get(master, [])
                and self._all_ok()
            )

        wait_for(rejoined, f"node {port} a replica of {master}", timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelSet:
    """One master, one replica, three sentinels (quorum 2)."""

    def __init__(self, data: list[Node], sentinels: list[Node], service: str) -> None:
        self.data = data
        self.sentinels = sentinels
        self.service = service

    @classmethod
    def start(cls, directory: Path, service: str = "quota") -> SentinelSet:
        data: list[Node] = []
        sentinels: list[Node] = []
        try:
            master = _start_server(directory / "master", free_port(), [])
            data.append(master)
            data.append(
                _start_server(
                    directory / "replica",
                    free_port(),
                    ["--replicaof", "127.0.0.1", str(master.port)],
                )
            )
            for i in range(3):
                port = free_port()
                conf_dir = directory / f"sentinel-{i}"
                conf_dir.mkdir(parents=True, exist_ok=True)
                conf = conf_dir / "sentinel.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {conf_dir}\n"
                    f"sentinel monitor {service} 127.0.0.1 {master.port} 2\n"
                    f"sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}\n"
                    f"sentinel failover-timeout {service} {FAILOVER_TIMEOUT_MS}\n"
                    f"sentinel parallel-syncs {service} 1\n"
                )
                process = ManagedProcess([REDIS_SERVER, str(conf), "--sentinel"], conf_dir / "log")
                node = Node(port, process)
                sentinels.append(node)
                process.wait_ready(lambda port=port: accepts_connections(port), timeout_s=15.0)
            found = cls(data, sentinels, service)
            found.wait_ready()
            return found
        except BaseException:
            for node in sentinels + data:
                node.stop()
            raise

    @property
    def url(self) -> str:
        return (
            "redis+sentinel://" + ",".join(s.address for s in self.sentinels) + f"/{self.service}"
        )

    def master_port(self) -> int:
        """The master every live sentinel names (0 while they disagree)."""
        ports = set()
        for sentinel in self.sentinels:
            if sentinel.process.proc.poll() is not None:
                continue
            addr = sentinel.client().execute_command(
                "SENTINEL", "get-master-addr-by-name", self.service
            )
            ports.add(int(addr[1]))
        return ports.pop() if len(ports) == 1 else 0

    def node(self, port: int) -> Node:
        return next(n for n in self.data if n.port == port)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Each sentinel knows the other two and a replica with its link up."""

        def ready() -> bool:
            master = self.master_port()
            if not master:
                return False
            for sentinel in self.sentinels:
                client = sentinel.client()
                others = client.execute_command("SENTINEL", "sentinels", self.service)
                replicas = client.execute_command("SENTINEL", "replicas", self.service)
                if len(others) < 2 or not replicas:
                    return False
                flags = [_field(r, "flags") for r in replicas]
                if not any(f == "slave" for f in flags):
                    return False
            replica = next(n for n in self.data if n.port != master and not n.stopped)
            role = replica.client().execute_command("ROLE")
            return role[0] == "slave" and role[3] == "connected"

        wait_for(ready, "Sentinel set-up ready", timeout_s)

    def wait_master_changed(self, old_port: int, timeout_s: float = 60.0) -> int:
        def changed() -> int:
            port = self.master_port()
            if not port or port == old_port:
                return 0
            role = self.node(port).client().execute_command("ROLE")
            return port if role[0] == "master" else 0

        return int(wait_for(changed, f"Sentinel failover away from {old_port}", timeout_s))

    def stop(self) -> None:
        for node in self.sentinels + self.data:
            node.stop()


def _field(entry: Any, name: str) -> Any:
    """A field of a SENTINEL replicas/sentinels entry (a flat list or a parsed dict)."""
    if isinstance(entry, dict):
        return entry.get(name)
    pairs = dict(zip(entry[::2], entry[1::2], strict=True))
    return pairs.get(name)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
