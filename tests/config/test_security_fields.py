"""The configuration fields of TLS on the listener and of Redis credentials: validated at
load, secrets never in the normal form, and a changed one needs a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.app.reload import needs_restart
from extproc.config import ConfigError, parse_config

BASE: dict[str, Any] = {
    "models": {"m": {}},
    "plans": {"p": {"limits": {"*": {"rpm": 1}}}},
    "tenants": {"t": {"plan": "p", "key_sha256": ["0" * 64]}},
}


def _files(tmp_path: Path) -> dict[str, str]:
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).write_text("pem")
    return {
        "cert_file": str(tmp_path / "tls.crt"),
        "key_file": str(tmp_path / "tls.key"),
        "client_ca_file": str(tmp_path / "ca.crt"),
    }


def test_a_client_ca_means_mutual_tls_by_default(tmp_path: Path):
    config = parse_config({**BASE, "tls": _files(tmp_path)})
    assert config.tls is not None and config.tls.require_client_cert is True
    assert config.normalised["tls"]["client_ca_file"] == str(tmp_path / "ca.crt")
    server_only = {k: v for k, v in _files(tmp_path).items() if k != "client_ca_file"}
    assert parse_config({**BASE, "tls": server_only}).tls.require_client_cert is False  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("tls", "path"),
    [
        ({"key_file": "/nonexistent.key"}, "tls.key_file"),
        ({"cert_file": "/nonexistent.crt", "key_file": "/nonexistent.key"}, "tls.cert_file"),
        ({"require_client_cert": True}, "tls.require_client_cert"),
        ({"colour": "blue"}, "tls.colour"),
    ],
)
def test_a_wrong_tls_section_names_its_field(tmp_path: Path, tls: dict[str, Any], path: str):
    files = {k: v for k, v in _files(tmp_path).items() if k != "client_ca_file"}
    with pytest.raises(ConfigError) as refused:
        parse_config({**BASE, "tls": {**files, **tls}})
    assert refused.value.path == path


def test_a_tls_section_needs_a_certificate():
    with pytest.raises(ConfigError) as refused:
        parse_config({**BASE, "tls": {"key_file": "k"}})
    assert refused.value.path == "tls.cert_file"


def test_the_redis_password_comes_from_a_file_or_the_environment_never_the_normal_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "password").write_text("s3cret\n")
    from_file = parse_config(
        {**BASE, "redis_username": "extproc", "redis_password_file": str(tmp_path / "password")}
    )
    assert (from_file.redis_username, from_file.redis_password) == ("extproc", "s3cret")
    assert from_file.normalised["redis_auth"] == {"username": "extproc", "password": True}
    assert "s3cret" not in repr(from_file) and "s3cret" not in str(from_file.normalised)
    monkeypatch.setenv("REDIS_PASSWORD_FOR_TEST", "other")
    from_env = parse_config({**BASE, "redis_password_env": "REDIS_PASSWORD_FOR_TEST"})
    assert from_env.redis_password == "other"
    assert from_file.hash != from_env.hash  # a user is set in one only
    with pytest.raises(ConfigError, match="not both"):
        parse_config(
            {**BASE, "redis_password_env": "X", "redis_password_file": str(tmp_path / "password")}
        )
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        parse_config({**BASE, "redis_password_file": str(tmp_path / "empty")})
    # A new password is a new connection: not something a reload can apply.
    (tmp_path / "password").write_text("rotated\n")
    rotated = parse_config(
        {**BASE, "redis_username": "extproc", "redis_password_file": str(tmp_path / "password")}
    )
    assert rotated.hash == from_file.hash
    assert needs_restart(from_file, rotated) == ["redis_auth"]


def test_the_health_listener_is_per_replica(tmp_path: Path):
    one = parse_config({**BASE, "health_listen": "0.0.0.0:50052"})
    other = parse_config({**BASE, "health_listen": "127.0.0.1:50053"})
    assert one.hash == other.hash
    assert needs_restart(one, other) == ["health_listen"]
