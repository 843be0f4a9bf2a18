"""Cached prompt tokens come from the upstream's usage object; a figure that is missing or
does not fit the prompt counts as none cached (a cost limit prices cached input lower, so
a wrong figure must never lower the bill)."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.billing.answer import usage_counts


def usage(**details: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 7}
    if details:
        doc["prompt_tokens_details"] = details
    return doc


def test_cached_prompt_tokens_are_read_from_the_usage_details() -> None:
    assert usage_counts(usage(cached_tokens=64)) == (100, 7, 64)
    assert usage_counts(usage(cached_tokens=100)) == (100, 7, 100)


@pytest.mark.parametrize(
    "details",
    [
        {},
        {"cached_tokens": None},
        {"cached_tokens": 101},  # more than the prompt
        {"cached_tokens": -1},
        {"cached_tokens": 3.0},
        {"cached_tokens": True},
        {"cached_tokens": "64"},
    ],
)
def test_a_missing_or_impossible_cached_figure_counts_as_none_cached(
    details: dict[str, Any],
) -> None:
    assert usage_counts(usage(**details)) == (100, 7, 0)


def test_details_that_are_not_an_object_count_as_none_cached() -> None:
    doc = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": [64]}
    assert usage_counts(doc) == (100, 7, 0)
