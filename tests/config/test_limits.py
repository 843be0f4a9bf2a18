"""Limits configuration (issue 13): the general rule form and its sugar, sliding and
calendar windows, input/output and cost limits, shadow mode, the envoyproxy/ratelimit
format; every invalid fixture fails with the error its first line names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.config import (
    ConfigError,
    LimitRule,
    LimitSpec,
    PriceSpec,
    WindowSpec,
    load_config,
    parse_config,
)
from extproc.config.schema import NANO_PER_UNIT, Config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
INVALID = sorted((FIXTURES / "invalid").glob("*.yaml"))
SEED = ROOT / "envoy_config" / "ratelimit" / "ai-gateway.yaml"
MINUTE = WindowSpec(kind="fixed", seconds=60)
KEY = "0" * 63


def key(n: int) -> list[str]:
    return [f"{KEY}{n}"]


def expected_error(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), f"{path.name}: the first line must be '# <expected error>'"
    return first[2:]


@pytest.mark.parametrize("fixture", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_fixture_fails_with_the_error_on_its_first_line(fixture: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(fixture)
    assert str(info.value) == expected_error(fixture)


def test_every_invalid_fixture_is_valid_yaml_and_there_are_many() -> None:
    # A fixture whose YAML does not parse would "pass" on the wrong error.
    for path in INVALID:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path.name
    assert len(INVALID) >= 60


def load_doc(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def load(name: str) -> Config:
    return load_config(FIXTURES / "valid" / f"{name}.yaml")


def test_sugar_and_rules_of_one_model_are_one_sorted_rule_list() -> None:
    config = load("io_limits")
    spec = config.plans["p"].limits["gpt-4.1"]
    hour = WindowSpec(kind="fixed", seconds=3600)
    assert spec == LimitSpec(
        rules=(
            LimitRule("requests", 100, hour),
            LimitRule("tokens", 50_000, hour),
            LimitRule("tokens", 1_000_000, WindowSpec(kind="calendar", period="day")),
            LimitRule("input_tokens", 40_000, hour),
            LimitRule("output_tokens", 500, WindowSpec(kind="fixed", seconds=10), name="burst"),
            LimitRule("output_tokens", 8_000, hour),
        ),
        batch_tokens=64,
    )
    assert config.plans["p"].limits["*"] == LimitSpec(rules=())  # allowed, unlimited


def test_sliding_plan_windows_default_to_sixty_buckets_and_rules_keep_their_own() -> None:
    config = load("sliding")
    minute = config.plans["minute"]
    assert {r.window for r in minute.limits["*"].rules} == {
        WindowSpec(kind="sliding", seconds=60, bucket_s=1)
    }
    assert minute.tenant_rules == (
        LimitRule("tokens", 9000, WindowSpec(kind="sliding", seconds=60, bucket_s=1)),
    )
    hourly = config.plans["hourly"]
    assert hourly.limits["*"].rules == (
        LimitRule("tokens", 100_000, WindowSpec(kind="sliding", seconds=3600, bucket_s=60)),
    )
    assert hourly.limits["gpt-4.1"].rules == (
        LimitRule("requests", 10, WindowSpec(kind="sliding", seconds=3600, bucket_s=60)),
        LimitRule("tokens", 50, WindowSpec(kind="sliding", seconds=10, bucket_s=5)),
        # A sliding rule of another length gets that length's own default bucket.
        LimitRule("tokens", 5000, WindowSpec(kind="sliding", seconds=600, bucket_s=10)),
    )
    coarse = config.plans["coarse"]
    assert coarse.limits["*"].rules[0].window == WindowSpec("sliding", 60, 15)


def test_calendar_budgets_use_the_plan_time_zone_unless_the_rule_names_one() -> None:
    config = load("calendar")
    paris = config.plans["paris"]

    def cal(period: str, zone: str = "Europe/Paris") -> WindowSpec:
        return WindowSpec(kind="calendar", period=period, timezone=zone)  # type: ignore[arg-type]

    assert paris.tenant_rules == (
        LimitRule("tokens", 1_000, cal("day", "America/New_York"), name="ny-day"),
        LimitRule("tokens", 1_000, cal("day")),
        LimitRule("tokens", 5_000, cal("week")),
        LimitRule("tokens", 20_000, cal("month")),
    )
    assert config.plans["utc"].tenant_rules == (LimitRule("tokens", 7, cal("month", "UTC")),)
    # A tenant moving to another zone moves every calendar budget its plan sugar defines.
    tokyo = config.tenants["tokyo-corp"].plan
    assert {r.window.timezone for r in tokyo.tenant_rules} == {"Asia/Tokyo", "America/New_York"}
    assert tokyo.name == "paris"


def test_prices_and_cost_limits_are_exact_nano_units() -> None:
    config = load("cost")
    # Per million tokens: 2.50 → 2500 nano-units a token; 0.075 → 75; 10 → 10000.
    assert config.models["gpt-4.1"].prices == PriceSpec(input=2500, output=10_000, cached_input=75)
    assert config.models["mini"].prices == PriceSpec(input=150, output=600)
    plan = config.plans["metered"]
    assert plan.limits["*"].rules == (LimitRule("cost", 1_230_000_000, MINUTE),)  # 1.23
    assert plan.tenant_rules == (
        LimitRule("cost", 1, MINUTE, name="one-nano"),
        LimitRule("cost", 20 * NANO_PER_UNIT, WindowSpec(kind="calendar", period="day")),
        LimitRule("cost", 333_333_333_333, WindowSpec(kind="calendar", period="month")),
    )
    assert config.normalised["plans"]["metered"]["limits"]["*"]["rules"][0] == {
        "metric": "cost",
        "limit": 1_230_000_000,
        "unit": "nano",
        "window": {"kind": "fixed", "seconds": 60},
        "shadow": False,
        "name": "",
    }
    assert config.normalised["models"]["gpt-4.1"]["prices"]["input"] == 2500


def test_decimal_prices_never_go_through_floats() -> None:
    # 0.1 + 0.2 in binary floats is 0.30000000000000004: as decimals it is 300 nano a token.
    doc = {
        "models": {"m": {"prices": {"input": 0.3, "output": "0.000001e6"}}},
        "plans": {"p": {"limits": {"*": {"cost": "0.000000001"}}}},
        "tenants": {},
    }
    config = parse_config(doc)
    assert config.models["m"].prices == PriceSpec(input=300, output=1000)
    assert config.plans["p"].limits["*"].rules[0].limit == 1


def test_shadow_plan_marks_every_rule_and_a_tenant_can_turn_it_off() -> None:
    config = load("shadow")
    trial = config.plans["trial"]
    rules = [*trial.tenant_rules, *(r for s in trial.limits.values() for r in s.rules)]
    assert rules and all(r.shadow for r in rules)
    live = config.tenants["live"].plan
    assert [r.shadow for r in live.limits["*"].rules] == [False, False]
    # A rule that is shadow on its own stays shadow whatever the plan says.
    assert [(r.metric, r.shadow) for r in config.plans["mixed"].limits["*"].rules] == [
        ("tokens", True),
        ("tokens", False),
    ]


def test_tenant_overrides_replace_a_model_entry_and_re_read_the_plan_window() -> None:
    config = load("sliding")
    plan = config.tenants["slider"].plan
    assert plan.name == "minute"
    assert plan.limits["*"].rules == (
        LimitRule("requests", 5, WindowSpec("sliding", 60, 1)),
        LimitRule("tokens", 3000, WindowSpec("sliding", 60, 1)),
    )
    assert plan.limits["gpt-4.1"].rules == (LimitRule("tokens", 10, WindowSpec("sliding", 60, 1)),)


def seed_config() -> Path:
    """Tenants of both seed plans; ``ratelimit_file`` is relative to this file's directory."""
    return FIXTURES / "valid" / "rls_seed.yaml"


def test_the_issue_seed_rls_file_loads_verbatim_into_both_plans() -> None:
    named = seed_config().parent / load_doc(seed_config())["ratelimit_file"]
    assert named.resolve() == SEED  # the repository's file itself, verbatim
    config = load_config(seed_config())
    standard, enterprise = config.plans["standard"], config.plans["enterprise"]
    assert standard.limits == {
        "*": LimitSpec(
            rules=(LimitRule("requests", 60, MINUTE), LimitRule("tokens", 100_000, MINUTE))
        )
    }
    assert enterprise.limits == {
        "*": LimitSpec(
            rules=(LimitRule("requests", 1000, MINUTE), LimitRule("tokens", 2_000_000, MINUTE))
        )
    }
    assert standard.tenant_rules == enterprise.tenant_rules == ()
    assert standard.batch_tokens == 32  # only in RLS: default settings
    assert enterprise.batch_tokens == 128  # its other settings from plans:
    assert config.tenants["acme"].plan is standard
    assert config.tenants["globex"].plan is enterprise


def plans_equivalent_of_the_seed() -> dict[str, Any]:
    return {
        "models": {"gpt-4.1": {"aliases": ["gpt-4.1-2025-04-14"]}, "mini": {}},
        "plans": {
            "standard": {"limits": {"*": {"rpm": 60, "tpm": 100_000}}},
            "enterprise": {"batch_tokens": 128, "limits": {"*": {"rpm": 1000, "tpm": 2_000_000}}},
        },
        "tenants": {
            "acme": {"plan": "standard", "key_sha256": key(1)},
            "globex": {"plan": "enterprise", "key_sha256": key(2)},
        },
    }


def check_config(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return orjson.loads(out.stdout)


def test_the_seed_and_its_plans_yaml_print_one_normal_form_and_hash(tmp_path: Path) -> None:
    plans = tmp_path / "plans.yaml"
    plans.write_text(yaml.safe_dump(plans_equivalent_of_the_seed()))
    from_rls, from_plans = check_config(seed_config()), check_config(plans)
    assert from_rls == from_plans
    assert from_rls["config"]["plans"]["standard"]["limits"]["*"]["rules"][1]["limit"] == 100_000


def test_every_rls_feature_and_its_plans_yaml_have_one_normal_form() -> None:
    rls, plans = load("rls_features"), load("rls_features_as_plans")
    assert rls.normalised == plans.normalised
    assert rls.hash == plans.hash
    for tenant in rls.tenants:
        assert rls.tenants[tenant].plan == plans.tenants[tenant].plan


def test_rls_layers_every_plan_then_plan_then_tenant_per_model_and_metric() -> None:
    config = load("rls_features")
    day = WindowSpec(kind="calendar", period="day")
    pro = config.plans["pro"]
    # Every plan: rpm 100/min on "*"; pro's tpm and its gpt-4.1 entry come on top.
    assert pro.limits["*"].rules == (
        LimitRule("requests", 100, MINUTE, name="base-rpm"),
        LimitRule("tokens", 10_000, MINUTE, name="pro-tpm"),
    )
    assert pro.limits["gpt-4.1"].rules == (
        LimitRule("requests", 100, MINUTE, name="base-rpm"),
        LimitRule("tokens", 5000, WindowSpec(kind="fixed", seconds=3600), shadow=True),
        LimitRule("cost", 12_500_000_000, day),
    )
    assert config.plans["basic"].limits == {
        "*": LimitSpec(rules=(LimitRule("requests", 100, MINUTE, name="base-rpm"),)),
    }
    acme = config.tenants["acme"].plan
    assert acme.name == "pro"
    # acme's own "*" tpm takes the place of pro's tpm on every model, gpt-4.1's included;
    # its gpt-4.1 rpm is unlimited; its mini limits replace two inherited ones by name.
    acme_tpm = LimitRule("tokens", 50_000, MINUTE, name="acme-tpm")
    assert acme.limits["*"].rules == (LimitRule("requests", 100, MINUTE, name="base-rpm"), acme_tpm)
    assert acme.limits["gpt-4.1"].rules == (acme_tpm, LimitRule("cost", 12_500_000_000, day))
    assert acme.limits["mini"].rules == (
        LimitRule("output_tokens", 10, WindowSpec(kind="fixed", seconds=1)),
        LimitRule("cost", 3 * NANO_PER_UNIT, WindowSpec(kind="calendar", period="month")),
    )
    assert config.tenants["initech"].plan is pro


def test_check_config_prints_rules_expanded_and_names_the_descriptor_on_error(
    tmp_path: Path,
) -> None:
    printed = check_config(FIXTURES / "valid" / "rls_features.yaml")
    rules = printed["config"]["tenants"]["acme"]["plan"]["limits"]["gpt-4.1"]["rules"]
    assert rules[1] == {
        "metric": "cost",
        "limit": 12_500_000_000,
        "unit": "nano",
        "window": {"kind": "calendar", "period": "day", "timezone": "UTC"},
        "shadow": False,
        "name": "",
    }
    bad = FIXTURES / "invalid" / "rls_plan_under_a_tenant_with_a_value.yaml"
    failed = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(bad)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert failed.returncode == 2
    assert "ratelimit.descriptors[0].descriptors[0] (key=plan, value=standard)" in failed.stderr


def test_a_ratelimit_file_that_cannot_be_read_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "quota.yaml"
    doc = {**plans_equivalent_of_the_seed(), "ratelimit_file": "no.yaml"}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == "ratelimit_file"
    assert str(tmp_path / "no.yaml") in str(info.value)
    (tmp_path / "no.yaml").write_text("domain: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML") as info:
        load_config(path)
    assert info.value.path == "ratelimit_file"


def test_rls_errors_in_a_file_name_ratelimit_file_descriptors(tmp_path: Path) -> None:
    (tmp_path / "rls.yaml").write_text(
        yaml.safe_dump({"domain": "d", "descriptors": [{"key": "user"}]})
    )
    path = tmp_path / "quota.yaml"
    doc = {**plans_equivalent_of_the_seed(), "ratelimit_file": "rls.yaml"}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == "ratelimit_file.descriptors[0] (key=user)"


def test_hash_changes_with_a_window_kind_a_time_zone_a_price_and_shadow() -> None:
    base = yaml.safe_load((FIXTURES / "valid" / "cost.yaml").read_text())
    hashes = {parse_config(base).hash}
    for mutate in (
        lambda d: d["plans"]["metered"].update(window="sliding"),
        lambda d: d["plans"]["metered"].update(timezone="Europe/Berlin"),
        lambda d: d["models"]["mini"]["prices"].update(output="0.601"),
        lambda d: d["plans"]["metered"].update(shadow=True),
    ):
        doc = yaml.safe_load(yaml.safe_dump(base))
        mutate(doc)
        hashes.add(parse_config(doc).hash)
    assert len(hashes) == 5


def test_the_reload_poll_sees_an_edit_of_the_ratelimit_file(tmp_path: Path) -> None:
    from extproc.app.reload import _content_digest

    rls = tmp_path / "rls" / "limits.yaml"
    rls.parent.mkdir()
    rls.write_bytes(SEED.read_bytes())
    path = tmp_path / "quota.yaml"
    doc = {**plans_equivalent_of_the_seed(), "plans": {}, "ratelimit_file": "rls/limits.yaml"}
    path.write_text(yaml.safe_dump(doc))
    before = _content_digest(path)
    assert before is not None and load_config(path).plans["standard"].limits["*"].rules
    rls.write_text(SEED.read_text().replace("requests_per_unit: 60}", "requests_per_unit: 61}"))
    after = _content_digest(path)
    assert after != before
    assert load_config(path).plans["standard"].limits["*"].rules[0].limit == 61
    rls.unlink()
    assert _content_digest(path) not in (None, before, after)  # gone: a change, reported


def test_a_tenant_subtree_layers_over_its_yaml_plan_per_metric() -> None:
    doc = {
        "models": {"gpt-4.1": {}},
        "plans": {"free": {"window": "sliding", "limits": {"*": {"rpm": 20, "tpm": 4000}}}},
        "tenants": {
            "acme": {"plan": "free", "key_sha256": key(1)},
            "globex": {"plan": "free", "key_sha256": key(2)},
        },
        "ratelimit": {
            "domain": "d",
            "descriptors": [
                {
                    "key": "tenant",
                    "value": "acme",
                    "descriptors": [
                        {
                            "key": "metric",
                            "value": "tpm",
                            "rate_limit": {"unit": "hour", "requests_per_unit": 90_000},
                        }
                    ],
                }
            ],
        },
    }
    config = parse_config(doc)
    sliding = WindowSpec("sliding", 60, 1)
    assert config.tenants["acme"].plan.limits["*"].rules == (
        LimitRule("requests", 20, sliding),  # the plan's, in the plan's window
        LimitRule("tokens", 90_000, WindowSpec("fixed", 3600)),  # the tenant's, in place
    )
    assert config.tenants["acme"].plan.name == "free"
    assert config.tenants["globex"].plan is config.plans["free"]
