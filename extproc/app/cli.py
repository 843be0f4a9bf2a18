"""``extproc serve``, ``check-config``, ``key hash|add``, ``usage export|summary``, ``bench``
(benchmarks) and ``chaos`` (chaos runs with an integrity report)."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger

from extproc.app.loop import DEFAULT_LOOP, LOOPS
from extproc.app.loop import run as run_loop
from extproc.app.reload import DEFAULT_POLL_S
from extproc.app.sched import DEFAULT_GRPC_THREADS, GRPC_THREADS
from extproc.app.workers import WORKER_TIMEOUT_S, WorkerRole
from extproc.config import ConfigError, load_config


def _configure_logging(level: str, worker: int | None = None) -> None:
    """JSON records on stderr; a worker of ``serve --workers N`` puts its index in each."""
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())

    def add_worker(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
        event.setdefault("worker", worker)
        return event

    structlog.configure(
        processors=[
            *([add_worker] if worker is not None else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=lambda o, **_: orjson.dumps(o).decode()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


# ``extproc bench`` and ``extproc chaos`` are the lab's (token-quota-lab, lab/pyproject.toml):
# loadlab and what it draws with.
LAB_MODULES = ("loadlab", "rich", "matplotlib")


def _tool(name: str, argv: list[str]) -> int:
    """A lab sub-command, imported only when asked for: ``serve`` never loads loadlab, rich
    or matplotlib, and an install without the lab (the image) gets one clear line."""
    import importlib.util

    missing = [m for m in LAB_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"extproc {name}: needs the lab distribution ({', '.join(missing)} missing): "
            "pip install ./lab (token-quota-lab, in the repository)",
            file=sys.stderr,
        )
        return 2
    if name == "chaos":
        from loadlab.chaos import main as chaos_main

        return chaos_main(argv)
    from loadlab.bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("bench", "chaos"):
        return _tool(argv[0], argv[1:])
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
    serve.add_argument(
        "--tls-cert",
        help="TLS on the gRPC listener: certificate chain file (PEM); with --tls-key, "
        "overrides the config's tls section; re-read on change (rotation)",
    )
    serve.add_argument("--tls-key", help="the --tls-cert certificate's private key (PEM)")
    serve.add_argument(
        "--tls-client-ca",
        help="mutual TLS: clients must present a certificate signed by this CA bundle (PEM)",
    )
    serve.add_argument(
        "--health-listen",
        help="host:port of a plaintext listener serving only grpc.health.v1 (for probes "
        "that speak no TLS, like Kubernetes' gRPC probes)",
    )
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--loop",
        choices=LOOPS,
        default=DEFAULT_LOOP,
        help="the event loop: uvloop (default; fewer CPU-seconds per message) or the "
        "standard asyncio loop; --workers N run theirs on the same",
    )
    serve.add_argument(
        "--grpc-threads",
        choices=GRPC_THREADS,
        default=DEFAULT_GRPC_THREADS,
        help="scheduling of gRPC's own threads: batch (Linux SCHED_BATCH: they don't "
        "preempt the event loop on waking, fewer context switches and CPU-seconds per "
        "message where they share its CPU), normal, or auto (default: batch when the "
        "process may run on one CPU only, else normal); --workers N use the same",
    )
    serve.add_argument(
        "--config-poll-s",
        type=float,
        default=DEFAULT_POLL_S,
        help="seconds between two reads of the --config file: a changed content is "
        "reloaded as on SIGHUP (0: only SIGHUP reloads)",
    )
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
    serve.add_argument(
        "--worker-timeout-s",
        type=float,
        default=WORKER_TIMEOUT_S,
        help="with --workers N: a worker whose event loop has not turned for this long "
        "(SIGSTOPped, blocked, deadlocked) is killed and replaced; its open records are "
        "settled by a peer (0: only dead workers are replaced)",
    )
    # Set by the supervisor on each worker's command line (extproc.app.workers).
    for hidden, kind in (
        ("--worker-index", int),
        ("--worker-count", int),
        ("--worker-beat-fd", int),
        ("--worker-beat-interval-s", float),
    ):
        serve.add_argument(hidden, type=kind, help=argparse.SUPPRESS)
    check = sub.add_parser("check-config", help="validate a config, print its normal form and hash")
    check.add_argument("config")
    _key_parser(sub)
    _usage_parser(sub)
    # Handled before parsing (their own parsers, in the lab's loadlab); listed for --help.
    sub.add_parser("bench", help="streaming-latency benchmark runs (extproc bench --help)")
    sub.add_parser("chaos", help="chaos runs with an integrity report (extproc chaos --help)")
    args = parser.parse_args(argv)

    if args.command == "usage":
        return _usage(args)
    if args.command == "key":
        from extproc.app.keys import key_main

        return key_main(args)

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

    # Until the server's handler is installed, a SIGHUP (a reload asked too early, or passed
    # on by the supervisor to a worker still starting) must not kill the process.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _configure_logging(args.log_level, args.worker_index)
    if args.config_poll_s < 0:
        print("--config-poll-s must be >= 0", file=sys.stderr)
        return 2
    if args.worker_timeout_s < 0:
        print("--worker-timeout-s must be >= 0", file=sys.stderr)
        return 2
    overrides = {
        "listen": args.listen,
        "redis_url": args.redis_url,
        "drain_delay_s": args.drain_delay_s,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.health_listen is not None:
        overrides["health_listen"] = args.health_listen
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            print("--tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        overrides["tls"] = {"cert_file": args.tls_cert, "key_file": args.tls_key}
        if args.tls_client_ca:
            overrides["tls"]["client_ca_file"] = args.tls_client_ca
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    problem = _serve_addresses_problem(args, config.listen)
    if problem is not None:
        print(f"extproc: {problem}", file=sys.stderr)
        return 2
    if args.workers > 1:
        from extproc.app.workers import refusal, supervise

        # Refused before any worker starts: N in-memory counters multiply every limit by N.
        problem = refusal(args.workers, config.listen, config.redis_url, args.metrics_listen)
        if problem is not None:
            print(f"extproc: {problem}", file=sys.stderr)
            return 2
        shared = ["--config", args.config, "--log-level", args.log_level, "--loop", args.loop]
        shared += ["--grpc-threads", args.grpc_threads]
        shared += ["--config-poll-s", str(args.config_poll_s)]
        if args.redis_url:
            shared += ["--redis-url", args.redis_url]
        if args.drain_delay_s is not None:
            shared += ["--drain-delay-s", str(args.drain_delay_s)]
        for name in ("tls_cert", "tls_key", "tls_client_ca", "health_listen"):
            if getattr(args, name):
                shared += ["--" + name.replace("_", "-"), getattr(args, name)]
        return supervise(
            shared, args.workers, config.listen, args.metrics_listen, args.worker_timeout_s
        )
    from extproc.app.server import serve as run_server

    role = None
    if args.worker_index is not None:
        role = WorkerRole(
            args.worker_index,
            args.worker_count or 1,
            args.worker_beat_fd,
            args.worker_beat_interval_s or 1.0,
        )
    try:
        run_loop(
            run_server(
                config,
                args.metrics_listen,
                args.config,
                overrides,
                args.config_poll_s,
                role,
                args.grpc_threads,
            ),
            args.loop,
        )
    except (RuntimeError, OSError) as exc:
        # A port taken between the check and the bind: say which, not grpc's own words.
        why = _serve_addresses_problem(args, config.listen) or str(exc).splitlines()[0]
        print(f"extproc: {why}", file=sys.stderr)
        return 1
    return 0


def _address_problem(what: str, address: str, reuse_port: bool) -> str | None:
    """Why ``address`` (host:port) can't be listened on, in one line, or None if it can.

    Checked by binding it as the server will: gRPC with SO_REUSEPORT (so ``--workers``
    share the port, and another processor's port is shareable), /metrics without. A
    ``unix:`` address is gRPC's to check."""
    if address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not host:
        return f"{what} {address!r} is not host:port (e.g. 127.0.0.1:50051, [::]:50051)"
    if int(port) > 65535:
        return f"{what} {address}: port {port} is above 65535"
    try:
        found = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"{what} {address}: cannot resolve {host!r} ({exc.strerror})"
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                return f"{what} {address}: cannot listen: {why or exc}"
    return None


def _serve_addresses_problem(args: argparse.Namespace, listen: str) -> str | None:
    """The gRPC and /metrics addresses checked before anything starts."""
    what = "--listen" if args.listen else f"listen (in {args.config})"
    problem = _address_problem(what, listen, reuse_port=True)
    if problem is None and args.metrics_listen:
        problem = _address_problem("--metrics-listen", args.metrics_listen, reuse_port=False)
    return problem


def _key_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = sub.add_parser(
        "key",
        help="a tenant key's SHA-256 digest (the config lists digests, never keys), or add one",
    )
    which = key.add_subparsers(dest="key_command", required=True)
    digest = which.add_parser(
        "hash",
        help="print the digest of KEY (read from stdin when not given, so it stays out of "
        "the shell's history)",
    )
    digest.add_argument("key", nargs="?")
    add = which.add_parser(
        "add",
        help="add a key's digest to a tenant of a config file (the tenant is created with "
        "--plan if new); the key is read from stdin, or made with --generate and printed",
    )
    add.add_argument("config")
    add.add_argument("--tenant", required=True)
    add.add_argument("--plan", help="the plan of a new tenant")
    add.add_argument("--generate", action="store_true", help="make a new random key")


def _usage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = sub.add_parser("usage", help="the usage ledger: export it, summarise it")
    which = usage.add_subparsers(dest="usage_command", required=True)
    export = which.add_parser(
        "export",
        help="append every ledger entry to a file (JSON lines or CSV) through a consumer "
        "group: at least once, and exactly once in the file when restarted after a kill",
    )
    summary = which.add_parser("summary", help="totals per tenant and model over a time range")
    for p in (export, summary):
        p.add_argument("--redis-url", required=True)
        p.add_argument("--prefix", default="tq", help="the processors' key_prefix")
        p.add_argument("--redis-username", help="Redis ACL user (overrides the URL's)")
        p.add_argument(
            "--redis-password-file",
            help="file holding the Redis password (a mounted Secret; overrides the URL's; "
            "or set REDIS_PASSWORD)",
        )
    export.add_argument("--group", required=True, help="consumer group (one per destination)")
    export.add_argument("--consumer", required=True, help="this exporter's name in the group")
    export.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    export.add_argument("--output", required=True, help="file to append to")
    export.add_argument("--since", help="ISO 8601; entries settled before it are skipped")
    export.add_argument("--until", help="ISO 8601; entries settled from it on are left pending")
    export.add_argument(
        "--batch", type=int, default=200, help="entries per read, write + fsync, and XACK"
    )
    summary.add_argument("--since", required=True, help="ISO 8601 (no zone: UTC)")
    summary.add_argument("--until", required=True, help="ISO 8601, exclusive")
    summary.add_argument("--by", default="tenant,model", help="tenant, plan, model, reason")
    summary.add_argument("--format", choices=("table", "json"), default="table")


def _redis_password(path: str | None) -> str | None:
    """The password from ``--redis-password-file``, else ``$REDIS_PASSWORD``, else None."""
    import os
    from pathlib import Path

    from extproc.usage.ledger import UsageError

    if path is None:
        return os.environ.get("REDIS_PASSWORD") or None
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"--redis-password-file: cannot read {path}: {exc.strerror}") from exc
    if not secret:
        raise UsageError(f"--redis-password-file: {path} is empty")
    return secret


def _usage(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    import redis

    from extproc.usage.export import export
    from extproc.usage.ledger import UsageError, connect, time_range
    from extproc.usage.summary import as_rows, parse_by, summarise, table

    try:
        since_ms, until_ms = time_range(args.since, args.until)
        by = parse_by(args.by) if args.usage_command == "summary" else ()
        ledger = connect(
            args.redis_url,
            args.prefix,
            username=args.redis_username,
            password=_redis_password(args.redis_password_file),
        )
        try:
            if args.usage_command == "export":
                stats = export(
                    ledger,
                    group=args.group,
                    consumer=args.consumer,
                    fmt=args.format,
                    output=Path(args.output),
                    since_ms=since_ms,
                    until_ms=until_ms,
                    batch=args.batch,
                )
                # What this run did, on stderr: the output file holds only records.
                print(orjson.dumps(asdict(stats)).decode(), file=sys.stderr)
                return 0
            rows = as_rows(summarise(ledger, since_ms, until_ms, by), by)
        finally:
            ledger.close()
    except UsageError as exc:
        print(f"extproc usage: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"extproc usage: Redis failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"extproc usage: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        sys.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(table(rows, by))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
