"""Which model names this process answers to, and how each is tokenized and labelled."""

from __future__ import annotations

from dataclasses import dataclass

from llmsim.settings import SimConfig
from llmsim.textgen import SENTENCES
from llmsim.tokens import TokenCodec, load_codec


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model as requests see it: the name shown in answers and metrics, and its tokenizer."""

    display: str
    root: str
    codec: TokenCodec


def build_catalog(cfg: SimConfig) -> dict[str, ServedModel]:
    """Request model name → served model.

    The main model is shown under its first served name for every alias, as the real
    simulator does; each ``ext-models`` entry is a model of its own, shown under its name.
    Tokenizers are loaded once and shared between names.
    """
    codecs: dict[str | None, TokenCodec] = {}

    def codec_for(spec: str | None) -> TokenCodec:
        if spec not in codecs:
            codecs[spec] = load_codec(spec, SENTENCES)
        return codecs[spec]

    names = cfg.served_names
    main = ServedModel(names[0], cfg.model, codec_for(cfg.ext_tokenizer))
    catalog = dict.fromkeys(names, main)
    for extra in cfg.ext_models:
        entry = ServedModel(extra.name, extra.name, codec_for(extra.tokenizer or cfg.ext_tokenizer))
        for name in (extra.name, *extra.aliases):
            catalog[name] = entry
    return catalog
