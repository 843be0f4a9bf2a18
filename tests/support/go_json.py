"""JSON as a Go struct decoder reads its field names: the independent reader the field-name
tests hold the forwarded body against.

Go's ``encoding/json`` matches a key to a field ignoring case (``ToUpper(ToLower(r))`` per
rune, so four non-ASCII runes match ASCII letters) and the last key for a field wins;
``encoding/json/v2``'s ``nocase`` matching ignores ``_`` and ``-`` as well. Written from those
rules, not from the processor's code.
"""

from __future__ import annotations

import json
from typing import Any

# Runes whose simple case mappings lead to an ASCII letter, found by going through Unicode.
GO_ASCII_RUNES: dict[str, str] = {}
for _cp in range(0x80, 0x110000):
    _c = chr(_cp)
    _lower = _c.lower()[:1]  # the simple mapping is the first rune of the full one here
    _upper = (_lower if _lower != _c else _c).upper()
    if len(_upper) == 1 and _upper.isascii() and _upper.isalpha():
        GO_ASCII_RUNES[_c] = _upper


def go_fold(key: str, nocase_v2: bool = False) -> str:
    out = "".join(GO_ASCII_RUNES.get(c, c.upper() if c.isascii() else c) for c in key)
    return out.replace("_", "").replace("-", "") if nocase_v2 else out


class GoView:
    """A JSON document as a Go struct decoder sees its fields: every key of every object kept
    in order; a field's value is the last key that folds to its name."""

    def __init__(self, raw: bytes, nocase_v2: bool = False) -> None:
        self.doc = json.loads(raw, object_pairs_hook=list)
        self.nocase_v2 = nocase_v2

    def field(self, pairs: Any, name: str) -> Any:
        want = go_fold(name, self.nocase_v2)
        found = None
        for key, value in pairs if isinstance(pairs, list) else []:
            if go_fold(key, self.nocase_v2) == want:
                found = value
        return found
