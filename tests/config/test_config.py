"""The configuration file: validation naming the wrong field, normal form and its hash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.config import ConfigError, LimitRule, WindowSpec, parse_config
from stack.envoy import EnvoyPorts, render_bootstrap, validate

ROOT = Path(__file__).resolve().parents[2]
STACK_CONFIG = ROOT / "stack" / "quota.yaml"


def base_doc() -> dict[str, Any]:
    return yaml.safe_load(STACK_CONFIG.read_text())


def test_stack_config_is_valid_and_resolves_aliases_to_one_quota_model() -> None:
    config = parse_config(base_doc())
    assert config.resolve_model("my-gpt-alias") is config.resolve_model("gpt-4.1-2025-04-14")
    assert config.resolve_model("my-gpt-alias").name == "gpt-4.1"
    assert config.resolve_model("nope") is None


def test_tenant_overrides_are_merged_over_the_plan() -> None:
    doc = base_doc()
    doc["tenants"]["acme"]["overrides"] = {"limits": {"gpt-4.1": {"rpm": 7}}, "batch_tokens": 128}
    config = parse_config(doc)
    plan = config.tenants["acme"].plan
    minute = WindowSpec(kind="fixed", seconds=60)
    assert plan.limits["gpt-4.1"].rules == (LimitRule("requests", 7, minute),)
    assert plan.limits["*"].rules == (  # inherited from the plan
        LimitRule("requests", 20, minute),
        LimitRule("tokens", 4000, minute),
    )
    assert plan.name == "free"
    assert plan.batch_tokens == 128
    assert config.plans["free"].batch_tokens == 32  # the plan itself is untouched


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["plans"]["free"].update(batch_tokens=0), "plans.free.batch_tokens"),
        (lambda d: d["plans"]["free"].update(charge_mode="later"), "plans.free.charge_mode"),
        (lambda d: d["plans"]["free"]["limits"]["*"].update(rpm="ten"), "plans.free.limits.*.rpm"),
        (lambda d: d["tenants"]["acme"].update(plan="gold"), "tenants.acme.plan"),
        (lambda d: d["tenants"]["acme"].update(key_sha256=["abc"]), "tenants.acme.key_sha256[0]"),
        (lambda d: d["models"]["gpt-4.1"].update(default_max_tokens=99999),
         "models.gpt-4.1.default_max_tokens"),
        (lambda d: d["models"].update({"other": {"aliases": ["my-gpt-alias"]}}),
         "models.other"),
        (lambda d: d.update(redis_url="http://x"), "redis_url"),
        (lambda d: d.update(colour="blue"), "colour"),
        (lambda d: d.update(quota_timeout_ms=0), "quota_timeout_ms"),
        (lambda d: d["models"]["gpt-4.1"].update(continuous_usage="yes"),
         "models.gpt-4.1.continuous_usage"),
        (lambda d: d["models"]["gpt-4.1"].update(reserve_max=1), "models.gpt-4.1.reserve_max"),
        (lambda d: d["models"]["gpt-4.1"].update(upstream_name=""), "models.gpt-4.1.upstream_name"),
        (lambda d: d["models"]["gpt-4.1"].update(upstream_api_key_env="TQ_NO_SUCH_VARIABLE"),
         "models.gpt-4.1.upstream_api_key_env"),
        (lambda d: d["models"]["gpt-4.1"].update(upstream_api_key_file="/nonexistent/key"),
         "models.gpt-4.1.upstream_api_key_file"),
        (lambda d: d["models"]["gpt-4.1"].update(upstream_api_key_env="HOME",
                                                 upstream_api_key_file="/etc/hostname"),
         "models.gpt-4.1"),
        (lambda d: d["plans"]["free"].update(on_backend_failure="allow"),
         "plans.free.on_backend_failure"),
        (lambda d: d["plans"]["free"].update(fail_open_fraction=0),
         "plans.free.fail_open_fraction"),
        (lambda d: d["plans"]["free"].update(fail_open_fraction=1.5),
         "plans.free.fail_open_fraction"),
        (lambda d: d["plans"]["free"].update(fail_open_fraction=True),
         "plans.free.fail_open_fraction"),
        (lambda d: d["tenants"]["acme"].update(overrides={"on_backend_failure": "ajar"}),
         "tenants.acme.overrides.on_backend_failure"),
        (lambda d: d["tenants"]["acme"].update(overrides={"fail_open_fraction": "a tenth"}),
         "tenants.acme.overrides.fail_open_fraction"),
        (lambda d: d.update(circuit_breaker=[5]), "circuit_breaker"),
        (lambda d: d.update(circuit_breaker={"failures": 0}), "circuit_breaker.failures"),
        (lambda d: d.update(circuit_breaker={"probe_interval_ms": 0.5}),
         "circuit_breaker.probe_interval_ms"),
        (lambda d: d.update(circuit_breaker={"probes": 1}), "circuit_breaker.probes"),
        (lambda d: d.update(settle_queue_max=0), "settle_queue_max"),
    ],
)  # fmt: skip
def test_invalid_config_error_names_the_wrong_field(mutate: Any, field: str) -> None:
    doc = base_doc()
    mutate(doc)
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.path == field


def test_hash_changes_with_any_limit_and_not_with_key_order() -> None:
    doc = base_doc()
    same = yaml.safe_load(yaml.safe_dump(doc, sort_keys=True))
    assert parse_config(doc).hash == parse_config(same).hash
    doc["plans"]["pro"]["limits"]["*"]["tpm"] += 1
    assert parse_config(doc).hash != parse_config(same).hash


def test_replicas_listening_on_different_addresses_share_one_hash() -> None:
    doc = base_doc()
    other = {**base_doc(), "listen": "0.0.0.0:50099"}
    assert parse_config(doc).normalised["listen"] != parse_config(other).normalised["listen"]
    assert parse_config(doc).hash == parse_config(other).hash


def test_normal_form_hides_the_redis_password() -> None:
    doc = base_doc()
    doc["redis_url"] = "rediss://quota:s3cret@redis.internal:6380/2"
    normalised = orjson.dumps(parse_config(doc).normalised)
    assert b"s3cret" not in normalised


def test_check_config_command_prints_hash_and_exits_non_zero_naming_the_field(
    tmp_path: Path,
) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(STACK_CONFIG)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    printed = orjson.loads(ok.stdout)
    assert printed["config_hash"] == parse_config(base_doc()).hash
    doc = base_doc()
    doc["plans"]["free"]["window_s"] = -5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    failed = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(bad)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "plans.free.window_s" in failed.stderr


@pytest.mark.parametrize("processors,backends", [(1, 1), (2, 2)])
def test_rendered_envoy_bootstrap_passes_envoy_validate(
    tmp_path: Path, processors: int, backends: int
) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(
        render_bootstrap(
            EnvoyPorts(listen=10000, admin=9901),
            list(range(50051, 50051 + processors)),
            list(range(8001, 8001 + backends)),
        )
    )
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_stack_models_are_all_served_by_the_stacks_simulator_profile() -> None:
    profile = yaml.safe_load((ROOT / "simulator_profiles" / "fast.yaml").read_text())
    served = {profile["model"], *profile.get("served-model-name", [])}
    config = parse_config(base_doc())
    names = {name for m in config.models.values() for name in (m.name, *m.aliases)}
    assert names <= served, names - served


def test_an_upstream_key_is_read_from_its_file_and_never_shown(tmp_path: Path) -> None:
    secret = "sk-upstream-very-secret"
    (tmp_path / "key").write_text(secret + "\n")
    doc = base_doc()
    doc["models"]["gpt-4.1"]["upstream_api_key_file"] = str(tmp_path / "key")
    config = parse_config(doc)
    assert config.models["gpt-4.1"].upstream_authorization == f"Bearer {secret}"
    assert secret not in orjson.dumps(config.normalised).decode()
    assert secret not in repr(config.models["gpt-4.1"])
    assert config.normalised["models"]["gpt-4.1"]["upstream_credential"] is True
