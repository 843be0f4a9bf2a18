"""What must reach the backend is asked again until it answers, and no longer."""

from __future__ import annotations

import pytest

from extproc.admission import retry


async def test_a_call_is_retried_until_it_answers() -> None:
    failures: list[int] = []
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise ConnectionError("down")
        return "answered"

    result = await retry.until_answered(flaky, lambda attempt, exc: failures.append(attempt))
    assert result == "answered"
    assert calls == 4
    assert failures == [0, 1, 2]


async def test_a_backend_that_never_answers_is_given_up_after_every_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(retry, "ATTEMPTS", 3)
    failures: list[int] = []

    async def down() -> None:
        raise ConnectionError("down")

    with pytest.raises(retry.NoAnswer):
        await retry.until_answered(down, lambda attempt, exc: failures.append(attempt))
    assert failures == [0, 1, 2]
