"""JSON as Go's ``encoding/json`` writes it, on top of orjson.

The differences that reach the wire: ``<``, ``>``, ``&``, U+2028 and U+2029 inside strings
are ``\\u`` escapes; a float with no fraction has none (``-1``, not ``-1.0``); very small
and very large floats use Go's exponent form; map keys are sorted (struct fields are not,
so callers build dicts in the struct's field order).
"""

from __future__ import annotations

import decimal
from typing import Any

import orjson

_ESCAPES = (
    (b"<", b"\\u003c"),
    (b">", b"\\u003e"),
    (b"&", b"\\u0026"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


def _go_escape(data: bytes) -> bytes:
    # These bytes only ever occur inside JSON strings, so a plain replace is safe.
    for raw, escaped in _ESCAPES:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def go_float(value: float) -> str:
    """strconv.FormatFloat as encoding/json calls it ('f', or 'e' outside [1e-6, 1e21))."""
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        text = repr(value)  # shortest digits, two-digit exponent: Go's 'e' form
        if len(text) >= 4 and text[-4] == "e" and text[-3] == "-" and text[-2] == "0":
            text = text[:-2] + text[-1]
        return text
    return format(decimal.Decimal(repr(value)), "f")


def _prepare(value: Any) -> Any:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e21:
            return int(value)
        if abs(value) < 1e-4 or abs(value) >= 1e16:
            return orjson.Fragment(go_float(value).encode())
        return value
    if isinstance(value, dict):
        return {k: _prepare(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_prepare(v) for v in value]
    return value


def dumps(value: Any, sort_keys: bool = False) -> bytes:
    option = orjson.OPT_SORT_KEYS if sort_keys else 0
    return _go_escape(orjson.dumps(_prepare(value), option=option))


def string(text: str) -> bytes:
    """``text`` as a Go JSON string literal, quotes included."""
    return _go_escape(orjson.dumps(text))
