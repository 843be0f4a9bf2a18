"""``extproc serve``, ``extproc check-config`` and ``extproc bench`` (the benchmark tool)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import orjson
import structlog

from extproc.config import ConfigError, load_config


def _configure_logging(level: str) -> None:
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=lambda o, **_: orjson.dumps(o).decode()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


TOOLS_MODULES = ("rich", "matplotlib")


def _tool(name: str, argv: list[str]) -> int:
    """A tool sub-command, imported only when asked for: ``serve`` never loads rich or
    matplotlib, and an install without the ``tools`` extra gets one clear line."""
    import importlib.util

    missing = [m for m in TOOLS_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"extproc {name}: needs the tools extra ({', '.join(missing)} missing): "
            "pip install 'token-quota-extproc[tools]'",
            file=sys.stderr,
        )
        return 2
    from loadlab.bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _tool("bench", argv[1:])
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the ext_proc gRPC server")
    serve.add_argument("--config", required=True)
    serve.add_argument("--listen", help="override the config's listen address (host:port)")
    serve.add_argument("--redis-url", help="override the config's redis_url")
    serve.add_argument("--metrics-listen", help="host:port for Prometheus /metrics (off if unset)")
    serve.add_argument(
        "--drain-delay-s",
        type=float,
        help="override the config's drain_delay_s: after SIGTERM, seconds of NOT_SERVING "
        "while new streams are still taken (0 when nothing health-checks the processor)",
    )
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes, all on the one --listen port (SO_REUSEPORT: the kernel "
        "spreads connections among them), so Envoy's processor cluster lists one endpoint "
        "and needs max_requests_per_connection (e.g. 100) to spread its few long-lived "
        "HTTP/2 connections. Needs a Redis redis_url (memory:// would count per worker) and "
        "a fixed port. Worker i serves /metrics on the --metrics-listen port + i: scrape "
        "each. A worker that dies is restarted; SIGTERM/SIGINT drain them all",
    )
    check = sub.add_parser("check-config", help="validate a config, print its normal form and hash")
    check.add_argument("config")
    # Handled before parsing (its own parser, in the tools package); listed for --help.
    sub.add_parser("bench", help="streaming-latency benchmark runs (extproc bench --help)")
    args = parser.parse_args(argv)

    if args.command == "check-config":
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            print(f"invalid config: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(
            orjson.dumps(
                {"config_hash": config.hash, "config": config.normalised},
                option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
            ).decode()
            + "\n"
        )
        return 0

    _configure_logging(args.log_level)
    overrides = {
        "listen": args.listen,
        "redis_url": args.redis_url,
        "drain_delay_s": args.drain_delay_s,
    }
    try:
        config = load_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1:
        from extproc.transport.workers import refusal, supervise

        # Refused before any worker starts: N in-memory counters multiply every limit by N.
        problem = refusal(args.workers, config.listen, config.redis_url, args.metrics_listen)
        if problem is not None:
            print(f"extproc: {problem}", file=sys.stderr)
            return 2
        shared = ["--config", args.config, "--log-level", args.log_level]
        if args.redis_url:
            shared += ["--redis-url", args.redis_url]
        if args.drain_delay_s is not None:
            shared += ["--drain-delay-s", str(args.drain_delay_s)]
        return supervise(shared, args.workers, config.listen, args.metrics_listen)
    from extproc.transport.server import serve as run_server

    try:
        asyncio.run(run_server(config, args.metrics_listen))
    except RuntimeError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
