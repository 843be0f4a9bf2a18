"""Per model, whose figure bills its tokens when the meter and the upstream disagree
(docs/billing.md, "Who is authoritative"): the defaults follow the tokenizer it is counted
with, a model may state its own, and check-config shows the result."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.config import ConfigError, parse_config


def models(**specs: dict[str, Any]) -> dict[str, Any]:
    return {"models": specs, "plans": {}, "tenants": {}}


@pytest.mark.parametrize(
    ("name", "spec", "authority", "tolerance"),
    [
        ("gpt-4.1", {"tokenizer": "o200k_base"}, "meter", 0.15),  # its own, configured
        ("gpt-4o-mini", {}, "meter", 0.15),  # its own, from the built-in table
        ("mixtral-8x7b-instruct", {}, "meter", 0.15),  # the Mistral v1 vocabulary
        ("served", {"tokenizer": "o200k_base", "upstream_name": "gpt-4o"}, "meter", 0.15),
        ("my-alias", {"tokenizer": "o200k_base", "aliases": ["gpt-4.1-mini"]}, "meter", 0.15),
        ("llama-3-8b", {"tokenizer": "o200k_base"}, "upstream", 0.15),  # another's tokenizer
        ("gpt-4.1-wrong", {"tokenizer": "cl100k_base"}, "upstream", 0.15),  # not gpt-4.1's
        ("llama-3-70b", {}, "upstream", 0.7),  # the estimator: an over-count by design
    ],
)
def test_the_default_follows_the_tokenizer_the_model_is_counted_with(
    name: str, spec: dict[str, Any], authority: str, tolerance: float
) -> None:
    model = parse_config(models(**{name: spec})).models[name]
    assert (model.usage_authority, model.usage_tolerance) == (authority, tolerance)


def test_a_tokenizers_rule_is_the_tokenizer_the_default_reads() -> None:
    doc = models(**{"gpt-4o": {}})
    doc["tokenizers"] = [{"match": "gpt-4o", "tokenizer": "cl100k_base"}]
    assert parse_config(doc).models["gpt-4o"].usage_authority == "upstream"


def test_a_model_states_its_own_policy_and_check_config_shows_it() -> None:
    spec = {"tokenizer": "o200k_base", "usage_authority": "meter", "usage_tolerance": 0.05}
    config = parse_config(models(vllm=spec))
    assert (config.models["vllm"].usage_authority, config.models["vllm"].usage_tolerance) == (
        "meter",
        0.05,
    )
    shown = config.normalised["models"]["vllm"]
    assert (shown["usage_authority"], shown["usage_tolerance"]) == ("meter", 0.05)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("usage_authority", "client"),
        ("usage_authority", True),
        ("usage_tolerance", 1),
        ("usage_tolerance", -0.1),
        ("usage_tolerance", "0.1"),
        ("usage_tolerance", True),
    ],
)
def test_a_wrong_policy_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(models(m={"tokenizer": "o200k_base", field: value}))
    assert info.value.path == f"models.m.{field}"
