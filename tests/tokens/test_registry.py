"""Model -> tokenizer resolution, sharing, and falling back when a tokenizer is broken."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from extproc.tokens.encodings import DATA_DIR
from extproc.tokens.registry import TokenizerRegistry, TokenizerRule

MISTRAL = "mistral-7b-v0.1.sentencepiece.model"


@pytest.mark.parametrize(
    ("model", "tokenizer", "family"),
    [
        ("gpt-4o", "o200k_base", "openai"),
        ("gpt-4o-mini-2024-07-18", "o200k_base", "openai"),
        ("gpt-4.1-nano", "o200k_base", "openai"),
        ("o3-mini", "o200k_base", "openai"),
        ("o1", "o200k_base", "openai"),
        ("gpt-4", "cl100k_base", "openai"),
        ("gpt-4-0613", "cl100k_base", "openai"),
        ("gpt-4-turbo", "cl100k_base", "openai"),
        ("gpt-3.5-turbo", "cl100k_base", "openai"),
        ("mistralai/Mistral-7B-Instruct-v0.2", f"sentencepiece:{MISTRAL}", "llama"),
        ("mixtral-8x7b-instruct", f"sentencepiece:{MISTRAL}", "llama"),
        ("GPT-4O", "o200k_base", "openai"),  # model names match case-insensitively
    ],
)
def test_default_rules_map_model_families_to_their_tokenizers(
    registry: TokenizerRegistry, model: str, tokenizer: str, family: str
) -> None:
    tok = registry.counter_for(model)
    assert (tok.name, tok.family, tok.exact) == (tokenizer, family, True)


@pytest.mark.parametrize(
    "model", ["meta-llama/Llama-3.1-8B-Instruct", "qwen2.5-7b", "gpt-40", "", "o2-preview"]
)
def test_models_no_rule_matches_get_the_conservative_estimator(
    registry: TokenizerRegistry, model: str
) -> None:
    tok = registry.counter_for(model)
    assert tok.kind == "estimator"
    assert tok.family == "generic"
    assert not tok.exact


def test_exact_name_beats_an_earlier_pattern_and_patterns_apply_in_order() -> None:
    registry = TokenizerRegistry.from_config(
        [
            {"match": "acme-*", "tokenizer": "o200k_base"},
            {"match": "acme-*-legacy", "tokenizer": "cl100k_base"},  # shadowed by acme-*
            {"match": "acme-special", "tokenizer": "cl100k_base"},  # exact wins
            {"match": "mistral*", "tokenizer": MISTRAL, "family": "llama"},
        ]
    )
    assert registry.counter_for("acme-special").name == "cl100k_base"
    assert registry.counter_for("acme-x-legacy").name == "o200k_base"
    assert registry.counter_for("mistral-large").family == "llama"
    assert registry.counter_for("gpt-4o").kind == "estimator"  # config replaces defaults


def test_glob_patterns_support_character_classes_and_single_characters() -> None:
    registry = TokenizerRegistry.from_config(
        [{"match": "model-v[12]-?", "tokenizer": "cl100k_base"}]
    )
    assert registry.counter_for("model-v1-a").name == "cl100k_base"
    assert registry.counter_for("model-v3-a").kind == "estimator"
    assert registry.counter_for("model-v1-ab").kind == "estimator"


def test_tokenizers_are_loaded_once_and_shared(registry: TokenizerRegistry) -> None:
    assert registry.counter_for("gpt-4o") is registry.counter_for("o3")
    assert registry.counter_for("gpt-4o").backend is registry.counter_for("gpt-4.1").backend
    again = TokenizerRegistry.from_config(None)
    assert again.counter_for("gpt-4").backend is registry.counter_for("gpt-4").backend


def test_broken_tokenizer_file_falls_back_to_estimator_logged_and_counted(
    tmp_path: Path,
) -> None:
    blob = gzip.decompress((DATA_DIR / "o200k_base.tiktoken.gz").read_bytes())
    (tmp_path / "o200k_base.tiktoken.gz").write_bytes(gzip.compress(blob[:-100]))
    (tmp_path / MISTRAL).write_bytes(b"this is not a sentencepiece model")
    shutil.copy(DATA_DIR / "cl100k_base.tiktoken.gz", tmp_path)
    with capture_logs() as logs:
        registry = TokenizerRegistry.from_config(
            [
                {"match": "gpt-4o*", "tokenizer": "o200k_base"},
                {"match": "gpt-4", "tokenizer": "cl100k_base"},
                {"match": "mistral*", "tokenizer": MISTRAL, "family": "llama"},
                {"match": "typo*", "tokenizer": "o200k"},
            ],
            data_dir=tmp_path,
        )
    assert registry.load_failures == 3
    assert set(registry.failed_tokenizers) == {"o200k_base", MISTRAL, "o200k"}
    failures = [e for e in logs if e["event"] == "tokenizer_load_failed"]
    assert {e["tokenizer"] for e in failures} == {"o200k_base", MISTRAL, "o200k"}
    assert all(e["log_level"] == "error" for e in failures)
    broken = registry.counter_for("gpt-4o")
    assert broken.kind == "estimator"
    assert broken.family == "generic"  # the larger, estimator-family overhead
    assert registry.counter_for("mistral-7b").family == "llama"  # the rule's family is kept
    assert broken.count("Hello, world!") >= 4
    assert registry.counter_for("gpt-4").name == "cl100k_base"  # healthy ones unaffected


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([{"tokenizer": "o200k_base"}], "'match'"),
        ([{"match": "x"}], "'tokenizer'"),
        ([{"match": "x", "tokenizer": "o200k_base", "family": "martian"}], "'family'"),
        ([{"match": "x", "tokenizer": "o200k_base", "extra": 1}], "unknown keys"),
        (["gpt-4"], "must be a mapping"),
    ],
)
def test_malformed_rules_are_configuration_errors(rules: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenizerRegistry.from_config(rules)


def test_rule_objects_can_be_passed_directly() -> None:
    registry = TokenizerRegistry([TokenizerRule("local-*", "estimator", "llama")])
    tok = registry.counter_for("local-7b")
    assert (tok.kind, tok.family) == ("estimator", "llama")


def test_unbounded_model_names_do_not_grow_the_resolution_cache(
    registry: TokenizerRegistry,
) -> None:
    for i in range(10_000):
        registry.counter_for(f"random-model-{i}")
    assert len(registry._resolved) <= 4096


def test_a_built_in_default_loads_only_when_a_model_resolves_to_it(tmp_path: Path) -> None:
    # Only o200k's file is here: a default that loaded eagerly would fail at once.
    shutil.copy(DATA_DIR / "o200k_base.tiktoken.gz", tmp_path)
    registry = TokenizerRegistry([TokenizerRule("mine", "o200k_base")], data_dir=tmp_path)
    assert registry.load_failures == 0 and registry.failed_tokenizers == {}
    assert registry.counter_for("mine").name == "o200k_base"
    assert registry.counter_for("gpt-4o").name == "o200k_base"  # a default, loaded already
    assert registry.load_failures == 0
    assert registry.counter_for("gpt-4").kind == "estimator"  # its default file is missing
    assert set(registry.failed_tokenizers) == {"cl100k_base"} and registry.load_failures == 1
    assert registry.counter_for("gpt-3.5-turbo").kind == "estimator"
    assert registry.load_failures == 1  # tried once, not per model


def test_a_broken_configured_tokenizer_is_reported_before_any_model_uses_it(
    tmp_path: Path,
) -> None:
    registry = TokenizerRegistry([TokenizerRule("typo-*", "o200k")], data_dir=tmp_path)
    assert set(registry.failed_tokenizers) == {"o200k"} and registry.load_failures == 1
