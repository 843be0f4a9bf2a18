"""The request the meter tests bill, and their configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REQUEST = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 120,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Count the tokens of this stream."}],
}


def config_doc(redis_url: str) -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "models": {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}},
        "plans": {
            "roomy": {"window_s": 3600, "limits": {"*": {"tpm": 1_000_000}}, "batch_tokens": 32},
            "tight": {"window_s": 3600, "limits": {"*": {"tpm": 100}}, "batch_tokens": 32},
        },
        "tenants": {},
    }
