"""With admission leases on, the processor says at start and on reload which plans never
take blocks (a sliding-window limit in buckets under 10 s), instead of leaving a user to wonder why
``extproc_local_admissions_total`` stays at 0 for them."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from extproc.app.runtime import Runtime
from extproc.config import parse_config

EVENT = "admission_leases_not_for_sliding_windows"


def doc(leases: bool, sliding_override: bool = False) -> dict[str, Any]:
    acme: dict[str, Any] = {"plan": "fixed", "key_sha256": ["0" * 64]}
    if sliding_override:
        acme["overrides"] = {"window": "sliding"}
    return {
        "redis_url": "memory://",
        "models": {"gpt-4.1": {"tokenizer": "o200k_base"}},
        "plans": {
            "fixed": {"window_s": 60, "limits": {"*": {"tpm": 100_000}}},
            "calendar": {"limits": {"*": {"rpm": 60}}, "monthly_tokens": 1_000_000},
            "sliding": {"window": "sliding", "limits": {"*": {"tpm": 100_000}}},
            # An hour in minute-long buckets takes blocks; ten minutes in 5 s buckets does not.
            "hourly": {"window": "sliding", "window_s": 3600, "limits": {"*": {"tpm": 10**6}}},
            "fine": {
                "window": "sliding",
                "window_s": 600,
                "bucket_s": 5,
                "limits": {"*": {"tpm": 10**6}},
            },
        },
        "tenants": {"acme": acme},
        "admission_leases": {"enabled": leases},
    }


def notices(logs: list[dict[str, Any]]) -> list[tuple[list[str], list[str]]]:
    return [(entry["plans"], entry["tenants"]) for entry in logs if entry["event"] == EVENT]


def test_plans_with_short_sliding_buckets_are_named_once_leases_are_on() -> None:
    with capture_logs() as logs:
        runtime = Runtime(parse_config(doc(leases=True)))
    assert notices(logs) == [(["fine", "sliding"], [])]
    # A reload says it again for its own config: a tenant's override made its plan sliding.
    reloaded = parse_config(doc(leases=True, sliding_override=True))
    with capture_logs() as logs:
        runtime.install(reloaded, runtime.registry)
    assert notices(logs) == [(["fine", "sliding"], ["acme"])]


def test_nothing_is_said_with_leases_off() -> None:
    with capture_logs() as logs:
        Runtime(parse_config(doc(leases=False)))
    assert notices(logs) == []
