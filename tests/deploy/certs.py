"""Throwaway certificates for TLS tests, made with the ``openssl`` CLI (EC P-256, one day)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key),
             "-out", str(crt))  # fmt: skip
    return crt, key


def make_leaf(directory: Path, ca: tuple[Path, Path], name: str, san: str) -> tuple[Path, Path]:
    """A certificate signed by ``ca``: (cert, key)."""
    key, csr = directory / f"{name}.key", directory / f"{name}.csr"
    crt, ext = directory / f"{name}.crt", directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "1",
             "-extfile", str(ext), "-out", str(crt))  # fmt: skip
    return crt, key


def serial_of(cert: Path) -> int:
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-serial", "-in", str(cert)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    return int(out.strip().split("=", 1)[1], 16)
