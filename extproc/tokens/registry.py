"""Which tokenizer counts which model, decided once from configuration.

Rules map a model name (exact, or a glob such as ``gpt-4o*``) to a tokenizer spec
(``o200k_base``, ``cl100k_base``, a SentencePiece ``.model`` file, or ``estimator``).
Matching is case-insensitive; an exact rule always beats a pattern, and patterns are tried
in the order given. Any model no rule matches is counted by the conservative estimator.

The configured rules' tokenizers are loaded when the registry is built; a built-in
default's only when a model first resolves to it (the processor resolves every configured
model at start, so never on a request, and never a vocabulary no model uses). Each spec is
loaded once and shared by every request. A tokenizer that cannot be loaded must not take
the sidecar down: its models fall back to the estimator (which over-counts, never
under-counts), the failure is logged and counted in ``load_failures`` so the processor can
export it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from extproc.tokens.encodings import DATA_DIR, load_tokenizer
from extproc.tokens.estimator import DEFAULT_SAFETY_FACTOR, TokenEstimator
from extproc.tokens.model_tokenizer import FAMILIES, ModelTokenizer, model_tokenizer_for

log = structlog.get_logger(__name__)

ESTIMATOR_SPEC: Final = "estimator"
MISTRAL_V1_MODEL: Final = "mistral-7b-v0.1.sentencepiece.model"
# Client-supplied model names are unbounded; remember at most this many resolutions.
RESOLUTION_CACHE_LIMIT: Final = 4096

_GLOB_CHARS: Final = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class TokenizerRule:
    """``match`` (exact name or glob) -> ``tokenizer`` spec, with an optional chat ``family``."""

    match: str
    tokenizer: str
    family: str | None = None

    @property
    def is_pattern(self) -> bool:
        return any(ch in _GLOB_CHARS for ch in self.match)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], index: int = 0) -> TokenizerRule:
        """Validate one configuration entry; errors name the entry so config typos are obvious."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"tokenizer rule {index} must be a mapping, got {type(raw).__name__}")
        unknown = set(raw) - {"match", "tokenizer", "family"}
        if unknown:
            raise ValueError(f"tokenizer rule {index} has unknown keys: {sorted(unknown)}")
        match, tokenizer, family = raw.get("match"), raw.get("tokenizer"), raw.get("family")
        if not isinstance(match, str) or not match:
            raise ValueError(f"tokenizer rule {index}: 'match' must be a non-empty string")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ValueError(f"tokenizer rule {index}: 'tokenizer' must be a non-empty string")
        if family is not None and family not in FAMILIES:
            raise ValueError(f"tokenizer rule {index}: 'family' must be one of {FAMILIES}")
        return cls(match=match.lower(), tokenizer=tokenizer, family=family)


DEFAULT_RULES: Final[tuple[TokenizerRule, ...]] = (
    # o200k_base: GPT-4o, GPT-4.1, GPT-4.5, GPT-5 and the o-series (tiktoken's model table).
    TokenizerRule("gpt-4o*", "o200k_base"),
    TokenizerRule("chatgpt-4o*", "o200k_base"),
    TokenizerRule("gpt-4.1*", "o200k_base"),
    TokenizerRule("gpt-4.5*", "o200k_base"),
    TokenizerRule("gpt-5*", "o200k_base"),
    TokenizerRule("o1*", "o200k_base"),
    TokenizerRule("o3*", "o200k_base"),
    TokenizerRule("o4*", "o200k_base"),
    # cl100k_base: GPT-4 (incl. turbo and dated snapshots), GPT-3.5, ada-002 / v3 embeddings.
    TokenizerRule("gpt-4", "cl100k_base"),
    TokenizerRule("gpt-4-*", "cl100k_base"),
    TokenizerRule("gpt-3.5*", "cl100k_base"),
    TokenizerRule("text-embedding-ada-002", "cl100k_base"),
    TokenizerRule("text-embedding-3-*", "cl100k_base"),
    # The Mistral v1 SentencePiece vocabulary: Mistral-7B v0.1/v0.2 and Mixtral-8x7B only.
    # Later Mistral models (v3, Tekken) and Llama 2/3 use other vocabularies; mapping them
    # here would be a guess that can under-count, so they stay on the estimator unless
    # configured explicitly.
    TokenizerRule("*mistral-7b-v0.1*", MISTRAL_V1_MODEL, "llama"),
    TokenizerRule("*mistral-7b-instruct-v0.[12]*", MISTRAL_V1_MODEL, "llama"),
    TokenizerRule("*mixtral-8x7b*", MISTRAL_V1_MODEL, "llama"),
    TokenizerRule("open-mistral-7b", MISTRAL_V1_MODEL, "llama"),
    TokenizerRule("open-mixtral-8x7b", MISTRAL_V1_MODEL, "llama"),
)


class TokenizerRegistry:
    """Model name -> ModelTokenizer, loaded once and shared; see the module docstring."""

    def __init__(
        self,
        rules: Iterable[TokenizerRule],
        *,
        defaults: Iterable[TokenizerRule] = DEFAULT_RULES,
        safety_factor: float = DEFAULT_SAFETY_FACTOR,
        data_dir: Path = DATA_DIR,
    ) -> None:
        """``rules`` (configured: loaded now, so a broken one is reported at once), then
        ``defaults`` (loaded when first resolved to)."""
        configured = tuple(rules)
        self.rules = (*configured, *defaults)
        self.estimator = model_tokenizer_for(TokenEstimator(safety_factor))
        self.load_failures = 0
        self.failed_tokenizers: dict[str, str] = {}
        self._data_dir = data_dir
        self._loaded: dict[tuple[str, str | None], ModelTokenizer] = {}
        self._exact: dict[str, TokenizerRule] = {}
        self._patterns: list[TokenizerRule] = []
        for rule in self.rules:
            if rule.is_pattern:
                self._patterns.append(rule)
            else:
                self._exact.setdefault(rule.match, rule)
        for rule in configured:
            self._tokenizer(rule)
        self._resolved: dict[str, ModelTokenizer] = {}

    @classmethod
    def from_config(
        cls,
        rules: list[dict[str, Any]] | None,
        *,
        safety_factor: float = DEFAULT_SAFETY_FACTOR,
        data_dir: Path | str = DATA_DIR,
    ) -> TokenizerRegistry:
        """Build from config rule dicts; ``None`` means the built-in ``DEFAULT_RULES``.

        Raises ValueError for a malformed rule (a startup error), never for a tokenizer
        that fails to load (a runtime degradation, handled by falling back).
        """
        if rules is None:
            return cls((), safety_factor=safety_factor, data_dir=Path(data_dir))
        parsed = tuple(TokenizerRule.from_dict(raw, i) for i, raw in enumerate(rules))
        return cls(parsed, defaults=(), safety_factor=safety_factor, data_dir=Path(data_dir))

    def _tokenizer(self, rule: TokenizerRule) -> ModelTokenizer:
        key = (rule.tokenizer, rule.family)
        found = self._loaded.get(key)
        if found is None:
            found = self._loaded[key] = self._load(rule, self._data_dir)
        return found

    def _load(self, rule: TokenizerRule, data_dir: Path) -> ModelTokenizer:
        if rule.tokenizer == ESTIMATOR_SPEC:
            if rule.family is None:
                return self.estimator
            return model_tokenizer_for(self.estimator.backend, rule.family)
        try:
            return model_tokenizer_for(load_tokenizer(rule.tokenizer, data_dir), rule.family)
        except Exception as exc:  # any failure, not just TokenizerLoadError: never crash
            self.load_failures += 1
            self.failed_tokenizers[rule.tokenizer] = str(exc)
            log.error(
                "tokenizer_load_failed",
                tokenizer=rule.tokenizer,
                rule=rule.match,
                error=str(exc),
                fallback=self.estimator.name,
            )
            return model_tokenizer_for(self.estimator.backend, rule.family)

    def counter_for(self, model: str) -> ModelTokenizer:
        """Exact rule, else the first matching pattern, else the estimator."""
        cached = self._resolved.get(model)
        if cached is not None:
            return cached
        name = model.lower()
        rule = self._exact.get(name)
        if rule is None:
            rule = next((r for r in self._patterns if fnmatch.fnmatchcase(name, r.match)), None)
        found = self.estimator if rule is None else self._tokenizer(rule)
        if len(self._resolved) >= RESOLUTION_CACHE_LIMIT:
            self._resolved.clear()
        self._resolved[model] = found
        return found
