"""Go-syntax durations (``250us``, ``12ms``, ``1.5s``, ``1m30s``) as the real simulator reads them.

Profiles are shared with the Go simulator, so they must be parsed with Go's rules rather
than a Python-flavoured variant; values are kept as float seconds internally.
"""

from __future__ import annotations

import re

_UNIT_SECONDS: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 micro sign
    "μs": 1e-6,  # U+03BC greek mu
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


class DurationError(ValueError):
    """A value that is not a Go duration."""


def parse_duration(value: object) -> float:
    """Seconds from a Go duration string; a bare integer means milliseconds.

    Integers are the real simulator's deprecated millisecond form, kept so old profiles load.
    """
    if isinstance(value, bool):
        raise DurationError(f"expected a duration like '12ms', got {value!r}")
    if isinstance(value, int):
        return value / 1000.0
    if not isinstance(value, str):
        raise DurationError(f"expected a duration like '12ms', got {value!r}")
    text = value.strip()
    if text.lstrip("-+").isdigit():
        return int(text) / 1000.0
    sign = 1.0
    if text[:1] in "+-":
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    if text == "0":
        return 0.0
    if not text:
        raise DurationError(f"invalid duration {value!r}")
    total = 0.0
    pos = 0
    while pos < len(text):
        match = _PART.match(text, pos)
        if match is None:
            hint = "expected e.g. '250us', '12ms', '1.5s'"
            raise DurationError(f"invalid duration {value!r}: {hint}")
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    return sign * total


def format_duration(seconds: float) -> str:
    """A Go-parsable string for ``seconds``, in the largest unit that keeps it short."""
    if seconds == 0:
        return "0s"
    sign = "-" if seconds < 0 else ""
    magnitude = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if magnitude >= scale:
            return f"{sign}{_trim(magnitude / scale)}{unit}"
    return f"{sign}{_trim(magnitude / 1e-9)}ns"


def _trim(number: float) -> str:
    text = f"{number:.6f}".rstrip("0").rstrip(".")
    return text or "0"
