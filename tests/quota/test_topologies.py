"""Redis Cluster and Sentinel: URL forms, scripts on each tenant's master, orphans, failover.

Real processes only: a 3-master cluster with one replica each and a Sentinel set-up (one
master, one replica, three sentinels) from loadlab/redis_cluster.py. The failover tests
run concurrent admit → reserve → settle load across tenants on every master through the
backend the processor builds (``backend_from_url`` with ``Resilience``), fail a master over
in the middle (gracefully, SIGKILL, SIGSTOP), and then prove from what Redis holds that no
token was charged twice: every request's record is settled again (idempotent: it reports
what was recorded) and admitted again (a replay), and each tenant's counter equals the sum
of what its records say was used.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from extproc.config import ConfigError, parse_config
from extproc.metrics import Metrics
from extproc.quota import keys
from extproc.quota.base import AdmitRequest, Counter, QuotaUnavailable, Settlement
from extproc.quota.factory import backend_from_url
from extproc.quota.liveness.orphans import Liveness
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.redis.resp import Script
from extproc.quota.redis.slots import key_slot
from extproc.quota.redis.topology import parse_redis_url, seeds_to_url
from extproc.quota.resilience.backend import CircuitOpen, Resilience, ResilientQuotaBackend
from loadlab.procs import free_port
from loadlab.redis_cluster import Node, RedisClusterSet, SentinelSet, wait_for
from tests.quota.conftest import FakeClock

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 1.0  # command_timeout_s, the processor's default quota_timeout_ms
WINDOW_S = 86400
_ids = itertools.count()


def base_doc() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "stack" / "quota.yaml").read_text())


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "normal"),
    [
        ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", None),
        ("rediss+cluster://u:pw@10.0.0.1:7000?ssl_cert_reqs=none", None),
        ("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/quota", None),
        ("redis+sentinel://u:pw@h:26379/quota/2?sentinel_password=spw", None),
        (["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"],
         "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"),
        (["rediss://u:pw@a:7000/0", "rediss://u:pw@b:7001"], "rediss+cluster://u:pw@a:7000,b:7001"),
    ],
)  # fmt: skip
def test_redis_url_accepts_cluster_and_sentinel_forms(value: Any, normal: str | None) -> None:
    doc = base_doc()
    doc["redis_url"] = value
    config = parse_config(doc)
    assert config.redis_url == (normal or value)
    printed = str(config.normalised["redis_url"])
    assert "pw" not in printed and "spw" not in printed  # secrets are redacted


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("redis+shard://127.0.0.1:7000", "redis_url"),
        ("redis+cluster://127.0.0.1", "redis_url"),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1", "redis_url"),
        ("redis+cluster://127.0.0.1:99999", "redis_url"),
        ("redis+cluster://127.0.0.1:7000/3", "redis_url"),
        ("redis+cluster://127.0.0.1:7000?sentinel_password=x", "redis_url"),
        ("redis+sentinel://127.0.0.1:26379", "redis_url"),
        ("redis+sentinel://127.0.0.1:26379/", "redis_url"),
        ("redis+sentinel://127.0.0.1:26379/quota/one", "redis_url"),
        ("redis+sentinel://127.0.0.1:26379/quota?colour=blue", "redis_url"),
        ("rediss+sentinel://h:26379/quota?ssl_cert_reqs=maybe", "redis_url"),
        ([], "redis_url"),
        (["redis://127.0.0.1:7000", "redis://127.0.0.1"], "redis_url[1]"),
        (["redis://127.0.0.1:7000", 7001], "redis_url[1]"),
        (["redis+cluster://127.0.0.1:7000"], "redis_url[0]"),
        (["redis://127.0.0.1:7000/2"], "redis_url[0]"),
        (["redis://127.0.0.1:7000", "rediss://127.0.0.1:7001"], "redis_url"),
        (["redis://a:b@127.0.0.1:7000", "redis://127.0.0.1:7001"], "redis_url"),
        ({"host": "127.0.0.1"}, "redis_url"),
    ],
)  # fmt: skip
def test_invalid_redis_url_error_names_the_field(value: Any, field: str) -> None:
    doc = base_doc()
    doc["redis_url"] = value
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.path == field


def test_url_errors_never_print_the_password() -> None:
    with pytest.raises(ValueError, match=r"u:\*\*\*@") as info:
        parse_redis_url("redis+cluster://u:hunter2@h:port")
    assert "hunter2" not in str(info.value)


def test_parsed_topologies_keep_nodes_credentials_service_and_db() -> None:
    sentinel = parse_redis_url(
        "redis+sentinel://u:p%40ss@a:1,[::1]:2/my%20svc/3?sentinel_password=s"
    )
    assert sentinel.kind == "sentinel" and sentinel.nodes == (("a", 1), ("::1", 2))
    assert (sentinel.username, sentinel.password, sentinel.service, sentinel.db) == (
        "u", "p@ss", "my svc", 3,
    )  # fmt: skip
    assert sentinel.options == {"sentinel_password": "s"}
    cluster = parse_redis_url("rediss+cluster://h:7000")
    assert cluster.kind == "cluster" and cluster.tls and cluster.password is None
    assert parse_redis_url("redis://h:1/0").kind == "single"
    assert seeds_to_url(["redis://h:1"]) == "redis+cluster://h:1"


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterSet]:
    """A cluster for tests that leave its topology alone."""
    cluster = RedisClusterSet.start(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterSet]:
    """A cluster of its own, for a test that fails a master over."""
    found = RedisClusterSet.start(tmp_path / "cluster")
    found.wait_replicas_synced()
    yield found
    found.stop()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSet]:
    found = SentinelSet.start(tmp_path / "sentinel")
    yield found
    found.stop()


def tenants_on_masters(cluster: RedisClusterSet, per_master: int = 2) -> dict[int, list[str]]:
    """Tenant names whose slots land on each master (checked with CLUSTER KEYSLOT/SLOTS)."""
    by_master: dict[int, list[str]] = {port: [] for port in cluster.topology()}
    for i in itertools.count():
        tenant = f"tenant-{i}"
        master = cluster.master_of(keys.tenant_tag(tenant))
        if len(by_master[master]) < per_master:
            by_master[master].append(tenant)
        if all(len(v) == per_master for v in by_master.values()):
            return by_master
    raise AssertionError("unreachable")


def counter_of(tenant: str) -> Counter:
    return Counter("daily", keys.counter_key(tenant, "daily", None, WINDOW_S), 10**12, WINDOW_S)


def total_on(client: redis.Redis, counter: Counter) -> int:
    return sum(int(client.get(k) or 0) for k in client.scan_iter(match=counter.key + ":*"))


async def until_answered(call: Callable[[], Awaitable[Any]], timeout_s: float = 60.0) -> Any:
    """Retry an (idempotent) call until the backend answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except QuotaUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# -- scripts on a cluster ----------------------------------------------------------------


@pytest.fixture
async def cluster_backend(shared_cluster: RedisClusterSet) -> AsyncIterator[RedisQuotaBackend]:
    backend = backend_from_url(shared_cluster.url, command_timeout_s=DEADLINE_S)
    assert isinstance(backend, RedisQuotaBackend)
    yield backend
    await backend.close()


async def test_each_tenants_scripts_run_on_the_master_of_its_slot(
    shared_cluster: RedisClusterSet, cluster_backend: RedisQuotaBackend
) -> None:
    tenants = tenants_on_masters(shared_cluster, per_master=1)
    assert len(tenants) == 3
    for master, (tenant,) in tenants.items():
        counter = counter_of(tenant)
        key = keys.reservation_key(tenant, f"r-{next(_ids)}")
        verdict = await cluster_backend.admit(AdmitRequest(key, (), (counter,), 100))
        assert verdict.admitted and not verdict.replayed
        assert (await cluster_backend.reserve(key, 1, (counter,), 32)).granted == 32
        settlement = await cluster_backend.settle(key, (counter,), 110)
        assert (settlement.reserved, settlement.used, settlement.refunded) == (132, 110, 22)
        node = shared_cluster.node(master).client()
        assert node.exists(key) == 1 and total_on(node, counter) == 110
        others = [p for p in tenants if p != master]
        for port in others:  # nothing of this tenant anywhere else
            assert total_on(shared_cluster.node(port).client(), counter) == 0
        replay = await cluster_backend.admit(AdmitRequest(key, (), (counter,), 100))
        assert replay.replayed and total_on(node, counter) == 110
    assert await cluster_backend.ping()


async def test_admission_blocks_run_on_the_master_of_their_tenants_slot(
    shared_cluster: RedisClusterSet, cluster_backend: RedisQuotaBackend
) -> None:
    """take_block, admit_from_block and return_block each touch one slot: the tenant's
    (the block key, the request's record, counters, open count and set, ledger)."""
    tenants = tenants_on_masters(shared_cluster, per_master=1)
    rpm_window = 3600
    for master, (tenant,) in tenants.items():
        # Counters of a model of this test's own (the shared cluster keeps other tests' data).
        counter = Counter("tpm", keys.counter_key(tenant, "tpm", "blk", WINDOW_S), 10**6, WINDOW_S)
        rpm = Counter("rpm", keys.counter_key(tenant, "rpm", "blk", rpm_window), 100, rpm_window)
        block = keys.block_key(tenant, cluster_backend.owner_id, next(_ids))
        taken = await cluster_backend.take_block(AdmitRequest(block, (rpm,), (counter,), 500), 3)
        assert taken.verdict.admitted and taken.amounts == (500,)
        request = AdmitRequest(
            keys.reservation_key(tenant, f"r-{next(_ids)}"), (rpm,), (counter,), 200
        )
        assert (await cluster_backend.admit_from_block(block, request)).from_block
        await cluster_backend.settle(request.reservation_key, (counter,), 150)
        returned = await cluster_backend.return_block(block, (rpm,), (counter,))
        assert (returned.reserved, returned.refunded) == (300, 300)
        node = shared_cluster.node(master).client()
        assert node.exists(block) == 1 and total_on(node, counter) == 150
        assert total_on(node, rpm) == 1
        entries = [f for _, f in node.xrange(keys.usage_stream_key(block))]
        ids = {request.reservation_key.rpartition(":r:")[2], block.rpartition(":r:")[2]}
        reasons = [f["reason"] for f in entries if keys.encode_name(f["request_id"]) in ids]
        assert reasons == ["completed", "returned"]
        for port in (p for p in tenants if p != master):  # nothing of this tenant elsewhere
            assert total_on(shared_cluster.node(port).client(), counter) == 0
    with pytest.raises(ValueError):  # a block of another tenant: another slot
        other = keys.block_key("elsewhere", cluster_backend.owner_id, 1)
        await cluster_backend.admit_from_block(other, request)


async def test_a_node_that_lost_its_scripts_loads_them_by_eval(
    shared_cluster: RedisClusterSet, cluster_backend: RedisQuotaBackend
) -> None:
    masters = tenants_on_masters(shared_cluster, per_master=1)
    port, (tenant,) = next(iter(masters.items()))
    master = shared_cluster.node(port).client()
    counter = counter_of(tenant)
    first = keys.reservation_key(tenant, f"r-{next(_ids)}")
    assert (await cluster_backend.admit(AdmitRequest(first, (), (counter,), 5))).admitted
    before = total_on(master, counter)
    master.script_flush()
    master.config_resetstat()
    second = keys.reservation_key(tenant, f"r-{next(_ids)}")
    assert (await cluster_backend.admit(AdmitRequest(second, (), (counter,), 5))).admitted
    stats = master.info("commandstats")
    assert stats["cmdstat_evalsha"]["failed_calls"] + stats["cmdstat_evalsha"]["calls"] >= 1
    assert stats["cmdstat_eval"]["calls"] == 1  # NOSCRIPT → EVAL, once
    assert total_on(master, counter) == before + 5


async def test_a_dead_processors_open_records_are_settled_by_a_peer_on_a_cluster(
    shared_cluster: RedisClusterSet,
) -> None:
    prefix = f"orph{next(_ids)}"
    a = backend_from_url(shared_cluster.url, command_timeout_s=DEADLINE_S, owner_id="proc-a")
    b = backend_from_url(shared_cluster.url, command_timeout_s=DEADLINE_S, owner_id="proc-b")
    assert isinstance(a, RedisQuotaBackend) and isinstance(b, RedisQuotaBackend)
    try:
        # Never beats on its own: each first admission in a tenant lists its open set, and
        # the records are in the open sets from their admission on.
        dying = Liveness(a, Metrics(), prefix=prefix, heartbeat_ttl_s=30, sweep_interval_s=60)
        opened: list[tuple[str, Counter]] = []
        for tenants in tenants_on_masters(shared_cluster, per_master=2).values():
            for tenant in tenants:
                counter = Counter(
                    "daily", keys.counter_key(tenant, "daily", None, WINDOW_S, prefix), 10**9,
                    WINDOW_S,
                )  # fmt: skip
                for n in range(3):
                    key = keys.reservation_key(tenant, f"open-{n}", prefix)
                    assert (await a.admit(AdmitRequest(key, (), (counter,), 64))).admitted
                    opened.append((key, counter))
        index = keys.registries_key("proc-a", prefix)
        assert len(dying.registrations.known) == 6 and await a.client.scard(index) == 6
        for key, _ in opened:
            assert await a.client.sismember(keys.open_set_key(key, "proc-a"), key)
        await a.client.delete(keys.heartbeat_key("proc-a", prefix))  # its TTL ran out

        clock = FakeClock(1000.0)
        peer = Liveness(
            b, Metrics(), prefix=prefix, heartbeat_ttl_s=30, sweep_interval_s=60, clock=clock
        )
        await peer.beat()
        clock.now += 30
        assert await peer.sweep() == len(opened) == 18
        assert await b.client.exists(index) == 0
        for key, counter in opened:
            assert await b.client.exists(keys.open_set_key(key, "proc-a")) == 0
            again = await b.settle(key, (counter,), 0)
            assert again.already_settled and again.used == 64  # settled at what it reserved
        await peer.stop()
        assert await b.client.sismember(keys.processor_index_key(prefix), "proc-b") == 0
    finally:
        await a.close()
        await b.close()


async def test_key_slots_are_the_ones_the_cluster_computes(
    shared_cluster: RedisClusterSet,
) -> None:
    node = shared_cluster.live_nodes()[0].client()
    samples = [
        keys.reservation_key("acme", "r-1"),
        keys.counter_key("tenant é/ü", "tpm", "gpt-4.1", 60),
        keys.heartbeat_key("proc-a"),
        "plain-key",
        "{}empty-tag",  # an empty tag is no tag: the whole key
        "a{b}{c}",  # the first tag counts
        "x{y",  # no closing brace: the whole key
        "{{double}}",
    ]
    for key in samples:
        assert key_slot(key) == node.execute_command("CLUSTER KEYSLOT", key), key


async def test_a_slot_moved_to_another_master_is_followed_through_ask_and_moved(
    shared_cluster: RedisClusterSet, cluster_backend: RedisQuotaBackend
) -> None:
    """A live resharding of one tenant's slot from master A to master B. While the slot is
    migrating, a one-key script whose key A does not hold is answered ASK and runs on B
    (ASKING first); a quota script for a tenant that has no key yet is refused TRYAGAIN by
    both (a multi-key script cannot run while its keys may be split) and charges nothing.
    Once the slot is B's, A answers MOVED and the map points the slot at B."""
    masters = shared_cluster.tenants_on_masters(per_master=1, stem="mv")
    (source, (tenant,)), (target, _) = list(masters.items())[:2]
    slot = key_slot(keys.tenant_tag(tenant))
    twin = next(  # another tenant of the same slot, with no key anywhere yet
        name
        for i in itertools.count()
        if key_slot(keys.tenant_tag(name := f"twin{next(_ids)}-{i}")) == slot
    )
    a, b = shared_cluster.node(source).client(), shared_cluster.node(target).client()
    counter, twin_counter = counter_of(tenant), counter_of(twin)
    first = keys.reservation_key(tenant, f"r-{next(_ids)}")
    assert (await cluster_backend.admit(AdmitRequest(first, (), (counter,), 100))).admitted
    assert cluster_backend.shard_of(first) == f"127.0.0.1:{source}"

    a_id, b_id = a.execute_command("CLUSTER MYID"), b.execute_command("CLUSTER MYID")
    b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", a_id)
    a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", b_id)

    def held(node: redis.Redis) -> set[str]:
        return set(node.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000))

    marker = keys.tenant_tag(twin) + ":marker"
    one_key = Script("return redis.call('SET', KEYS[1], ARGV[1])")
    assert await cluster_backend._scripts.run_script(one_key, [marker], ["asked"]) == "OK"
    assert marker in held(b) and marker not in held(a)  # ran on the importing master
    assert cluster_backend.shard_of(marker) == f"127.0.0.1:{source}"  # ASK: that call only
    refused = keys.reservation_key(twin, f"r-{next(_ids)}")
    with pytest.raises(QuotaUnavailable, match=r"TRYAGAIN|no answer"):
        await cluster_backend.admit(AdmitRequest(refused, (), (twin_counter,), 30))
    assert refused not in held(a) | held(b)

    moving = a.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
    a.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *moving)
    for port in (target, source, *(p for p in masters if p not in (source, target))):
        shared_cluster.node(port).client().execute_command("CLUSTER SETSLOT", slot, "NODE", b_id)
    settlement = await cluster_backend.settle(first, (counter,), 90)
    assert (settlement.reserved, settlement.used, settlement.refunded) == (100, 90, 10)
    assert cluster_backend.shard_of(first) == f"127.0.0.1:{target}"  # MOVED updated the map
    assert total_on(b, counter) == 90 and total_on(a, counter) == 0
    assert (await cluster_backend.admit(AdmitRequest(refused, (), (twin_counter,), 30))).admitted
    assert total_on(b, twin_counter) == 30


async def test_a_sweep_settles_the_orphans_of_the_masters_that_answer_while_one_is_gone(
    cluster: RedisClusterSet,
) -> None:
    # One slot range gone for good (its master and its replica killed; the others keep
    # serving): the sweep settles what the other masters hold and keeps the rest listed.
    for node in cluster.live_nodes():
        node.client().config_set("cluster-require-full-coverage", "no")
    prefix = f"gone{next(_ids)}"
    a = backend_from_url(cluster.url, command_timeout_s=DEADLINE_S, owner_id="proc-a")
    b = backend_from_url(cluster.url, command_timeout_s=DEADLINE_S, owner_id="proc-b")
    assert isinstance(a, RedisQuotaBackend) and isinstance(b, RedisQuotaBackend)
    try:
        Liveness(a, Metrics(), prefix=prefix, heartbeat_ttl_s=30, sweep_interval_s=60)
        by_master = tenants_on_masters(cluster, per_master=1)
        index_master = cluster.master_of(keys.registries_key("proc-a", prefix))
        victim = next(port for port in by_master if port != index_master)
        lost: list[str] = []
        for port, tenants in by_master.items():
            counter = Counter(
                "daily", keys.counter_key(tenants[0], "daily", None, WINDOW_S, prefix), 10**9,
                WINDOW_S,
            )  # fmt: skip
            for n in range(2):
                key = keys.reservation_key(tenants[0], f"open-{n}", prefix)
                assert (await a.admit(AdmitRequest(key, (), (counter,), 64))).admitted
                if port == victim:
                    lost.append(key)
        await a.client.delete(keys.heartbeat_key("proc-a", prefix))  # its TTL ran out
        clock = FakeClock(1000.0)
        peer = Liveness(
            b, Metrics(), prefix=prefix, heartbeat_ttl_s=30, sweep_interval_s=60, clock=clock
        )
        await peer.beat()  # (redis-py's cluster client learns the slots while all answer)
        replica = cluster.topology()[victim][0]
        cluster.node(victim).kill()
        cluster.node(replica).kill()
        clock.now += 30
        assert await peer.sweep() == 4  # two masters' records; the gone one's are skipped
        assert peer.metrics.liveness_errors_total >= 1
        # Still listed, and so is the processor: a later sweep takes them once they answer.
        left = await b.client.smembers(keys.registries_key("proc-a", prefix))
        assert left == {keys.open_set_key(lost[0], "proc-a")}
        assert await b.client.sismember(keys.processor_index_key(prefix), "proc-a")
    finally:
        await a.close()
        await b.close()


# -- failover under load -----------------------------------------------------------------


@dataclass
class Request:
    tenant: str
    key: str
    admit: AdmitRequest
    admitted: bool = False
    replayed: bool = False
    used: int | None = None  # what the client settled (None: not admitted)


@dataclass
class Load:
    """Concurrent processor-like traffic: admit → reserve → settle; cancel a lost admission."""

    backend: ResilientQuotaBackend
    tenants: list[str]
    tasks: int = 16
    requests: list[Request] = field(default_factory=list)
    # (monotonic time, tenant, "ok" | "unavailable") per admission
    events: list[tuple[float, str, str]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    slowest_s: float = 0.0  # the longest admission call (the deadline bounds it)
    breaker_refused: list[str] = field(default_factory=list)  # tenants refused by a breaker

    async def one(self, tenant: str) -> None:
        counter = counter_of(tenant)
        n = next(_ids)
        key = keys.reservation_key(tenant, f"load-{n}")
        tokens = 100 + n % 7
        request = Request(tenant, key, AdmitRequest(key, (), (counter,), tokens))
        self.requests.append(request)
        sent = time.monotonic()
        try:
            verdict = await self.backend.admit(request.admit)
        except QuotaUnavailable as exc:  # the processor answers 503 and cancels the admission
            self.events.append((time.monotonic(), tenant, "unavailable"))
            if isinstance(exc, CircuitOpen):
                self.breaker_refused.append(tenant)
            self.slowest_s = max(self.slowest_s, time.monotonic() - sent)
            await self.backend.cancel(key, (counter,))
            return
        self.events.append((time.monotonic(), tenant, "ok"))
        self.slowest_s = max(self.slowest_s, time.monotonic() - sent)
        assert verdict.admitted, verdict
        request.admitted, request.replayed = True, verdict.replayed
        try:
            granted = (await self.backend.reserve(key, 1, (counter,), 32)).granted
        except QuotaUnavailable:
            granted = 0
        used = tokens + granted // 2
        await self.backend.settle(key, (counter,), used)  # queued when Redis is out
        request.used = used

    async def worker(self, index: int) -> None:
        tenants = self.tenants[index % len(self.tenants) :] + self.tenants
        for tenant in itertools.cycle(tenants):
            if self.stopping.is_set():
                return
            try:
                await self.one(tenant)
            except BaseException as exc:  # anything but a 503 is a processor crash
                self.errors.append(exc)
                raise
            await asyncio.sleep(0.002)

    def ok_since(self, t: float, tenants: list[str]) -> int:
        return sum(
            1 for at, tenant, kind in self.events if at > t and tenant in tenants and kind == "ok"
        )


@dataclass
class Audit:
    unavailable: int
    unavailable_window_s: float
    admitted: int
    replayed_in_load: int
    records_lost: int
    settlements_lost: int
    tokens_lost: int
    fences: int = 0  # Sentinel failovers the client fenced
    others_unavailable: int = 0  # 503s of tenants whose master did not fail
    others_breaker_refused: int = 0  # ... of those, refused by an open breaker
    others_admissions: int = 0  # admissions tried for tenants whose master did not fail
    others_served_in_failover: int = 0  # theirs admitted from the failure to the new master


async def run_failover(
    url: str,
    tenants: list[str],
    affected: list[str],
    fail_over: Callable[[], None],
    wait_failed_over: Callable[[], None],
    read_total: Callable[[Counter], int],
    record_property: Callable[[str, object], None],
    label: str,
    settled: Callable[[], None] = lambda: None,
) -> Audit:
    backend = backend_from_url(
        url,
        command_timeout_s=DEADLINE_S,
        resilience=Resilience(failures=5, probe_interval_s=0.1),
        metrics=Metrics(),
    )
    assert isinstance(backend, ResilientQuotaBackend)
    scripts = backend.primary._scripts  # type: ignore[attr-defined]
    load = Load(backend, tenants)
    workers = [asyncio.create_task(load.worker(i)) for i in range(load.tasks)]
    try:
        await asyncio.to_thread(wait_for, lambda: load.ok_since(0, affected) >= 50, "warm load")
        started = time.monotonic()
        await asyncio.to_thread(fail_over)
        await asyncio.to_thread(wait_failed_over)
        failed_over = time.monotonic()
        # The stack keeps serving: affected tenants get answers from the new master.
        await asyncio.to_thread(
            wait_for, lambda: load.ok_since(failed_over, affected) >= 50, "load after failover"
        )
    finally:
        load.stopping.set()
        await asyncio.gather(*workers, return_exceptions=True)
    assert not load.errors, load.errors
    try:
        assert await backend.flush(60.0), "queued settlements/cancels not applied"
    finally:
        await backend.close()
    # Audited once the topology has settled, on new connections: only the current masters.
    await asyncio.to_thread(settled)
    auditor = backend_from_url(url, command_timeout_s=DEADLINE_S)
    assert isinstance(auditor, RedisQuotaBackend)
    try:
        audit = await audit_records(auditor, load, read_total)
    finally:
        await auditor.close()
    failures = [at for at, _, kind in load.events if kind == "unavailable"]
    audit.unavailable = len(failures)
    audit.others_unavailable = sum(
        1 for _, t, kind in load.events if kind == "unavailable" and t not in affected
    )
    audit.others_breaker_refused = sum(1 for t in load.breaker_refused if t not in affected)
    audit.others_served_in_failover = sum(
        1
        for at, t, kind in load.events
        if t not in affected and kind == "ok" and started <= at <= failed_over
    )
    audit.others_admissions = sum(1 for _, t, _ in load.events if t not in affected)
    audit.fences = getattr(scripts, "fences", 0)
    audit.unavailable_window_s = (max(failures) - min(failures)) if failures else 0.0
    report = {
        "admissions": len(load.events),
        "unavailable_503": audit.unavailable,
        # Tenants of the masters that did not fail (one breaker per master).
        "unavailable_503_other_masters": audit.others_unavailable,
        "breaker_refused_other_masters": audit.others_breaker_refused,
        "admitted_other_masters_during_failover": audit.others_served_in_failover,
        "unavailable_window_s": round(audit.unavailable_window_s, 3),
        "failover_observed_s": round(failed_over - started, 3),
        "slowest_admission_s": round(load.slowest_s, 3),
        "admits_replayed_by_a_retry": audit.replayed_in_load,
        "records_lost": audit.records_lost,
        "settlements_lost": audit.settlements_lost,
        "tokens_lost": audit.tokens_lost,
        "sentinel_fences": audit.fences,
    }
    for name, value in report.items():
        record_property(f"{label}.{name}", value)
    print(f"\n{label}: {report}")
    return audit


async def audit_records(
    raw: RedisQuotaBackend, load: Load, read_total: Callable[[Counter], int]
) -> Audit:
    """Settle and admit every request again (both idempotent) and check the counters.

    Settling again reports what the record holds: ``already_settled`` with the used tokens
    it was settled at; an open record (its settlement was lost) is settled now at the
    client's ``used``; no record at all means the admission was lost with a killed master.
    """
    recorded: dict[str, int] = {t: 0 for t in load.tenants}
    records_lost = settlements_lost = tokens_lost = 0
    kept: list[Request] = []
    for request in load.requests:
        counter = counter_of(request.tenant)
        used = request.used if request.used is not None else 0
        again: Settlement = await until_answered(
            lambda r=request, c=counter, u=used: raw.settle(r.key, (c,), u)  # type: ignore[misc]
        )
        if again.already_settled:
            kept.append(request)
            # What Redis recorded is what the client settled (a cancel records 0).
            assert again.used == used, (request, again)
            recorded[request.tenant] += again.used
        elif again.reserved:
            settlements_lost += 1
            kept.append(request)
            recorded[request.tenant] += used
        elif request.admitted:
            records_lost += 1
            tokens_lost += used
    for tenant in load.tenants:
        # Every charged token belongs to one record: nothing was charged twice.
        assert read_total(counter_of(tenant)) == recorded[tenant], tenant
    for request in kept:
        verdict = await until_answered(lambda r=request: raw.admit(r.admit))  # type: ignore[misc]
        assert verdict.replayed or verdict.cancelled, (request, verdict)
    for tenant in load.tenants:
        assert read_total(counter_of(tenant)) == recorded[tenant], tenant
    return Audit(
        unavailable=0,
        unavailable_window_s=0.0,
        admitted=sum(1 for r in load.requests if r.admitted),
        replayed_in_load=sum(1 for r in load.requests if r.replayed),
        records_lost=records_lost,
        settlements_lost=settlements_lost,
        tokens_lost=tokens_lost,
    )


def cluster_reader(cluster: RedisClusterSet) -> Callable[[Counter], int]:
    def read(counter: Counter) -> int:
        return total_on(cluster.node(cluster.master_of(counter.key)).client(), counter)

    return read


@pytest.mark.slow
async def test_a_dead_masters_breaker_stops_only_the_tenants_of_its_slots(
    cluster: RedisClusterSet,
) -> None:
    """One breaker per master: three failures on the SIGKILLed master open its breaker
    alone; the other masters' tenants are admitted meanwhile. Once its replica is promoted
    the dead master's tenants are admitted by the new master, and the old breaker closes
    (no slot is served there any more)."""
    by_master = cluster.tenants_on_masters(per_master=1, stem="brk")
    victim = next(iter(by_master))
    dead = by_master[victim][0]
    others = [ts[0] for port, ts in by_master.items() if port != victim]
    backend = backend_from_url(
        cluster.url,
        command_timeout_s=DEADLINE_S,
        resilience=Resilience(failures=3, probe_interval_s=0.05),
        metrics=Metrics(),
    )
    assert isinstance(backend, ResilientQuotaBackend)

    def request(tenant: str) -> AdmitRequest:
        key = keys.reservation_key(tenant, f"b-{next(_ids)}")
        return AdmitRequest(key, (counter_of(tenant),), (), 0)

    try:
        for tenant in [dead, *others]:
            assert (await backend.admit(request(tenant))).admitted
        cluster.node(victim).kill()
        for _ in range(3):
            with pytest.raises(QuotaUnavailable) as info:
                await backend.admit(request(dead))
            assert not isinstance(info.value, CircuitOpen)
        with pytest.raises(CircuitOpen):
            await backend.admit(request(dead))
        assert backend.open_shards() == [f"127.0.0.1:{victim}"]
        for tenant in others * 5:
            assert (await backend.admit(request(tenant))).admitted
        assert backend.open_shards() == [f"127.0.0.1:{victim}"]

        await asyncio.to_thread(cluster.wait_master_changed, victim)
        verdict = await until_answered(lambda: backend.admit(request(dead)))
        assert verdict.admitted and not verdict.local
        assert backend.primary.shard_of(request(dead).reservation_key) != f"127.0.0.1:{victim}"
        await asyncio.to_thread(wait_for, lambda: not backend.breaker_open, "breaker closed")
    finally:
        await backend.close()


@pytest.mark.parametrize("how", ["graceful", "sigkill", "sigstop"])
async def test_cluster_master_failover_under_load_charges_no_token_twice(
    cluster: RedisClusterSet, how: str, record_property: Callable[[str, object], None]
) -> None:
    by_master = tenants_on_masters(cluster)
    victim = next(iter(by_master))
    replica = cluster.node(cluster.topology()[victim][0])
    old: Node = cluster.node(victim)

    def fail_over() -> None:
        if how == "graceful":
            replica.client().execute_command("CLUSTER FAILOVER")
        elif how == "sigkill":
            old.kill()
        else:
            old.pause()

    audit = await run_failover(
        cluster.url,
        [t for tenants in by_master.values() for t in tenants],
        by_master[victim],
        fail_over,
        lambda: cluster.wait_master_changed(victim),
        cluster_reader(cluster),
        record_property,
        f"cluster-{how}",
    )
    assert audit.admitted > 100
    # One breaker per master: the other masters' tenants go on being admitted while the
    # failed one's slots have no master (a breaker shared with it would refuse them all).
    # Their own calls keep their deadline (1 s): on a machine starved by the suite and two
    # CPU hogs beside it, 33 of 1,122 once expired and opened their own master's breaker.
    # That is the deadline at work, not the failover: reported (others_unavailable,
    # others_breaker_refused), not bounded.
    if how != "graceful":  # CLUSTER FAILOVER's window can be shorter than one admission
        assert audit.others_served_in_failover > 0, audit
    if how == "graceful":
        # CLUSTER FAILOVER waits for the replica to catch up: nothing acknowledged is lost.
        assert (audit.records_lost, audit.settlements_lost) == (0, 0)


@pytest.mark.parametrize("how", ["graceful", "sigkill", "sigstop"])
async def test_sentinel_master_failover_under_load_charges_no_token_twice(
    sentinel: SentinelSet, how: str, record_property: Callable[[str, object], None]
) -> None:
    victim = sentinel.master_port()
    old = sentinel.node(victim)
    tenants = [f"tenant-{i}" for i in range(4)]

    def fail_over() -> None:
        if how == "graceful":
            sentinel.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", sentinel.service)
        elif how == "sigkill":
            old.kill()
        else:
            old.pause()

    def read_total(counter: Counter) -> int:
        return total_on(sentinel.node(sentinel.master_port()).client(), counter)

    def settled() -> None:
        if how == "graceful":  # Sentinel turns the old master into a replica, later
            wait_for(
                lambda: old.client().execute_command("ROLE")[0] == "slave", "old master demoted"
            )

    # The first sentinel named is not running: the others are asked all the same.
    url = sentinel.url.replace("://", f"://127.0.0.1:{free_port()},", 1)
    audit = await run_failover(
        url,
        tenants,
        tenants,
        fail_over,
        lambda: sentinel.wait_master_changed(victim),
        read_total,
        record_property,
        f"sentinel-{how}",
        settled,
    )
    assert audit.admitted > 100
    # Whether the client's poll falls inside the sentinels' short failover_in_progress span
    # depends on scheduling (a busy machine missed it); what the fence is for is asserted in
    # run_failover whatever the poll saw: no record, settlement or token lost or doubled.
    # The count of fences is a reported property (sentinel_fences).
