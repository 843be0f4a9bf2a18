"""The roll-out example of docs/limits.md: an enforced limit and a shadow one of the same
metric and window load, and count on keys of their own; the shadow one never changes what
the enforced one charges or reports. (End to end: tests/gateway/test_upstream_integrity.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from extproc.admission.policy import PolicyBook
from extproc.admission.ratelimit_headers import ratelimit_headers
from extproc.config import parse_config
from extproc.quota.base import CounterState

ROOT = Path(__file__).resolve().parents[2]


def readme_rollout_example() -> dict[str, Any]:
    """The docs' YAML example with the rule 'being rolled out', as it is printed."""
    page = (ROOT / "docs" / "limits.md").read_text()
    block = next(
        b for b in re.findall(r"```yaml[^\n]*\n(.*?)```", page, re.S) if "being rolled out" in b
    )
    return yaml.safe_load(block)


def test_the_readme_example_loads_and_its_shadow_rule_has_its_own_counter() -> None:
    doc = readme_rollout_example()
    doc["tenants"] = {"acme": {"plan": "team", "key_sha256": ["0" * 64]}}
    config = parse_config(doc)
    tenant = config.tenants["acme"]
    policy = PolicyBook(config.key_prefix, config.models).policy(tenant, "gpt-4.1")
    tokens = [c for c in policy.token_counters if c.kind.endswith("tpm")]
    enforced = next(c for c in tokens if not c.shadow and c.kind == "tpm")
    shadow = next(c for c in tokens if c.shadow)
    assert (enforced.limit, shadow.limit) == (100000, 50000)
    assert shadow.kind == "shadow_tpm" and enforced.key != shadow.key
    assert len({c.key for c in (*policy.request_counters, *policy.token_counters)}) == len(
        policy.request_counters
    ) + len(policy.token_counters)


def test_a_shadow_rule_of_the_same_window_is_left_out_of_what_the_client_is_quoted() -> None:
    doc = {
        "models": {"gpt-4.1": {"tokenizer": "o200k_base"}},
        "plans": {
            "p": {
                "limits": {
                    "*": {
                        "tpm": 1000,
                        "rules": [{"metric": "tokens", "limit": 150, "shadow": True}],
                    }
                }
            }
        },
        "tenants": {"t": {"plan": "p", "key_sha256": ["1" * 64]}},
    }
    config = parse_config(doc)
    policy = PolicyBook(config.key_prefix, config.models).policy(config.tenants["t"], "gpt-4.1")
    counters = sorted((c.kind, c.limit, c.shadow, c.key) for c in policy.token_counters)
    assert [c[:3] for c in counters] == [("shadow_tpm", 150, True), ("tpm", 1000, False)]
    assert counters[0][3] != counters[1][3]
    assert policy.enforced_token_kinds == {"tpm"}
    # The states a charge returns: one per counter, the shadow one over its limit.
    states = (CounterState("shadow_tpm", 150, 0, 60.0), CounterState("tpm", 1000, 40, 60.0))
    headers = dict(ratelimit_headers(policy.enforced(states)))
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == (
        "1000",
        "40",
    )
