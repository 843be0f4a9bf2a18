"""Counting and producing tokens, with a real tokenizer or the documented word split.

The gateway meters streamed output by re-tokenizing it, so generated text must be made of
whole tokens whose concatenation re-tokenizes to exactly the number of tokens reported in
``usage``. Random output is therefore drawn from a pool of words that are each one token,
alone and after a space, in the configured tokenizer (see ``WordPool``), and the property
is checked on a long sample at startup so a tokenizer for which it fails is refused.
"""

from __future__ import annotations

import codecs
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.tokens.encodings import (
    SentencePieceTokenizer,
    TextTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
)

# Without a tokenizer a token is a run of word characters or one punctuation character,
# each with the whitespace before it; trailing whitespace is a token of its own.
WORD_SPLIT = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

# Candidate words for random output: common, lowercase, ASCII, so they are single tokens in
# every mainstream vocabulary. Words that fail the single-token check are dropped.
_CANDIDATE_TEXT = """the of and to in is was for on that with as by at from his her it
this be are which an not or have had one all were their there when been has more if will
would who so no out up into than them can only other new some could time these two may
then first any like now my such make over our even most made after also did many before
must through back years where much your way well down should because each just those
people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old
year off come since against go came right used take three states himself few house use
during without again place around however home small found thought went say part once
general high upon school every does got united left number course war until always away
something fact though water less public put think almost hand enough far took head yet
government system better set told nothing night end why called find going look asked
later knew point next program city business give group toward young days let room
president side social given present several order national possible rather second face
per among form important often things looked early white case john become large big need
four within felt along children saw best church ever least power development light thing
seemed family interest want members mind country area others done turned although open
god service certain kind problem began different door thus help sense means whole matter
perhaps itself york times law human line above name example action company hands local
show whether five history gave today either act feet across taken past quite anything
seen having death experience body word half really week free field car words order"""
_CANDIDATE_WORDS = _CANDIDATE_TEXT.split()
_SELF_CHECK_WORDS = 4000


class TokenCodec(Protocol):
    """What the server needs from a tokenizer: counting, random pieces, echo pieces."""

    name: str
    chat_template: str  # "openai" or "llama": which chat overheads prompts are counted with

    def count(self, text: str) -> int: ...

    def random_pieces(self, n: int, rng: random.Random) -> list[str]: ...

    def echo_pieces(self, text: str) -> list[str]: ...


class WordSplitCodec:
    """No tokenizer configured: tokens are the ``WORD_SPLIT`` regex matches."""

    name = "word-split"
    chat_template = "openai"

    def __init__(self, sentences: Sequence[str]) -> None:
        self._sentence_tokens = [WORD_SPLIT.findall(s) for s in sentences]

    def count(self, text: str) -> int:
        return len(WORD_SPLIT.findall(text))

    def random_pieces(self, n: int, rng: random.Random) -> list[str]:
        pieces: list[str] = []
        while len(pieces) < n:
            sentence = rng.choice(self._sentence_tokens)
            if pieces:
                # A following sentence starts after a space, which joins its first word.
                pieces.append(" " + sentence[0])
                pieces.extend(sentence[1:])
            else:
                pieces.extend(sentence)
        return pieces[:n]

    def echo_pieces(self, text: str) -> list[str]:
        return WORD_SPLIT.findall(text)


@dataclass(frozen=True, slots=True)
class WordPool:
    """Words ``w`` for which ``w`` and ``" " + w`` are each exactly one token."""

    words: tuple[str, ...]

    def pieces(self, n: int, rng: random.Random) -> list[str]:
        if n <= 0:
            return []
        words = rng.choices(self.words, k=n)
        # The first piece has no leading space: SentencePiece would add a token for it.
        return [words[0], *(" " + w for w in words[1:])]


class TokenizerCodec:
    """A real tokenizer (tiktoken or SentencePiece) behind the ``TokenCodec`` interface."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer.name
        # SentencePiece models here are Llama/Mistral, whose [INST] template costs differ.
        is_sp = isinstance(tokenizer, SentencePieceTokenizer)
        self.chat_template = "llama" if is_sp else "openai"
        self.pool = WordPool(tuple(w for w in dict.fromkeys(_CANDIDATE_WORDS) if self._single(w)))
        if len(self.pool.words) < 50:
            raise ValueError(f"tokenizer {self.name} has too few single-token words for output")
        self._self_check()

    def _single(self, word: str) -> bool:
        encode = self.tokenizer.encode
        return len(encode(word)) == 1 and len(encode("a " + word)) == len(encode("a")) + 1

    def _self_check(self) -> None:
        sample = self.pool.pieces(_SELF_CHECK_WORDS, random.Random(0))
        counted = self.count("".join(sample))
        if counted != len(sample):
            raise ValueError(
                f"tokenizer {self.name}: {len(sample)} generated words re-tokenize to {counted}"
            )

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def random_pieces(self, n: int, rng: random.Random) -> list[str]:
        return self.pool.pieces(n, rng)

    def echo_pieces(self, text: str) -> list[str]:
        """``text`` cut at token boundaries; a piece spans tokens that split a character."""
        ids = self.tokenizer.encode(text)
        if isinstance(self.tokenizer, TiktokenTokenizer):
            token_bytes = [self.tokenizer.encoding.decode_single_token_bytes(i) for i in ids]
        elif isinstance(self.tokenizer, SentencePieceTokenizer):
            token_bytes = _sentencepiece_bytes(self.tokenizer, ids)
        else:  # pragma: no cover - only the two kinds exist
            return [self.tokenizer.decode([i]) for i in ids]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces: list[str] = []
        pending = 0
        for raw in token_bytes:
            piece = decoder.decode(raw)
            pending += 1
            if piece:
                # Tokens that only completed a character together count as one piece each.
                pieces.append(piece)
                pieces.extend("" for _ in range(pending - 1))
                pending = 0
        tail = decoder.decode(b"", final=True)
        if tail or pending:
            pieces.append(tail)
            pieces.extend("" for _ in range(pending - 1))
        return pieces


def _sentencepiece_bytes(tokenizer: SentencePieceTokenizer, ids: list[int]) -> list[bytes]:
    proc = tokenizer.processor
    out: list[bytes] = []
    for position, token_id in enumerate(ids):
        if proc.is_byte(token_id):
            out.append(bytes([int(proc.id_to_piece(token_id)[1:-1], 16)]))
            continue
        text = proc.id_to_piece(token_id).replace("\u2581", " ")
        if position == 0 and text.startswith(" "):
            text = text[1:]  # the dummy prefix SentencePiece adds to the start of the text
        out.append(text.encode())
    return out


def load_codec(spec: str | None, sentences: Sequence[str]) -> TokenCodec:
    """The codec for an ``ext-tokenizer`` value; ``None`` selects the word split."""
    if spec is None:
        return WordSplitCodec(sentences)
    return TokenizerCodec(load_tokenizer(spec))
