"""The processor's gRPC server: ext_proc + standard health, graceful stop on SIGTERM,
configuration reload on SIGHUP and on file change (``extproc.app.reload``).

Stop order: NOT_SERVING first, while new streams are still taken (``drain_delay_s``, until
Envoy's health checks have seen it: Envoy sends no new stream to a processor refusing them);
then no new streams, and the open ones may finish (``shutdown_grace_s``); then each one
still open is ended cleanly by the meter (an error event with code ``shutdown``, ``[DONE]``)
and settled as ``shutdown``; then the server stops.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

import grpc
import structlog
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.exposition import choose_encoder

from extproc.app.reload import DEFAULT_POLL_S, ConfigReloader
from extproc.app.runtime import Runtime, quota_backend
from extproc.app.sched import DEFAULT_GRPC_THREADS, grpc_server, resolved
from extproc.app.workers import WorkerRole, beat_supervisor
from extproc.config import Config
from extproc.metrics import Metrics
from extproc.quota.base import QuotaMisconfigured, QuotaUnavailable
from extproc.transport.service import ExternalProcessorService
from extproc.transport.tls import RotatingCredentials

log = structlog.get_logger("extproc.server")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# Once the grace is over: how long Envoy may take to close the streams the meter just ended
# (milliseconds, normally), and the pending settlements to finish.
END_WAIT_S = 5.0


async def _metrics_app(runtime: Runtime, listen: str) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(
            body=encoder(runtime.metrics_registry), headers={"Content-Type": content_type}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = listen.rpartition(":")
    await web.TCPSite(runner, host, int(port)).start()
    return runner


async def serve(
    config: Config,
    metrics_listen: str | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    config_poll_s: float = DEFAULT_POLL_S,
    role: WorkerRole | None = None,
    grpc_threads: str = DEFAULT_GRPC_THREADS,
) -> None:
    """Serve until SIGTERM/SIGINT. With ``config_path`` (the file ``config`` was loaded from,
    with ``overrides``), SIGHUP and every change of its content seen by a poll each
    ``config_poll_s`` (0: no poll) reload it. ``role``: a worker of ``serve --workers N``
    (its share of the fail-open allowance, its beats to the supervisor). ``grpc_threads``:
    the scheduling policy of gRPC's own threads (``extproc.app.sched``)."""
    workers = role.count if role is not None else 1
    metrics = Metrics()
    backend = quota_backend(config, metrics, workers)
    # Before the tokenizers load (about a second of CPU): a worker that cannot reach its
    # backend exits at once, and a restart loop over a dead Redis costs little.
    where = config.normalised["redis_url"]
    try:
        await backend.check()  # says why it failed
    except QuotaMisconfigured as exc:
        raise RuntimeError(f"quota backend at {where}: {exc}") from exc
    except QuotaUnavailable as exc:
        raise RuntimeError(f"quota backend at {where} does not answer") from exc
    runtime = Runtime(config, backend, fail_open_workers=workers, metrics=metrics)
    runtime.warm_up()
    # Tokenizer vocabularies are hundreds of thousands of long-lived objects: keep the cyclic
    # GC from rescanning them, and collect young objects less often (measured: the
    # per-message cost of billing drops by about a quarter).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)

    loop = asyncio.get_running_loop()
    # Before SERVING: a SIGHUP sent once the processor answers is never lost.
    reloader = None
    if config_path is not None:
        reloader = ConfigReloader(runtime, config_path, overrides, config_poll_s)
        loop.add_signal_handler(signal.SIGHUP, reloader.request, "sighup")
        reloader.start()
    # --workers: N processes share the listen port.
    server = grpc_server(grpc_threads, ("grpc.so_reuseport", 1))
    service = ExternalProcessorService(runtime.session, runtime.metrics, runtime.spawn)
    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # /metrics first: it answers before the first stream is taken (once the gRPC port
    # listens, the kernel hands this process connections and the loop serves them first).
    metrics_runner = await _metrics_app(runtime, metrics_listen) if metrics_listen else None
    if config.tls is None:
        port = server.add_insecure_port(config.listen)
    else:
        try:
            credentials = RotatingCredentials(config.tls).credentials()
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"tls: {exc}") from exc
        port = server.add_secure_port(config.listen, credentials)
    if port == 0:
        raise RuntimeError(f"cannot listen on {config.listen}")
    # Plaintext, health only: for probes that speak no TLS (Kubernetes' gRPC probes).
    health_server = None
    if config.health_listen is not None:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        if health_server.add_insecure_port(config.health_listen) == 0:
            raise RuntimeError(f"cannot listen on {config.health_listen}")
        await health_server.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    beats = loop.create_task(beat_supervisor(role)) if role is not None else None
    log.info(
        "serving",
        listen=config.listen,
        port=port,
        tls=config.tls is not None,
        client_cert_required=config.tls is not None and config.tls.require_client_cert,
        health_listen=config.health_listen,
        config_hash=runtime.config.hash,
        backend=config.normalised["redis_url"],
        metrics=metrics_listen,
        grpc_threads=resolved(grpc_threads),
    )

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if reloader is not None:
        # Stopping: the configuration stays as it is now (SIGHUP must not kill the drain).
        loop.add_signal_handler(signal.SIGHUP, log.info, "reload_ignored_while_stopping")
        await reloader.stop()

    # The shutdown timings of the configuration running now (they may have been reloaded).
    config = runtime.config
    # 1. NOT_SERVING, new streams still taken until Envoy's health checks have seen it.
    log.info("shutting_down", open_streams=len(service.streams), drain_delay_s=config.drain_delay_s)
    await health_servicer.enter_graceful_shutdown()
    if config.drain_delay_s > 0:
        await asyncio.sleep(config.drain_delay_s)
    # 2. No new streams (GOAWAY; a stream Envoy opens anyway is refused and retried on
    # another processor); the open ones may finish.
    grace = config.shutdown_grace_s
    log.info("draining", open_streams=len(service.streams), grace_s=grace)
    stopping = asyncio.create_task(server.stop(grace + END_WAIT_S))
    if not await service.wait_closed(grace):
        # 3. Grace over: a cancelled stream would reset the client's connection mid-body, so
        # each still open ends with the meter's closing event and is settled as `shutdown`.
        ended = await service.end_open_streams()
        log.warning("grace_over", ended=ended, open_streams=len(service.streams))
        await service.wait_closed(END_WAIT_S)
    # 4. Admitted requests with nothing sent yet are settled as `shutdown` too; then stop.
    await runtime.drain(timeout_s=END_WAIT_S)
    await server.stop(None)
    await stopping
    if health_server is not None:
        await health_server.stop(None)
    await runtime.drain(timeout_s=END_WAIT_S)
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runtime.close()
    if beats is not None:
        beats.cancel()
    log.info(
        "stopped",
        admitted=runtime.metrics.admitted_total,
        settled=runtime.metrics.settled_by_reason(),
    )
