"""The shipped Redis ACLs (deploy/redis/users.acl) on a real redis-server that loads them.

The processor's user runs every quota script, the orphan settlement, the fail-open absorb
and the liveness loop; the exporter's user exports and summarises the ledger; each is
refused any other command or key. A processor that Redis refuses fails closed with 503
``quota_unavailable``, says why in one log line, counts it, and leaves its breaker alone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.metrics import Metrics
from extproc.quota.base import (
    AbsorbedUsage,
    Absorption,
    AdmitRequest,
    Counter,
    UsageTags,
)
from extproc.quota.keys import counter_key, reservation_key
from extproc.quota.liveness.orphans import start_liveness
from extproc.quota.redis.backend import RedisQuotaBackend
from extproc.quota.resilience.backend import ResilientQuotaBackend, absorb_key
from loadlab.gateway import ROOT, Envoy, Processor, key_hash, write_config
from loadlab.procs import ManagedProcess, free_port
from loadlab.redis_server import REDIS_SERVER, accepts_connections
from loadlab.simulator import Simulator

ACL_FILE = ROOT / "deploy" / "redis" / "users.acl"
# The example passwords whose SHA-256 the shipped file holds (deploy/k8s/secret.yaml).
PASSWORDS = {
    "extproc": "example-extproc-password",
    "ledger-exporter": "example-exporter-password",
    "default": "example-admin-password",  # the admin: Redis replays the AOF as this user
    "probe": "any",
}


class AclRedis:
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        argv = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--dir", str(directory),
                "--aclfile", str(ACL_FILE)]  # fmt: skip
        self.process = ManagedProcess(argv, directory / "redis.log")
        self.process.wait_ready(lambda: accepts_connections(self.port), timeout_s=15)

    def url(self, user: str, password: str | None = None) -> str:
        secret = PASSWORDS[user] if password is None else password
        return f"redis://{user}:{secret}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis(
            port=self.port, username=user, password=PASSWORDS[user], decode_responses=True
        )


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    server = AclRedis(tmp_path_factory.mktemp("acl-redis"))
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture
def admin(acl_redis: AclRedis) -> Iterator[redis.Redis]:
    client = acl_redis.client("default")
    client.flushall()
    client.acl_log_reset()
    try:
        yield client
    finally:
        client.close()


def _refusals(admin: redis.Redis) -> list[tuple[str, str, str]]:
    """(user, reason, object) of every ACL refusal since the last reset."""
    return [(e["username"], e["reason"], e["object"]) for e in admin.acl_log(count=1000)]


def test_without_a_password_nothing_runs_and_the_probe_user_only_pings(
    acl_redis: AclRedis, admin: redis.Redis
):
    anonymous = redis.Redis(port=acl_redis.port, decode_responses=True)
    for command in (("PING",), ("GET", "tq:{a}:open"), ("FLUSHALL",)):
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.execute_command(*command)
    probe = acl_redis.client("probe")
    assert probe.ping() is True  # the readiness probe's redis-cli --user probe ping
    for command in (("GET", "tq:{a}:open"), ("FLUSHALL",), ("CONFIG", "GET", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            probe.execute_command(*command)
    probe.close()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis.port, username="extproc", password="wrong").ping()


async def test_the_processor_user_runs_every_quota_path(acl_redis: AclRedis, admin: redis.Redis):
    metrics = Metrics()
    primary = RedisQuotaBackend.from_url(acl_redis.url("extproc"), command_timeout_s=5)
    backend = ResilientQuotaBackend(primary, metrics=metrics)
    tpm = Counter("tpm", counter_key("acl", "tpm", "m", 3600), 10_000, 3600)
    rpm = Counter("rpm", counter_key("acl", "rpm", "m", 3600), 100, 3600)
    tags = UsageTags("pro", "m", "client-1", 5)
    liveness = start_liveness(backend, metrics, heartbeat_ttl_s=1, sweep_interval_s=0.1)
    try:
        assert liveness is not None
        # admit, lease, settle (with its ledger entry)
        key = reservation_key("acl", "r1")
        assert (await backend.admit(AdmitRequest(key, (rpm,), (tpm,), 8, usage=tags))).admitted
        assert (await backend.reserve(key, 1, (tpm,), 16)).granted == 16
        settled = await backend.settle(key, (tpm,), 20, output_tokens=15)
        assert settled.used == 20
        # a refusal, a cancel, a dead owner's record settled by a peer
        assert not (await backend.admit(AdmitRequest(reservation_key("acl", "big"), (), (tpm,),
                                                     20_000))).admitted  # fmt: skip
        cancelled = reservation_key("acl", "r2")
        await backend.admit(AdmitRequest(cancelled, (), (tpm,), 8))
        await backend.cancel(cancelled, (tpm,))
        orphan = reservation_key("acl", "r3")
        dead = RedisQuotaBackend.from_url(acl_redis.url("extproc"), owner_id="dead-peer")
        await dead.admit(AdmitRequest(orphan, (), (tpm,), 8, usage=tags))
        await dead.close()
        status, _ = await primary.settle_orphan(orphan, "dead-peer")
        assert status == "settled"
        # the fail-open reconciliation script (loaded by redis-py: EVALSHA, SCRIPT LOAD)
        start = int(admin.time()[0]) // 3600 * 3600
        absorption = Absorption(absorb_key(reservation_key("acl", "r4")),
                                ((tpm.key, 3600, start, 7),),
                                AbsorbedUsage("pro", "m", "c", "completed", 2, 5, ""))  # fmt: skip
        await primary.absorb(absorption)  # what the queue's worker runs when Redis returns
        # the liveness loop: heartbeat, registration of open records, sweep of dead peers
        await asyncio.sleep(0.5)
        assert admin.exists(f"tq:{{~p}}:hb:{primary.owner_id}")
    finally:
        if liveness is not None:
            await liveness.stop()
        await backend.close()
    assert metrics.liveness_errors_total == 0
    assert dict(metrics.quota_config_errors) == {}
    assert _refusals(admin) == []
    ledger = admin.xrange("tq:{acl}:usage")
    assert [f["reason"] for _, f in ledger] == ["completed", "cancelled", "orphaned", "completed"]


def test_the_processor_user_is_refused_anything_else(acl_redis: AclRedis, admin: redis.Redis):
    client = acl_redis.client("extproc")
    refused = [
        ("FLUSHALL",),
        ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"),
        ("GET", "other:{a}:key"),  # outside the key prefix
        ("ACL", "SETUSER", "extproc", "+@all"),
        ("SCRIPT", "FLUSH"),
    ]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    # A script is refused what its user is: a command, or a key outside the prefix.
    with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
        client.eval("return redis.call('FLUSHALL')", 0)
    with pytest.raises(redis.exceptions.ResponseError, match="no permissions to access"):
        client.eval("return redis.call('GET', KEYS[1])", 1, "other:{a}:key")
    client.close()
    assert {user for user, _, _ in _refusals(admin)} == {"extproc"}


def _usage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "usage", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip


async def test_the_exporter_user_exports_and_summarises_and_writes_nothing_else(
    acl_redis: AclRedis, admin: redis.Redis, tmp_path: Path
):
    backend = RedisQuotaBackend.from_url(acl_redis.url("extproc"))
    tpm = Counter("tpm", counter_key("exp", "tpm", "m", 3600), 10**9, 3600)
    for i in range(5):
        key = reservation_key("exp", f"r{i}")
        await backend.admit(AdmitRequest(key, (), (tpm,), 10, usage=UsageTags("pro", "m", "", 3)))
        await backend.settle(key, (tpm,), 10, output_tokens=7)
    await backend.close()
    password = tmp_path / "password"
    password.write_text(PASSWORDS["ledger-exporter"] + "\n")  # a mounted Secret's file
    url = f"redis://127.0.0.1:{acl_redis.port}/0"
    creds = ["--redis-username", "ledger-exporter", "--redis-password-file", str(password)]
    out = tmp_path / "usage.jsonl"
    run = _usage("export", "--redis-url", url, *creds, "--group", "billing",
                 "--consumer", "c1", "--output", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(out.read_text().splitlines()) == 5
    run = _usage("summary", "--redis-url", url, *creds, "--since", "2000-01-01",
                 "--until", "2100-01-01", "--format", "json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)[0]["requests"] == 5
    assert _refusals(admin) == []
    exporter = acl_redis.client("ledger-exporter")
    stream = "tq:{exp}:usage"
    for command in (
        ("XADD", stream, "*", "forged", "1"),
        ("XDEL", stream, "0-1"),
        ("XTRIM", stream, "MAXLEN", "0"),
        ("DEL", stream),
        ("GET", tpm.key + ":0"),
        ("HGETALL", reservation_key("exp", "r0")),
        ("EVAL", "return 1", "0"),
        ("FLUSHALL",),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            exporter.execute_command(*command)
    exporter.close()
    assert admin.xlen(stream) == 5
    # A wrong password is one clear line and exit status 2.
    password.write_text("wrong\n")
    run = _usage("summary", "--redis-url", url, *creds, "--since", "2000-01-01",
                 "--until", "2100-01-01")  # fmt: skip
    assert run.returncode == 2
    assert "invalid username-password pair" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def _post(base_url: str, key: str) -> tuple[int, dict]:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_a_processor_outside_its_acl_fails_closed_with_one_clear_line(
    acl_redis: AclRedis, admin: redis.Redis, tmp_path: Path
):
    """key_prefix "other" is outside the user's ``~tq:*``: Redis refuses every script. PING
    is allowed, so the processor starts; without the refusal being told apart from an
    outage, the breaker would open, a probe would close it, and round again."""
    sim = Simulator(ROOT / "simulator_profiles" / "fast.yaml", log_dir=tmp_path)
    config = write_config(
        tmp_path / "quota.yaml",
        {
            "key_prefix": "other",
            "models": {"m": {"tokenizer": "o200k_base", "max_tokens": 16}},
            "plans": {
                "closed": {"limits": {"*": {"rpm": 100, "tpm": 10_000}}},
                "open": {
                    "limits": {"*": {"rpm": 100, "tpm": 10_000}},
                    "on_backend_failure": "open",
                },
            },
            "tenants": {
                "c": {"plan": "closed", "key_sha256": [key_hash("sk-closed")]},
                "o": {"plan": "open", "key_sha256": [key_hash("sk-open")]},
            },
        },
    )
    processor = Processor.start(config, tmp_path, acl_redis.url("extproc"))
    envoy = None
    try:
        envoy = Envoy.start(tmp_path, [processor.port], [sim.port])
        answers = [_post(envoy.base_url, key) for key in ["sk-closed", "sk-open"] * 6]
        metrics = processor.metrics()
        records = processor.log_records()
        lines = [r for r in records if r.get("event") == "quota_backend_misconfigured"]
    finally:
        if envoy is not None:
            envoy.stop()
        processor.stop()
        sim.stop()
    # Fail closed, even on a fail-open plan: no allowance hides a broken ACL.
    assert {status for status, _ in answers} == {503}
    assert {body["error"]["code"] for _, body in answers} == {"quota_unavailable"}
    refused = metrics['extproc_quota_config_errors_total{kind="permission"}']
    assert refused >= 12  # every admission (and the cancels its unknown outcome asks for)
    assert metrics.get("extproc_fail_open_admissions_total", 0) == 0
    assert metrics["extproc_quota_breaker_opened_total"] == 0
    assert metrics["extproc_quota_breaker_probes_total"] == 0
    # One line per refused operation (the admission, and the cancel its unknown outcome
    # asks for), however many requests, naming the fix.
    operations = [line["error"].split("refused quota ")[1].split(":")[0] for line in lines]
    assert sorted(operations) == ["admit", "cancel"], lines
    assert all(line["kind"] == "permission" and "users.acl" in line["error"] for line in lines)


def test_a_processor_with_a_wrong_password_does_not_start_and_says_why(
    acl_redis: AclRedis, tmp_path: Path
):
    config = write_config(
        tmp_path / "quota.yaml",
        {
            "models": {"m": {"tokenizer": "o200k_base"}},
            "plans": {"p": {"limits": {"*": {"rpm": 1}}}},
            "tenants": {"t": {"plan": "p", "key_sha256": [key_hash("sk-t")]}},
            "redis_url": f"redis://127.0.0.1:{acl_redis.port}/0",
            "redis_username": "extproc",
            "redis_password_file": str(tmp_path / "password"),
        },
    )
    (tmp_path / "password").write_text("not-the-password\n")
    run = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(config),
         "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 1
    assert "refused the processor's credentials" in run.stderr
    assert "WRONGPASS" in run.stderr
    assert "not-the-password" not in run.stderr


async def test_the_processor_user_over_rediss_with_the_config_credentials(tmp_path: Path):
    """TLS to Redis (rediss://, the CA in the URL) with the ACL user and a password file:
    the configuration's path to Redis, both of the backend's connections."""
    from extproc.app.runtime import redis_credentials
    from extproc.config import parse_config
    from extproc.quota.factory import backend_from_url
    from loadlab.redis_server import make_tls_files

    ca, crt, key = make_tls_files(tmp_path / "tls")
    port = free_port()
    argv = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
            "--tls-cert-file", str(crt), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
            "--aclfile", str(ACL_FILE)]  # fmt: skip
    server = ManagedProcess(argv, tmp_path / "redis.log")
    try:
        server.wait_ready(lambda: accepts_connections(port), timeout_s=15)
        (tmp_path / "password").write_text(PASSWORDS["extproc"] + "\n")
        config = parse_config(
            {
                "redis_url": f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}",
                "redis_username": "extproc",
                "redis_password_file": str(tmp_path / "password"),
                "models": {"m": {}},
                "plans": {"p": {"limits": {"*": {"rpm": 1}}}},
                "tenants": {"t": {"plan": "p", "key_sha256": [key_hash("sk-t")]}},
            }
        )
        assert config.normalised["redis_auth"] == {"username": "extproc", "password": True}
        backend = backend_from_url(config.redis_url, **redis_credentials(config))
        tpm = Counter("tpm", counter_key("tls", "tpm", "m", 3600), 1000, 3600)
        try:
            await backend.check()  # type: ignore[attr-defined]
            key = reservation_key("tls", "r1")
            assert (await backend.admit(AdmitRequest(key, (), (tpm,), 5))).admitted
            assert (await backend.settle(key, (tpm,), 3)).used == 3
        finally:
            await backend.close()
    finally:
        server.stop()
