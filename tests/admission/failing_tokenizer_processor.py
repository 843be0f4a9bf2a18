"""``extproc serve`` whose tiktoken fails on a marked text: admission's failure paths, live.

    python -m tests.admission.failing_tokenizer_processor serve --config quota.yaml ...

The real processor, with one change made before it loads its tokenizers: counting a text
that holds ``MARK`` raises, in the worker thread (``count_large``, as a Rust panic would:
a BaseException) and on the loop (``count``, a RuntimeError). Every other text is counted
by the real tokenizer.
"""

from __future__ import annotations

import sys

from extproc.app.cli import main
from extproc.tokens.encodings import TiktokenTokenizer

MARK = "TOKENIZER-FAILS-ON-THIS"


class FakePanic(BaseException):
    """What pyo3 raises for a panic in Rust code: not an Exception."""


_count = TiktokenTokenizer.count
_count_large = TiktokenTokenizer.count_large


def _failing_count(self: TiktokenTokenizer, text: str) -> int:
    if MARK in text:
        raise RuntimeError("the tokenizer failed (injected)")
    return _count(self, text)


def _failing_count_large(self: TiktokenTokenizer, text: str) -> int:
    if MARK in text:
        raise FakePanic("the tokenizer panicked (injected)")
    return _count_large(self, text)


TiktokenTokenizer.count = _failing_count  # type: ignore[method-assign]
TiktokenTokenizer.count_large = _failing_count_large  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
