"""What llm-d-inference-sim v0.10.2's loader would say about a profile, without its binary.

The key list and Go types come from ``simulator_profiles/llm-d-v0.10.2-keys.json``
(extracted from ``pkg/common/config.go`` at the tag); the value rules are those of
gopkg.in/yaml.v3 v3.0.1 decoding into those types, plus the checks of
``Configuration.validate()`` that a profile's own values can fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KEYS_FILE = ROOT / "simulator_profiles" / "llm-d-v0.10.2-keys.json"
LLMSIM_ONLY = re.compile(r"^# llmsim-only: \S")
# Go's time.ParseDuration: one or more <number><unit>, optional sign; "0" alone is allowed.
_GO_DURATION = re.compile(r"^[-+]?(?:0|(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)$")
_STD_DEVS = (
    ("time-to-first-token-std-dev", "time-to-first-token"),
    ("inter-token-latency-std-dev", "inter-token-latency"),
    ("kv-cache-transfer-latency-std-dev", "kv-cache-transfer-latency"),
    ("time-to-generate-image-std-dev", "time-to-generate-image"),
)
_FAILURE_TYPES = {
    "rate_limit",
    "invalid_api_key",
    "context_length",
    "server_error",
    "invalid_request",
    "model_not_found",
}


def real_keys() -> dict[str, Any]:
    return json.loads(KEYS_FILE.read_text())


def is_llmsim_only(path: Path) -> bool:
    """The profile says on its first line that only llmsim can use it (and why)."""
    first = path.read_text().splitlines()[0] if path.read_text() else ""
    return bool(LLMSIM_ONLY.match(first))


def _duration_seconds(text: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    sign = -1 if text.startswith("-") else 1
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)", text):
        total += float(number) * units[unit]
    return sign * total


def _type_problem(key: str, go_type: str, value: object) -> str | None:
    if go_type == "time.Duration":
        if not isinstance(value, str) or not _GO_DURATION.match(value):
            return f"{key}: {value!r} is not a Go duration string (a bare number stops start-up)"
    elif go_type in ("int", "int64"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{key}: {value!r} is not an integer"
        if isinstance(value, float) and not value.is_integer():
            return f"{key}: {value!r} would be truncated to {int(value)} without a warning"
    elif go_type == "float64":
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{key}: {value!r} is not a number"
    elif go_type == "bool":
        if not isinstance(value, bool):
            return f"{key}: {value!r} is not a boolean"
    elif go_type == "string":
        if isinstance(value, list | dict):
            return f"{key}: {value!r} is not a scalar"
    elif go_type == "[]string":
        if not isinstance(value, list) or any(isinstance(v, list | dict) for v in value):
            return f"{key}: {value!r} is not a list of scalars"
    elif go_type == "*FakeMetrics":
        if not isinstance(value, dict):
            return f"{key}: {value!r} is not a mapping"
    else:  # pragma: no cover - a type the key file gained without a rule here
        return f"{key}: no rule for Go type {go_type}"
    return None


def _validate(doc: dict[str, Any]) -> list[str]:
    """The checks of Configuration.validate() that the profile's own values decide."""
    problems = []
    if not doc.get("model"):
        problems.append("model: empty (mandatory)")
    if doc.get("mode", "random") not in ("random", "echo"):
        problems.append(f"mode: {doc['mode']!r} is neither random nor echo")
    durations = {
        key: _duration_seconds(value)
        for key, value in doc.items()
        if _KEY_TYPES.get(key) == "time.Duration"
        and _type_problem(key, "time.Duration", value) is None
    }
    problems += [f"{k}: cannot be negative" for k, seconds in durations.items() if seconds < 0]
    for std, base in _STD_DEVS:
        if durations.get(std, 0.0) > 0.3 * durations.get(base, 0.0) + 1e-12:
            problems.append(f"{std}: more than 30% of {base}")
    minimums = {"port": 1, "max-model-len": 1, "max-num-seqs": 1, "max-waiting-queue-length": 1}
    for key, minimum in minimums.items():
        value = doc.get(key)
        if isinstance(value, int | float) and value < minimum:
            problems.append(f"{key}: cannot be less than {minimum}")
    ranges = {
        "failure-injection-rate": (0, 100),
        "data-parallel-size": (1, 8),
        "max-request-body-size-mb": (1, 512),
        "tool-call-not-required-param-probability": (0, 100),
        "object-tool-call-not-required-field-probability": (0, 100),
        "image-emission-rate": (0, 100),
    }
    for key, (low, high) in ranges.items():
        value = doc.get(key)
        if isinstance(value, int | float) and not low <= value <= high:
            problems.append(f"{key}: {value} is outside {low}..{high}")
    factor = doc.get("time-factor-under-load")
    if isinstance(factor, int | float) and factor < 1:
        problems.append("time-factor-under-load: cannot be less than 1.0")
    if doc.get("latency-calculator", "") not in ("", "constant", "per-token"):
        problems.append(f"latency-calculator: unknown {doc['latency-calculator']!r}")
    if "block-size" in doc and doc["block-size"] not in (8, 16, 32, 64, 128):
        problems.append("block-size: must be 8, 16, 32, 64 or 128")
    for failure in doc.get("failure-types") or []:
        if failure not in _FAILURE_TYPES:
            problems.append(f"failure-types: unknown type {failure!r}")
    return problems


_KEY_TYPES: dict[str, str] = {k: v["type"] for k, v in real_keys()["keys"].items()}


def real_loader_problems(text: str) -> list[str]:
    """Why v0.10.2 would refuse the profile, or silently do something else; [] if it loads.

    ``ext-`` keys are llmsim's extensions: the real loader ignores them, by design. Any other
    key it does not know is reported, since the real one would drop it without a word.
    """
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        return ["the profile is not a mapping"]
    problems = []
    for key, value in doc.items():
        if key.startswith("ext-"):
            continue
        go_type = _KEY_TYPES.get(key)
        if go_type is None:
            problems.append(f"{key}: not a key of the real simulator (ignored there)")
            continue
        problem = _type_problem(key, go_type, value)
        if problem:
            problems.append(problem)
    return problems + _validate(doc)
