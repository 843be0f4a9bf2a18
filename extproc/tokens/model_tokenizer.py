"""What a model's requests are counted with: a tokenizer (or the estimator) plus its family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from extproc.tokens.encodings import SentencePieceTokenizer, TextTokenizer, TiktokenTokenizer
from extproc.tokens.estimator import TokenEstimator

TokenizerKind = Literal["tiktoken", "sentencepiece", "estimator"]

# Family names select the chat-template overhead in extproc.tokens.prompt.
FAMILIES: Final = ("openai", "llama", "generic")
_DEFAULT_FAMILY: Final[dict[str, str]] = {
    "tiktoken": "openai",
    "sentencepiece": "llama",
    "estimator": "generic",
}

DELTA_CACHE_LIMIT: Final = 65_536


@dataclass(slots=True)
class ModelTokenizer:
    """A tokenizer bound to the way a model family frames chat messages.

    ``count`` is the only thing admission needs; ``backend`` and ``kind`` let the streaming
    counter pick a strategy that keeps BPE merges across delta boundaries exact.
    ``exact`` is False for the estimator, whose counts are deliberately high.
    """

    name: str
    kind: TokenizerKind
    family: str
    backend: TextTokenizer | TokenEstimator
    count: Callable[[str], int] = field(init=False, repr=False)
    # The same count for big texts, run off the event loop: holds the GIL as little as the
    # backend allows (no list of ids built). The estimator's is its ``count``.
    count_large: Callable[[str], int] = field(init=False, repr=False)
    # Counts of short, boundary-aligned stream deltas (" the", ",", "\n"): they repeat a lot,
    # and a dict hit is several times cheaper than a call into the tokenizer.
    delta_counts: dict[str, int] = field(default_factory=dict, repr=False)
    # The BPE streaming counter's version of the same memo: a delta that starts a new
    # pre-tokenizer piece -> (its token count, the characters that would start the next
    # piece right after it). One dict hit is all its fast path does.
    piece_deltas: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"unknown tokenizer family {self.family!r}; expected one of {FAMILIES}"
            )
        self.count = self.backend.count
        self.count_large = self.backend.count_large

    @property
    def exact(self) -> bool:
        return self.kind != "estimator"

    def cached_delta_count(self, delta: str, counter: Callable[[str], int]) -> int:
        """``counter(delta)``, memoised in a bounded table shared by all streams."""
        n = self.delta_counts.get(delta)
        if n is None:
            n = counter(delta)
            if len(self.delta_counts) >= DELTA_CACHE_LIMIT:
                self.delta_counts.clear()  # crude but bounded; refills with what is hot
            self.delta_counts[delta] = n
        return n


def model_tokenizer_for(
    backend: TextTokenizer | TokenEstimator, family: str | None = None
) -> ModelTokenizer:
    """Wrap a loaded tokenizer, inferring kind (and, unless given, family) from its type."""
    kind: TokenizerKind
    if isinstance(backend, TiktokenTokenizer):
        kind = "tiktoken"
    elif isinstance(backend, SentencePieceTokenizer):
        kind = "sentencepiece"
    elif isinstance(backend, TokenEstimator):
        kind = "estimator"
    else:
        raise TypeError(f"unsupported tokenizer type {type(backend).__name__}")
    return ModelTokenizer(
        name=backend.name, kind=kind, family=family or _DEFAULT_FAMILY[kind], backend=backend
    )
