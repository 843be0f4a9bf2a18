"""Offline loading of real tokenizer files.

tiktoken's default loader downloads its BPE files; these machines (and most production
sidecars) have no network, so every encoding is built from a file shipped in
``extproc/tokens/data`` and checked against the sha256 that tiktoken itself expects.
"""

from __future__ import annotations

import binascii
import gzip
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import tiktoken

from extproc.tokens.text import clean_text

DATA_DIR = Path(__file__).parent / "data"

# Pattern strings and special tokens as published in tiktoken_ext/openai_public.py (MIT).
_O200K_ALTERNATIVES: Final = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
_O200K_PAT: Final = "|".join(_O200K_ALTERNATIVES)
_CL100K_PAT: Final = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# The same patterns rewritten for speed; they split every text into the same pieces (a
# test checks them against the published ones). tiktoken runs its pattern with
# fancy_regex, which hands the longest lookaround-free sub-patterns to the fast `regex`
# crate. Two rewrites let it hand over all alternatives before the one lookahead as one
# unit, halving cl100k's time on English (1.17 -> 0.60 ms for 4k tokens):
# * the alternatives before ``\s+(?!\S)`` are wrapped in one ``(?:...)`` group (first-match
#   alternation is associative, so the group matches exactly what the flat list matched);
# * cl100k's possessive quantifiers become greedy ones. Each one either ends its branch or
#   is followed by a class it cannot overlap (``[^\s\p{L}\p{N}]++`` then ``[\r\n]``; an
#   optional non-letter prefix then ``\p{L}``; ``\s+`` then end of text), so the greedy
#   form's first match is the possessive one and backtracking can never find another.
_O200K_FAST_PAT: Final = (
    "(?:" + "|".join(_O200K_ALTERNATIVES[:-2]) + ")|" + "|".join(_O200K_ALTERNATIVES[-2:])
)
_CL100K_FAST_PAT: Final = (
    r"""(?:'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s+$|\s*[\r\n])|\s+(?!\S)|\s"""
)


@dataclass(frozen=True, slots=True)
class _TiktokenSpec:
    file: str
    sha256: str  # of the unpacked file, as tiktoken_ext checks it
    pat_str: str  # as published; the reference the fast pattern is tested against
    fast_pat_str: str  # what the encoding runs: same pieces, fewer regex engine hand-offs
    special_tokens: dict[str, int]


TIKTOKEN_SPECS: dict[str, _TiktokenSpec] = {
    "o200k_base": _TiktokenSpec(
        "o200k_base.tiktoken.gz",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        _O200K_PAT,
        _O200K_FAST_PAT,
        {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    ),
    "cl100k_base": _TiktokenSpec(
        "cl100k_base.tiktoken.gz",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        _CL100K_PAT,
        _CL100K_FAST_PAT,
        {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
}


class TokenizerLoadError(RuntimeError):
    """A tokenizer file is missing, corrupt, or of an unknown kind."""


class TextTokenizer(Protocol):
    """The two operations every caller needs, whatever library backs the tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def count_large(self, text: str) -> int: ...

    def decode(self, ids: list[int]) -> str: ...


class TiktokenTokenizer:
    """A tiktoken encoding; special-token text is counted as ordinary text, never as control."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.name = encoding.name
        self.encoding = encoding
        # The Rust core skips the Python wrapper's special-token scan; counting is hot.
        core = getattr(encoding, "_core_bpe", None)
        self._encode_core = getattr(core, "encode_ordinary", encoding.encode_ordinary)
        # The same encoding into a buffer of u32 ids instead of a list of ints. With no
        # special token allowed, the core treats special-token text as ordinary text, so it
        # is ``encode_ordinary``; the GIL is released for the whole encoding, and no list of
        # 200k ints is built while holding it (~5 ms per MiB of text).
        self._buffer_core = getattr(core, "encode_to_tiktoken_buffer", None)
        self._no_special: frozenset[str] = frozenset()

    def encode(self, text: str) -> list[int]:
        # encode_ordinary == encode(disallowed_special=()): "<|endoftext|>" typed by a user
        # is counted as the text it is, never rejected or treated as a control token.
        try:
            return self._encode_core(text)
        except UnicodeEncodeError:
            return self._encode_core(clean_text(text))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_large(self, text: str) -> int:
        """``count(text)``, holding the GIL only to read the text: for big texts, off the loop."""
        buffer_core = self._buffer_core
        if buffer_core is None:
            return self.count(text)
        try:
            ids = buffer_core(text, self._no_special)
        except UnicodeEncodeError:
            ids = buffer_core(clean_text(text), self._no_special)
        return memoryview(ids).nbytes // 4  # u32 ids

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


class SentencePieceTokenizer:
    """A SentencePiece model loaded from a ``.model`` file."""

    def __init__(self, path: Path) -> None:
        import sentencepiece

        self.name = f"sentencepiece:{path.name}"
        self.path = path
        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise TokenizerLoadError(f"cannot load SentencePiece model {path}: {exc}") from exc
        self._encode_buffer = _sentencepiece_buffer_encoder(self.processor)

    def encode(self, text: str) -> list[int]:
        # SentencePiece refuses lone surrogates with a RuntimeError; clean them first.
        ids: list[int] = self.processor.encode(clean_text(text))  # out_type int: ids
        return ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_large(self, text: str) -> int:
        """``count(text)`` without building the list of ids while holding the GIL.

        The text is tried as it is first: ``clean_text`` is the identity on a text without
        surrogates, and one with them fails to convert (RuntimeError) before any encoding,
        so cleaning only then gives the same ids without an extra UTF-8 copy of every text.
        """
        encode_buffer = self._encode_buffer
        if encode_buffer is None:
            return self.count(text)
        try:
            ids = encode_buffer(text)
        except (RuntimeError, UnicodeEncodeError):
            ids = encode_buffer(clean_text(text))
        return memoryview(ids).nbytes // 4  # int32 ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.processor.decode(ids)  # ids in, text out (untyped overloads)
        return text


def _sentencepiece_buffer_encoder(processor: Any) -> Callable[[str], Any] | None:
    """The pybind ``_EncodeAsBuffer`` (what ``encode(out_type="numpy")`` calls, without
    needing numpy) bound to the processor's own encode options, or None when this
    sentencepiece has no such method; the ids are the same as ``encode``'s (tested)."""
    native = getattr(processor, "_processor", None)
    method = getattr(native, "_EncodeAsBuffer", None)
    try:
        options = (
            bool(processor._enable_sampling),
            int(processor._nbest_size),
            float(processor._alpha),
            bool(processor._add_bos),
            bool(processor._add_eos),
            bool(processor._reverse),
        )
    except AttributeError:
        return None
    if method is None or options[0]:
        return None
    return lambda text: method(text, *options)


def _read_ranks(spec: _TiktokenSpec, data_dir: Path) -> dict[bytes, int]:
    path = data_dir / spec.file
    try:
        raw = path.read_bytes()
        blob = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, gzip.BadGzipFile) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    digest = hashlib.sha256(blob).hexdigest()
    if digest != spec.sha256:
        raise TokenizerLoadError(f"{path}: sha256 {digest} does not match {spec.sha256}")
    # binascii directly: base64.b64decode is this call plus ~1 µs of checks per line,
    # a fifth of the parse over 200k lines (every process start pays it).
    decode = binascii.a2b_base64
    return {
        decode(token): int(rank)
        for token, rank in (line.split() for line in blob.splitlines() if line)
    }


_cache: dict[str, TextTokenizer] = {}
_lock = threading.Lock()


def load_tokenizer(spec: str, data_dir: Path = DATA_DIR) -> TextTokenizer:
    """Load (once per process) ``o200k_base``, ``cl100k_base`` or a SentencePiece ``.model`` path.

    Raises TokenizerLoadError; never touches the network.
    """
    key = f"{data_dir}|{spec}"
    with _lock:
        cached = _cache.get(key)
        if cached is not None:
            return cached
        tokenizer: TextTokenizer
        if spec in TIKTOKEN_SPECS:
            tspec = TIKTOKEN_SPECS[spec]
            encoding = tiktoken.Encoding(
                name=spec,
                pat_str=tspec.fast_pat_str,
                mergeable_ranks=_read_ranks(tspec, data_dir),
                special_tokens=tspec.special_tokens,
            )
            tokenizer = TiktokenTokenizer(encoding)
        elif spec.endswith(".model"):
            path = Path(spec)
            if not path.is_absolute() and not path.exists():
                path = data_dir / path
            if not path.is_file():
                raise TokenizerLoadError(f"SentencePiece model not found: {spec}")
            tokenizer = SentencePieceTokenizer(path)
        else:
            raise TokenizerLoadError(
                f"unknown tokenizer {spec!r}: expected o200k_base, cl100k_base or a .model path"
            )
        _cache[key] = tokenizer
        return tokenizer
