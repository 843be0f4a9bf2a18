"""TLS for the gRPC listener: server credentials that follow the certificate files.

gRPC asks ``fetch`` before each new TLS handshake; it re-reads the three files and hands
gRPC a new certificate configuration only when their content changed and the new pair is
usable. So a rotated certificate (a Kubernetes Secret update swaps the mounted files) is
served from the next connection on, without a restart; connections already open keep the
certificate they were made with. A half-written rotation (a key that does not match the
new certificate, a file missing) keeps the current certificate and is logged once.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc
import structlog

from extproc.config.schema import ListenerTls

log = structlog.get_logger("extproc.tls")


@dataclass(frozen=True, slots=True)
class _Material:
    cert: bytes
    key: bytes
    client_ca: bytes | None


class RotatingCredentials:
    """``grpc.dynamic_ssl_server_credentials`` over the files of a ``ListenerTls``."""

    def __init__(self, tls: ListenerTls) -> None:
        self.tls = tls
        material = self._read()
        problem = self._check(material)
        if problem is not None:
            raise ValueError(f"TLS certificate {tls.cert_file} / key {tls.key_file}: {problem}")
        self._current = material
        self._refused: _Material | None = None
        self.reloads = 0  # certificate changes taken since start

    def _read(self) -> _Material:
        tls = self.tls

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        ca = read(tls.client_ca_file) if tls.client_ca_file is not None else None
        return _Material(read(tls.cert_file), read(tls.key_file), ca)

    def _check(self, material: _Material) -> str | None:
        """Why the files can't be served (None: they can). The pair is loaded the way
        OpenSSL will; files that changed while being checked are a rotation in progress."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            if self.tls.client_ca_file is not None:
                context.load_verify_locations(self.tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            return str(exc)
        if self._read() != material:
            return "the files changed while being read"
        return None

    def _configuration(self, material: _Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)], root_certificates=material.client_ca
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before a handshake: a new configuration, or None to keep the one
        in use. Never raises (an exception here would fail the handshake)."""
        try:
            material = self._read()
        except OSError as exc:
            if self._refused is None:
                log.warning("tls_files_unreadable", error=str(exc))
                self._refused = _Material(b"", b"", None)
            return None
        if material == self._current or material == self._refused:
            return None
        problem = self._check(material)
        if problem is not None:
            log.warning("tls_rotation_refused", cert_file=self.tls.cert_file, error=problem)
            self._refused = material
            return None
        self._current, self._refused = material, None
        self.reloads += 1
        log.info("tls_certificates_reloaded", cert_file=self.tls.cert_file, reloads=self.reloads)
        return self._configuration(material)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self._current),
            # grpc documents None as "no change"; typeshed's stub omits it.
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self.tls.require_client_cert,
        )
