"""The HTTP surface: OpenAI endpoints, health, metrics and ``/admin/config`` on aiohttp.

One ``Rank`` is one simulated engine (queue, metrics) behind one port; data-parallel ranks
share the configuration and model catalog. Streams are written event by event with the
transport checked after each write, so a client that goes away stops generation at the
next token, and the request is counted as ``finish_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections import OrderedDict
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from llmsim import latency
from llmsim.catalog import ServedModel
from llmsim.chaos import NO_CHAOS, ChaosPlan, plan_chaos, split_points
from llmsim.errors import ApiError, injected_failure
from llmsim.llmd.frontend import LlmdFrontend
from llmsim.metrics import FINISH_REASONS, Metrics, ModelStats
from llmsim.payloads import GenerationRequest, Kind, parse_request
from llmsim.scheduler import Engine, Ticket
from llmsim.settings import FAILURE_TYPES, ConfigError, ConfigHolder, SimConfig, to_public_dict
from llmsim.sse import DONE, StreamEvents, escape, stamped, usage_json
from llmsim.textgen import Answer, group_pieces, plan_answer

PREFIX_CACHE_PROMPTS = 10_000

log = logging.getLogger("llmsim")

# Pause between the parts of a split event, so they leave as separate TCP segments.
_SPLIT_PAUSE_S = 0.002


class Rank:
    """One data-parallel rank: an engine, its metrics, and the routes that use them."""

    def __init__(
        self,
        holder: ConfigHolder,
        catalog: dict[str, ServedModel],
        rng: random.Random,
    ) -> None:
        cfg = holder.current
        self.holder = holder
        self.catalog = catalog
        self.rng = rng
        self.engine = Engine(cfg.max_num_seqs, cfg.max_waiting_queue_length)
        names = sorted({m.display for m in catalog.values()})
        # The real simulator shows a finish reason once it has happened, and never "abort".
        reasons = () if cfg.ext_compat else FINISH_REASONS
        self.metrics = Metrics(names, cfg.max_model_len, reasons)
        self.started_at = time.monotonic()
        self.port = cfg.port  # the bound port once serving (names compat request ids)
        self.compat = LlmdFrontend(self) if cfg.ext_compat else None
        # Prompts seen (``ext_prefix_cache_block``): a digest per model and prompt, oldest out.
        self.seen_prompts: OrderedDict[bytes, None] = OrderedDict()

    def cached_prompt_tokens(
        self, cfg: SimConfig, model: str, req: GenerationRequest, prompt_tokens: int
    ) -> int | None:
        """vLLM's ``prompt_tokens_details.cached_tokens`` for a prefix cache that keeps whole
        prompts: a prompt seen before on this rank has its whole blocks cached. None: off."""
        block = cfg.ext_prefix_cache_block
        if block <= 0:
            return None
        digest = hashlib.sha256(orjson.dumps([model, req.messages, req.prompt])).digest()
        seen = digest in self.seen_prompts
        self.seen_prompts[digest] = None
        self.seen_prompts.move_to_end(digest)
        if len(self.seen_prompts) > PREFIX_CACHE_PROMPTS:
            self.seen_prompts.popitem(last=False)
        return prompt_tokens // block * block if seen else 0

    def app(self) -> web.Application:
        cfg = self.holder.current
        app = web.Application(
            middlewares=[_openai_errors],
            client_max_size=cfg.max_request_body_size_mb * 1024 * 1024,
        )
        if self.compat is not None:
            app.router.add_post("/v1/chat/completions", self.compat.chat)
            app.router.add_post("/v1/completions", self.compat.text)
            app.on_shutdown.append(self.compat.close)
        else:
            app.router.add_post("/v1/chat/completions", self.chat_completions)
            app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/admin/config", self.get_config)
        app.router.add_post("/admin/config", self.post_config)
        return app

    # --- operations ---------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, _: web.Request) -> web.Response:
        elapsed = time.monotonic() - self.started_at
        if elapsed < self.holder.current.startup_duration:
            return ApiError(503, "model is still loading").response()
        return web.Response(status=200)

    async def metrics_text(self, _: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def get_config(self, _: web.Request) -> web.Response:
        return _json(to_public_dict(self.holder.current))

    async def post_config(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        try:
            cfg = self.holder.replace(body)
        except ConfigError as exc:
            raise ApiError(400, str(exc), exc.key) from exc
        log.info("configuration updated: %s", sorted(body))
        return _json(to_public_dict(cfg))

    async def models(self, _: web.Request) -> web.Response:
        cfg = self.holder.current
        now = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": served.root,
                "parent": None,
                "max_model_len": cfg.max_model_len,
            }
            for name, served in self.catalog.items()
        ]
        return _json({"object": "list", "data": data})

    # --- generation ---------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "text")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        started = time.monotonic()
        cfg = self.holder.current  # one snapshot for the whole request
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        headers: dict[str, str] = {}
        if cfg.enable_request_id_headers:
            headers["X-Request-Id"] = request.headers.get("X-Request-Id") or request_id
        try:
            req, served, prompt_tokens, answer = await self._admit_checks(request, kind, cfg)
            ticket = self.engine.admit()
        except ApiError as exc:
            return exc.response(headers)
        stats = self.metrics.for_model(served.display)
        run = _Run(self, request, cfg, req, served, answer, prompt_tokens, stats, request_id)
        return await run.execute(ticket, headers, started)

    async def _admit_checks(
        self, request: web.Request, kind: Kind, cfg: SimConfig
    ) -> tuple[GenerationRequest, ServedModel, int, Answer]:
        forced = request.headers.get("X-Return-Error")
        if forced is not None:
            try:
                status = int(forced)
            except ValueError:
                msg = f"X-Return-Error must be an HTTP status code, got {forced!r}"
                raise ApiError(400, msg) from None
            raise ApiError(status, f"error forced by X-Return-Error: {status}")
        req = parse_request(kind, await _read_json(request))
        if cfg.failure_injection_rate and self.rng.random() * 100 < cfg.failure_injection_rate:
            kind_name = self.rng.choice(cfg.failure_types or FAILURE_TYPES)
            raise injected_failure(kind_name, cfg.model)
        served = self.catalog.get(req.model)
        if served is None:
            raise ApiError(404, f"The model `{req.model}` does not exist.", "model")
        prompt_tokens = req.prompt_tokens(served.codec)
        requested = prompt_tokens + (req.max_tokens or 0)
        if requested > cfg.max_model_len or prompt_tokens >= cfg.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {requested} tokens ({prompt_tokens} in the messages, "
                f"{req.max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion",
                "messages" if kind == "chat" else "prompt",
            )
        answer = plan_answer(
            served.codec,
            cfg.mode,
            req.echo_text,
            req.max_tokens,
            req.ignore_eos,
            cfg.max_model_len - prompt_tokens,
            self.rng,
        )
        return req, served, prompt_tokens, answer


class _Run:
    """One admitted request from queue to last byte; always counted exactly once."""

    def __init__(
        self,
        rank: Rank,
        request: web.Request,
        cfg: SimConfig,
        req: GenerationRequest,
        served: ServedModel,
        answer: Answer,
        prompt_tokens: int,
        stats: ModelStats,
        request_id: str,
    ) -> None:
        self.rank = rank
        self.request = request
        self.cfg = cfg
        self.req = req
        self.served = served
        self.answer = answer
        self.prompt_tokens = prompt_tokens
        self.cached = rank.cached_prompt_tokens(cfg, served.display, req, prompt_tokens)
        self.stats = stats
        self.request_id = request_id
        self.generated = 0
        self.first_token_at: float | None = None

    async def execute(
        self, ticket: Ticket, headers: dict[str, str], started: float
    ) -> web.StreamResponse:
        stats = self.stats
        outcome = "abort"
        run_start: float | None = None
        response: web.StreamResponse | None = None
        try:
            if self.req.stream:
                response = web.StreamResponse(headers=headers)
                response.content_type = "text/event-stream"
                response.headers["Cache-Control"] = "no-cache"
                await response.prepare(self.request)
                await response.write(b"")  # headers leave now, as a real server's would
            if ticket.waiting:
                stats.waiting += 1
                try:
                    await ticket.wait()
                finally:
                    stats.waiting -= 1
            run_start = time.monotonic()
            stats.queue.observe(run_start - started)
            stats.running += 1
            stats.prompt_tokens += self.prompt_tokens
            rng = self.rank.rng
            ttft = latency.time_to_first_token(
                self.cfg, self.prompt_tokens, self.rank.engine.running, rng
            )
            if ttft > 0:
                await asyncio.sleep(ttft)
            if response is not None:
                outcome = await self._stream(response, started)
                return response
            response = await self._complete(headers, started)
            outcome = self.answer.finish_reason
            return response
        except ConnectionError:
            # The client left between our transport check and a write; aiohttp finishes
            # a response on a closed connection quietly, so hand it back.
            outcome = "abort"
            if response is None:
                raise
            return response
        finally:
            ticket.release()
            ended = time.monotonic()
            if run_start is not None:
                stats.running -= 1
                stats.inference.observe(ended - run_start)
                first = self.first_token_at
                if first is not None:
                    stats.prefill.observe(first - run_start)
                    stats.decode.observe(ended - first)
            stats.finished(self.prompt_tokens, self.generated, self.req.max_tokens, outcome)
            stats.e2e.observe(ended - started)

    def _decode_delay(self, tokens: int) -> float:
        cfg = self.cfg
        if tokens <= 0 or cfg.inter_token_latency <= 0:
            return 0.0
        running = self.rank.engine.running
        if cfg.inter_token_latency_std_dev <= 0:
            return tokens * latency.inter_token_latency(cfg, running, self.rank.rng)
        return sum(latency.inter_token_latency(cfg, running, self.rank.rng) for _ in range(tokens))

    async def _complete(self, headers: dict[str, str], started: float) -> web.Response:
        answer = self.answer
        stats = self.stats
        self.first_token_at = first = time.monotonic()
        stats.ttft.observe(first - started)
        delay = self._decode_delay(answer.completion_tokens - 1)
        if delay > 0:
            await asyncio.sleep(delay)
        if answer.completion_tokens > 1:
            gap = (time.monotonic() - first) / (answer.completion_tokens - 1)
            stats.itl.observe(gap, answer.completion_tokens - 1)
        stats.generation_tokens += answer.completion_tokens
        self.generated = answer.completion_tokens
        text = "".join(answer.pieces)
        if self.req.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": answer.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": answer.finish_reason,
            }
            obj = "text_completion"
        body = {
            "id": self.request_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.served.display,
            "choices": [choice],
            "usage": orjson.loads(
                usage_json(self.prompt_tokens, answer.completion_tokens, self.cached)
            ),
        }
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", headers=headers
        )

    async def _stream(self, response: web.StreamResponse, started: float) -> str:
        """Write the token events; the finish reason, or ``abort`` if the client left."""
        cfg = self.cfg
        req = self.req
        request = self.request
        rng = self.rank.rng
        stats = self.stats
        loop = asyncio.get_running_loop()
        events = StreamEvents(
            req.kind == "chat", self.request_id, int(time.time()), self.served.display
        )
        groups = group_pieces(self.answer.pieces, cfg.ext_tokens_per_chunk)
        chaos = plan_chaos(cfg, len(groups), rng) if groups else NO_CHAOS
        paced = cfg.inter_token_latency > 0
        stamp = cfg.ext_stamp_events
        continuous = req.continuous_usage
        prompt_tokens = self.prompt_tokens
        write = response.write
        pending = b""
        if req.kind == "chat":
            pending = events.role(usage_json(prompt_tokens, 0, self.cached) if continuous else None)
        next_at = loop.time()
        last_at = 0.0
        for index, (text, tokens) in enumerate(groups):
            if paced:
                # The event leaves when its last token is "generated": deadlines, not sleeps,
                # so scheduling overhead does not accumulate into the measured ITL.
                next_at += self._decode_delay(tokens - 1 if index == 0 else tokens)
                delay = next_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            self.generated += tokens
            stats.generation_tokens += tokens
            if continuous:
                event = events.token_with_usage(
                    escape(text), usage_json(prompt_tokens, self.generated, self.cached)
                )
            else:
                event = events.token(escape(text))
            if stamp:
                # Taken just before the write: aiohttp hands the bytes to the socket at once.
                event = stamped(event, time.time_ns())
            now = time.monotonic()
            if index == 0:
                self.first_token_at = now
                stats.ttft.observe(now - started)
                event = pending + event
            else:
                # One observation per token of the event, the gap shared out between them.
                stats.itl.observe((now - last_at) / tokens, tokens)
            last_at = now
            if chaos.active:
                if not await self._chaos_write(response, event, index, chaos, events):
                    return "abort"
            else:
                await write(event)
            transport = request.transport
            if transport is None or transport.is_closing():
                return "abort"
            if not paced:
                await asyncio.sleep(0)  # let a disconnect (or other streams) be noticed
        usage = usage_json(prompt_tokens, self.generated, self.cached)
        tail = events.finish(self.answer.finish_reason, usage if continuous else None)
        if not groups and req.kind == "chat":
            tail = pending + tail
        if req.include_usage:
            tail += events.usage(usage)
        await write(tail + DONE)
        await response.write_eof()
        return self.answer.finish_reason

    async def _chaos_write(
        self,
        response: web.StreamResponse,
        event: bytes,
        index: int,
        chaos: ChaosPlan,
        events: StreamEvents,
    ) -> bool:
        """Write one event with the planned faults; False once the connection is cut."""
        if chaos.split_writes:
            for part in split_points(event, self.rank.rng):
                await response.write(part)
                await asyncio.sleep(_SPLIT_PAUSE_S)
        else:
            await response.write(event)
        if index == chaos.malformed_after:
            await response.write(events.malformed())
        if index == chaos.stall_after:
            await asyncio.sleep(chaos.stall_seconds)
        if index == chaos.disconnect_after:
            transport = self.request.transport
            if transport is not None:
                transport.close()  # flushes what was written, then FIN: no [DONE] ever comes
            return False
        return True


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON in request body: {exc}", "body") from exc


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as an OpenAI-style JSON body; nothing escapes to crash a handler."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason or "error").response()
    except ConnectionError:
        raise
    except Exception:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        return ApiError(500, "internal simulator error").response()
