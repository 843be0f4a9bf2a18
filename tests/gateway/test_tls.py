"""Mutual TLS between Envoy and the processor, through the real Envoy binary.

Certificates are made here with the ``openssl`` CLI: CA 1 signs the processor's certificate
(SAN ``extproc``) and Envoy's client certificate; CA 2 signs a rogue client's. The processor
serves ``tls``, and Envoy takes its own, from files in directories a test can rotate the way
a Kubernetes Secret update does (a ``..data`` symlink swapped atomically)."""

from __future__ import annotations

import os
import socket
import ssl
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import orjson
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadlab.gateway import ROOT, Envoy, http_get, wait_until, write_config
from loadlab.procs import ManagedProcess, free_ports
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from stack.envoy import (
    EnvoyPorts,
    ProcessorHealthCheck,
    ProcessorTls,
    render_bootstrap,
    write_processor_secrets,
)
from tests.deploy.certs import make_ca, make_leaf, serial_of
from tests.gateway.conftest import processor_config, tenant_key

pytestmark = pytest.mark.slow
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
NAME = "extproc"  # the name Envoy checks in the processor's certificate


@dataclass
class Certs:
    ca: Path
    server: tuple[Path, Path]
    rotated: tuple[Path, Path]  # a later certificate of the same name, same CA
    client: tuple[Path, Path]
    rogue: tuple[Path, Path]  # signed by another CA
    rogue_ca: Path
    next_ca: Path  # a CA both sides rotate to
    next_server: tuple[Path, Path]
    next_client: tuple[Path, Path]
    misnamed: tuple[Path, Path]  # signed by the CA, for another name


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    later = make_ca(d, "next-ca")
    return Certs(
        ca=ca[0],
        server=make_leaf(d, ca, "server", f"DNS:{NAME},IP:127.0.0.1"),
        rotated=make_leaf(d, ca, "server-rotated", f"DNS:{NAME},IP:127.0.0.1"),
        client=make_leaf(d, ca, "envoy", "DNS:envoy"),
        rogue=make_leaf(d, other, "rogue", "DNS:envoy"),
        rogue_ca=other[0],
        next_ca=later[0],
        next_server=make_leaf(d, later, "next-server", f"DNS:{NAME},IP:127.0.0.1"),
        next_client=make_leaf(d, later, "next-envoy", "DNS:envoy"),
        misnamed=make_leaf(d, ca, "misnamed", "DNS:not-extproc,IP:127.0.0.1"),
    )


class MountedSecret:
    """Files under ``dir/tls.crt`` etc. through a ``..data`` symlink, as the kubelet mounts
    a Secret; ``swap`` replaces the whole set in one rename."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir()
        self.generation = 0
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (directory / name).symlink_to(f"..data/{name}")

    def swap(self, cert: Path, key: Path, ca: Path) -> None:
        self.generation += 1
        target = self.dir / f"..gen{self.generation}"
        target.mkdir()
        for name, source in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
            (target / name).write_bytes(source.read_bytes())
        link = self.dir / "..data_tmp"
        link.symlink_to(target.name)
        os.replace(link, self.dir / "..data")

    def path(self, name: str) -> str:
        return str(self.dir / name)


def tls_channel(port: int, ca: Path, client: tuple[Path, Path] | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        ca.read_bytes(),
        client[1].read_bytes() if client else None,
        client[0].read_bytes() if client else None,
    )
    return grpc.secure_channel(
        f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", NAME)]
    )


def health(channel: grpc.Channel) -> int | str:
    """The processor's health answer, or the gRPC status code name of the failure."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        return reply.status
    except grpc.RpcError as exc:
        return exc.code().name


def served_serial(port: int, ca: Path, client: tuple[Path, Path]) -> int:
    """The serial of the certificate the processor presents on a new TLS connection."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client[0]), str(client[1]))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=NAME) as conn,
    ):
        cert = conn.getpeercert()
    assert cert is not None
    return int(cert["serialNumber"], 16)


@dataclass
class TlsGateway:
    envoy: Envoy
    processor: ManagedProcess
    port: int
    health_port: int
    secret: MountedSecret  # the processor's
    envoy_secret: MountedSecret
    redis: redis.Redis
    argv: list[str]  # the processor's command line
    log_dir: Path

    def restart_processor(self) -> None:
        """A new processor process on the same port, so Envoy's next connection is a new
        one; returns once it serves (its plaintext health listener answers)."""
        self.processor.stop()
        self.processor = ManagedProcess(self.argv, self.log_dir / "extproc-2.log", cwd=ROOT)
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as probe:
            self.processor.wait_ready(lambda: health(probe) == 1, timeout_s=30)

    def wait_for_a_passed_health_check(self) -> None:
        """Until one of Envoy's health checks made from now on has passed: over a connection
        of its own, so through both sides' certificate checks."""
        passed = self.envoy.stats().get(HEALTH_CHECKS_PASSED, 0)
        assert wait_until(
            lambda: (
                self.envoy.stats().get(HEALTH_CHECKS_PASSED, 0) > passed
                and self.envoy.processor_health(self.port) == "healthy"
            ),
            30,
        ), self.envoy.stats()


HEALTH_CHECKS_PASSED = "cluster.quota_extproc.health_check.success"
WRONG_NAME = "cluster.quota_extproc.ssl.fail_verify_san"
TENANT = "tls"


@contextmanager
def tls_gateway(d: Path, certs: Certs, redis_server: RedisServer, backend: int):
    """Envoy and one processor over mutual TLS, each side's files from a mounted Secret."""
    secret = MountedSecret(d / "secret")
    secret.swap(*certs.server, certs.ca)
    envoy_secret = MountedSecret(d / "envoy-secret")
    envoy_secret.swap(*certs.client, certs.ca)
    port, health_port = free_ports(2)
    config = write_config(
        d / "quota.yaml",
        processor_config(
            {TENANT: {"limits": {"*": {"rpm": 1000, "tpm": 1_000_000}}, "window_s": 3600}},
            redis_url=redis_server.url,
            tls={
                "cert_file": secret.path("tls.crt"),
                "key_file": secret.path("tls.key"),
                "client_ca_file": secret.path("ca.crt"),
            },
            health_listen=f"127.0.0.1:{health_port}",
        ),
    )
    argv = [sys.executable, "-m", "extproc", "serve", "--config", str(config),
            "--listen", f"127.0.0.1:{port}", "--drain-delay-s", "0"]  # fmt: skip
    processor = ManagedProcess(argv, d / "extproc.log", cwd=ROOT)
    envoy: Envoy | None = None
    gw: TlsGateway | None = None
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        with tls_channel(port, certs.ca, certs.client) as channel:
            processor.wait_ready(lambda: health(channel) == 1, timeout_s=30)
        ports = EnvoyPorts(*free_ports(2))
        tls = ProcessorTls(
            ca_file=envoy_secret.path("ca.crt"),
            cert_file=envoy_secret.path("tls.crt"),
            key_file=envoy_secret.path("tls.key"),
            secrets_dir=str(d),
            server_name=NAME,
        )
        write_processor_secrets(tls)
        bootstrap = d / "envoy.yaml"
        bootstrap.write_text(
            render_bootstrap(
                ports,
                [port],
                [backend],
                health_check=ProcessorHealthCheck(),
                processor_tls=tls,
            )
        )
        envoy = Envoy.launch(bootstrap, ports, d / "envoy.log")
        # Envoy's gRPC health check goes over the same mutual TLS.
        assert wait_until(lambda: envoy.processor_health(port) == "healthy", 30)
        gw = TlsGateway(envoy, processor, port, health_port, secret, envoy_secret, client, argv, d)
        yield gw
    finally:
        client.close()
        if envoy is not None:
            envoy.stop()
        (processor if gw is None else gw.processor).stop()  # the restarted one, if any


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    certs: Certs,
    redis_server: RedisServer,
    simulators: list[Simulator],
) -> Iterator[TlsGateway]:
    d = tmp_path_factory.mktemp("tls-gateway")
    with tls_gateway(d, certs, redis_server, simulators[0].port) as gw:
        yield gw


def envoy_serials(envoy: Envoy) -> tuple[set[int], set[int]]:
    """Serials of the client certificates and of the CAs Envoy's TLS contexts hold now."""
    status, text = http_get(f"http://127.0.0.1:{envoy.ports.admin}/certs")
    assert status == 200, text
    chains, cas = set(), set()
    for context in orjson.loads(text)["certificates"]:
        chains |= {int(c["serial_number"], 16) for c in context.get("cert_chain", [])}
        cas |= {int(c["serial_number"], 16) for c in context.get("ca_cert", [])}
    return chains, cas


def _stream(gateway: TlsGateway) -> tuple[int, int]:
    """One streamed request through Envoy: (events with text, completion tokens shown)."""
    client = openai.OpenAI(
        base_url=f"{gateway.envoy.base_url}/v1", api_key=tenant_key(TENANT), max_retries=0
    )
    chunks = list(
        client.chat.completions.create(
            model="gpt-4.1",
            messages=[{"role": "user", "content": "hello over mutual TLS"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage is not None
    return len(pieces), chunks[-1].usage.completion_tokens


def _ledger(gateway: TlsGateway) -> list[dict[str, str]]:
    return [fields for _, fields in gateway.redis.xrange(f"tq:{{{TENANT}}}:usage")]


def test_a_streamed_request_is_metered_over_mutual_tls(gateway: TlsGateway):
    before = len(_ledger(gateway))
    events, completion = _stream(gateway)
    assert events == completion >= 1
    # Settled and billed: one ledger entry for exactly what was streamed.
    assert wait_until(lambda: len(_ledger(gateway)) == before + 1, 10)
    entry = _ledger(gateway)[-1]
    assert int(entry["output_tokens"]) == completion
    assert entry["reason"] == "completed"
    stats = gateway.envoy.stats()
    assert stats["cluster.quota_extproc.ssl.handshake"] >= 1
    assert stats.get("cluster.quota_extproc.ssl.connection_error", 0) == 0


def test_a_client_without_a_valid_certificate_is_refused(gateway: TlsGateway, certs: Certs):
    with tls_channel(gateway.port, certs.ca, certs.client) as ok:
        assert health(ok) == health_pb2.HealthCheckResponse.SERVING  # the control
    with tls_channel(gateway.port, certs.ca, None) as no_cert:
        assert health(no_cert) == "UNAVAILABLE"
    with tls_channel(gateway.port, certs.ca, certs.rogue) as other_ca:
        assert health(other_ca) == "UNAVAILABLE"
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as plain:
        assert health(plain) == "UNAVAILABLE"
    # The health-only listener is plaintext for probes, and serves nothing else.
    with grpc.insecure_channel(f"127.0.0.1:{gateway.health_port}") as probe:
        assert health(probe) == health_pb2.HealthCheckResponse.SERVING
        process = probe.unary_unary(f"/{SERVICE}/Process")
        with pytest.raises(grpc.RpcError) as refused:
            process(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rotated_certificates_are_served_without_a_restart(gateway: TlsGateway, certs: Certs):
    assert served_serial(gateway.port, certs.ca, certs.client) == serial_of(certs.server[0])
    pid = gateway.processor.pid
    gateway.secret.swap(*certs.rotated, certs.ca)
    # The next handshake sees the new files (gRPC asks before each one).
    assert served_serial(gateway.port, certs.ca, certs.client) == serial_of(certs.rotated[0])
    assert gateway.processor.pid == pid and gateway.processor.proc.poll() is None
    assert "tls_certificates_reloaded" in gateway.processor.log_text()
    # Envoy's new connections get the rotated certificate; streams go on being billed.
    events, completion = _stream(gateway)
    assert events == completion >= 1
    # A rotation to a key that does not match its certificate is refused; the served one stays.
    gateway.secret.swap(certs.server[0], certs.rotated[1], certs.ca)
    assert served_serial(gateway.port, certs.ca, certs.client) == serial_of(certs.rotated[0])
    assert "tls_rotation_refused" in gateway.processor.log_text()
    gateway.secret.swap(*certs.rotated, certs.ca)


def test_envoy_takes_a_rotated_client_certificate_and_ca_without_a_restart(
    tmp_path: Path, certs: Certs, redis_server: RedisServer, simulators: list[Simulator]
):
    """Both sides move to a new CA by Secret updates alone. The processor is then restarted
    (a rolled pod), so Envoy must open a new connection: it can only with its rotated
    certificate, and only if it trusts the processor's new CA."""
    with tls_gateway(tmp_path, certs, redis_server, simulators[0].port) as gw:
        assert envoy_serials(gw.envoy) == ({serial_of(certs.client[0])}, {serial_of(certs.ca)})
        events, completion = _stream(gw)
        assert events == completion >= 1
        pid = gw.envoy.process.pid
        # Half a rotation (a key that does not match the new certificate) is refused and
        # logged; the certificate in use stays.
        gw.envoy_secret.swap(certs.next_client[0], certs.client[1], certs.ca)
        refused = "Failed to reload certificates"
        assert wait_until(lambda: refused in gw.envoy.process.log_text(), 30)
        assert envoy_serials(gw.envoy) == ({serial_of(certs.client[0])}, {serial_of(certs.ca)})
        gw.envoy_secret.swap(*certs.next_client, certs.next_ca)
        rotated = ({serial_of(certs.next_client[0])}, {serial_of(certs.next_ca)})
        assert wait_until(lambda: envoy_serials(gw.envoy) == rotated, 30), envoy_serials(gw.envoy)
        assert gw.envoy.process.pid == pid and gw.envoy.process.proc.poll() is None
        gw.secret.swap(*certs.next_server, certs.next_ca)
        handshakes = gw.envoy.stats()["cluster.quota_extproc.ssl.handshake"]
        before = len(_ledger(gw))
        gw.restart_processor()
        gw.wait_for_a_passed_health_check()
        events, completion = _stream(gw)
        assert events == completion >= 1
        assert wait_until(lambda: len(_ledger(gw)) == before + 1, 10)
        assert int(_ledger(gw)[-1]["output_tokens"]) == completion
        assert gw.envoy.stats()["cluster.quota_extproc.ssl.handshake"] > handshakes


def test_envoy_refuses_a_processor_certificate_for_another_name(
    tmp_path: Path, certs: Certs, redis_server: RedisServer, simulators: list[Simulator]
):
    """The name check stays with the CA taken from a Secret file: a processor serving a
    certificate of the right CA for another name gets no request."""
    with tls_gateway(tmp_path, certs, redis_server, simulators[0].port) as gw:
        refused = gw.envoy.stats().get(WRONG_NAME, 0)
        before = len(_ledger(gw))
        gw.secret.swap(*certs.misnamed, certs.ca)
        gw.restart_processor()
        assert wait_until(lambda: gw.envoy.stats().get(WRONG_NAME, 0) > refused, 30)
        with pytest.raises(openai.InternalServerError):
            _stream(gw)
        assert len(_ledger(gw)) == before
