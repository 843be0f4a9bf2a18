"""Every shipped profile loads in llm-d-inference-sim v0.10.2 unchanged, or says it can't.

The real loader's keys and types are data (``simulator_profiles/llm-d-v0.10.2-keys.json``,
taken from the tag's ``pkg/common/config.go``); ``real_loader.py`` applies yaml.v3's rules
for those types and the checks of the real ``validate()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsim.settings import build_config
from tests.simulator.real_loader import (
    KEYS_FILE,
    ROOT,
    is_llmsim_only,
    real_keys,
    real_loader_problems,
)

SHIPPED = sorted(
    [*(ROOT / "simulator_profiles").glob("*.yaml"), *(ROOT / "deploy" / "llm-sim").glob("*.yaml")]
)


def test_the_key_list_names_its_source_tag_and_file():
    data = real_keys()
    assert data["source"]["tag"] == "v0.10.2"
    assert data["source"]["file"] == "pkg/common/config.go"
    assert len(data["source"]["commit"]) == 40
    keys = data["keys"]
    assert len(keys) == 72
    assert keys["inter-token-latency"] == {"type": "time.Duration", "admin": True}
    assert keys["failure-injection-rate"] == {"type": "int", "admin": True}
    assert keys["served-model-name"] == {"type": "[]string"}


@pytest.mark.parametrize("profile", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_profile_loads_in_the_real_simulator_or_says_it_is_llmsim_only(profile: Path):
    if is_llmsim_only(profile):
        return
    assert real_loader_problems(profile.read_text()) == []


@pytest.mark.parametrize("profile", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_profile_loads_in_llmsim(profile: Path):
    assert build_config(profile, {}, {}).model


def test_llmsim_only_profiles_are_the_ones_that_need_llmsim():
    only = {p.name for p in SHIPPED if is_llmsim_only(p)}
    # The second model of multi-model.yaml exists only as an ext-models entry.
    assert only == {"multi-model.yaml"}


def test_checker_reports_what_stops_or_changes_the_real_loader():
    text = (
        "model: m\n"
        "inter-token-latency: 10\n"  # a bare number: the real loader stops
        "failure-injection-rate: 2.5\n"  # truncated to 2 silently
        "max-num-seqs: '16'\n"  # a string into an int
        "max-waiting-queue-length: 0\n"  # validate(): at least 1
        "time-to-first-token: 10ms\n"
        "time-to-first-token-std-dev: 5ms\n"  # more than 30% of the base
        "tokens-per-chunk: 2\n"  # not a real key, not ext-: dropped silently
        "ext-anything: 1\n"  # an extension: ignored by design
    )
    problems = real_loader_problems(text)
    keys = sorted(p.split(":", 1)[0] for p in problems)
    assert keys == [
        "failure-injection-rate",
        "inter-token-latency",
        "max-num-seqs",
        "max-waiting-queue-length",
        "time-to-first-token-std-dev",
        "tokens-per-chunk",
    ], problems


def test_go_duration_strings_are_accepted_in_every_unit():
    text = "model: m\n" + "".join(
        f"{key}: {value}\n"
        for key, value in (
            ("time-to-first-token", "1m30s"),
            ("inter-token-latency", "250us"),
            ("prefill-overhead", "1.5s"),
            ("prefill-time-per-token", '"0"'),
            ("startup-duration", "2h"),
        )
    )
    assert real_loader_problems(text) == []


def test_key_file_is_in_the_profiles_directory():
    assert KEYS_FILE.parent == ROOT / "simulator_profiles"
