"""``llmsim`` / ``python -m llmsim``: flags named like the real simulator's, then serve.

Every configuration key is also a flag (``--max-num-seqs 16``, ``--ext-tokenizer
o200k_base``); a flag given on the command line overrides ``SIM_MODEL`` and the YAML file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from llmsim.catalog import build_catalog
from llmsim.settings import (
    KEYS,
    ConfigError,
    ConfigHolder,
    SimConfig,
    build_config,
    keys_for_flags,
)

log = logging.getLogger("llmsim")
_LIST_KEYS = {"served-model-name", "failure-types"}
_BOOL_KEYS = {"enable-request-id-headers", "force-dummy-tokenizer"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmsim",
        description="OpenAI-compatible LLM inference simulator (llm-d-inference-sim profiles).",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the YAML
    )
    parser.add_argument("--config", type=Path, help="YAML profile")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    for key, spec in keys_for_flags():
        dest = f"key:{key}"
        if key in _LIST_KEYS:
            parser.add_argument(f"--{key}", dest=dest, nargs="+", metavar="NAME")
        elif key in _BOOL_KEYS or (spec is None and key.startswith(("no-", "enable-", "omni"))):
            parser.add_argument(f"--{key}", dest=dest, nargs="?", const="true", metavar="BOOL")
        else:
            help_text = spec.help if spec is not None else "accepted for compatibility; ignored"
            parser.add_argument(f"--{key}", dest=dest, metavar="VALUE", help=help_text)
    return parser


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, object]]:
    args = _parser().parse_args(argv)
    flags = {
        name.split(":", 1)[1]: value
        for name, value in vars(args).items()
        if name.startswith("key:")
    }
    return args, flags


async def serve(cfg: SimConfig, host: str, stop: asyncio.Event | None = None) -> None:
    """Serve every data-parallel rank until ``stop`` is set or SIGTERM/SIGINT arrives."""
    from llmsim.server import Rank  # aiohttp app import kept out of config-only callers

    holder = ConfigHolder(cfg)
    catalog = build_catalog(cfg)
    rng = random.Random(cfg.seed)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    try:
        for rank_index in range(cfg.data_parallel_size):
            rank = Rank(holder, catalog, rng)
            # handler_cancellation: a client that disconnects cancels its handler at once.
            runner = web.AppRunner(
                rank.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
            )
            await runner.setup()
            runners.append(runner)
            port = cfg.port + rank_index if cfg.port else 0
            site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
            await site.start()
            bound = site._server.sockets[0].getsockname()[1] if site._server else port  # type: ignore[union-attr]
            rank.port = bound
            print(f"llmsim rank {rank_index} serving on http://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args, flags = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = build_config(getattr(args, "config", None), flags)
        # Tokenizers load (and self-check) before the port opens, so /health means usable.
        build_catalog(cfg)
    except ConfigError as exc:
        print(f"llmsim: configuration error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:
        print(f"llmsim: cannot start: {exc}", file=sys.stderr)
        return 2
    log.info(
        "model %s as %s, tokenizer %s, mode %s, max-num-seqs %d",
        cfg.model,
        list(cfg.served_names),
        "llm-d dummy (ext-compat)" if cfg.ext_compat else cfg.ext_tokenizer or "word-split",
        cfg.mode,
        cfg.max_num_seqs,
    )
    try:
        asyncio.run(serve(cfg, args.host))
    except OSError as exc:
        print(f"llmsim: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = ["KEYS", "main", "parse_args", "serve"]
