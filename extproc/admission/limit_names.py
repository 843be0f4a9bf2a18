"""What a limit is called in errors: the OpenAI-style code and a readable description."""

from __future__ import annotations

from extproc.quota.base import Counter

# Error code and what is counted, by the counter's metric (its kind without scope/period).
_METRIC_CODES = {
    "rpm": ("rpm_limit_exceeded", "requests"),
    "tpm": ("tpm_limit_exceeded", "tokens"),
    "itpm": ("input_tpm_limit_exceeded", "input tokens"),
    "otpm": ("output_tpm_limit_exceeded", "output tokens"),
    "cost": ("cost_limit_exceeded", "spend"),
    "": ("{period}_budget_exceeded", "tokens"),
    "_requests": ("{period}_budget_exceeded", "requests"),
    "_input": ("{period}_budget_exceeded", "input tokens"),
    "_output": ("{period}_budget_exceeded", "output tokens"),
    "_cost": ("{period}_spend_exceeded", "spend"),
}
_PERIOD_NAMES = {"daily": "day", "weekly": "week", "monthly": "month"}
_WINDOW_NAMES = ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second"))
_WINDOW_NAMES = ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second"))


def window_name(window_s: int) -> str:
    """``minute``, ``hour``, ``day``, or ``90 seconds`` / ``2 hours`` for other lengths."""
    for length, name in _WINDOW_NAMES:
        if window_s == length:
            return name
    for length, name in _WINDOW_NAMES:
        if window_s % length == 0:
            return f"{window_s // length} {name}s"
    return f"{window_s} seconds"


def describe_limit(counter: Counter) -> tuple[str, str]:
    """(error code, "tokens per minute"-style description) of a counter's limit."""
    full = counter.kind.removeprefix("shadow_")
    kind = full.removeprefix("tenant_").removeprefix("model_")
    period = next((p for p in _PERIOD_NAMES if kind.startswith(p)), None)
    tenant_wide = full.startswith("tenant_") or (
        period is not None and not full.startswith("model_")
    )
    scope = " (all models)" if tenant_wide and kind != "daily" else ""
    if period is not None:
        code, what = _METRIC_CODES[kind.removeprefix(period)]
        zone = f" ({counter.timezone})" if counter.shape == "calendar" else " (UTC)"
        return code.format(period=period), f"{what} per {_PERIOD_NAMES[period]}{zone}{scope}"
    code, what = _METRIC_CODES.get(kind, _METRIC_CODES["rpm"])
    window = window_name(counter.window_s)
    if counter.shape == "sliding":
        return code, f"{what} in any {window if ' ' in window else '1 ' + window}{scope}"
    return code, f"{what} per {window}{scope}"
