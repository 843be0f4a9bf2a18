"""The life of a generation request as v0.10.2 leads it.

A request becomes one sub-request per choice (``n``; for text completions also one per
prompt of a prompt list), each queued for an engine slot of its own. A sub-request that
finds the waiting queue full fails alone. Once it holds a slot it is tokenized and checked
against the context window (so that error comes after the queue), planned (tool calls, or
text), and "generated" token by token into a queue of its own; the HTTP side only reads
that queue. Generation therefore never notices the client: a client that leaves changes
nothing, the slot stays busy until the planned answer is complete, and the metrics count
every planned token with the planned finish reason (never ``abort``).

Streams: headers (200) leave at once; the first thing read from the sub-requests decides
the chunks' id and creation time and, for every choice's closing chunk, the finish reason
(a quirk kept: with ``n > 1`` every choice closes with the first choice's reason). An
error read at any point (context window, full queue, a tool that cannot be called) is
written as ``data: {"error": ...}`` and ``data: [DONE]`` and ends the stream, 200 and all.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmsim import latency
from llmsim.errors import ApiError, injected_failure
from llmsim.llmd import answers, tools, wire
from llmsim.llmd.request import (
    BodyError,
    Kind,
    ParsedRequest,
    Prompt,
    RequestError,
    parse_body,
    validate,
)
from llmsim.llmd.tokenizer import render_messages, split
from llmsim.metrics import ModelStats
from llmsim.settings import FAILURE_TYPES, SimConfig

if TYPE_CHECKING:
    from llmsim.scheduler import Ticket
    from llmsim.server import Rank

log = logging.getLogger("llmsim")
_EMPTY_RESPONSE_ERROR = "unexpected response part in streaming"


@dataclass(frozen=True, slots=True)
class SubRequest:
    index: int  # the choice index in the answer
    request_id: str  # what its chunks are named after ("<id>-<prompt>" for text prompts)
    prompt: Prompt | None  # text completions; chat uses the request's messages


@dataclass(frozen=True, slots=True)
class Plan:
    """A sub-request's answer, decided once it holds a slot."""

    sub: SubRequest
    prompt_tokens: int
    tokens: list[str]
    tool_calls: list[tools.ToolCall] | None
    finish_reason: str

    @property
    def completion_tokens(self) -> int:
        if self.tool_calls is not None:
            return sum(call.cost for call in self.tool_calls)
        return len(self.tokens)


# What a sub-request hands the HTTP side, in order: Created (after the prefill time), then
# one Token per token, or Empty for an answer of no tokens; or a Failure at any point.
@dataclass(frozen=True, slots=True)
class Created:
    plan: Plan


@dataclass(frozen=True, slots=True)
class Token:
    plan: Plan
    text: str
    call: tools.ToolCall | None


@dataclass(frozen=True, slots=True)
class Empty:
    plan: Plan


@dataclass(frozen=True, slots=True)
class Failure:
    index: int
    error: RequestError


_ALL_DONE = None
Item = Created | Token | Empty | Failure | None


def _usage(plans: list[Plan]) -> wire.Usage:
    """Completion tokens summed; prompt tokens once per sub-request id (n copies share one)."""
    if len(plans) == 1:
        return wire.Usage(plans[0].prompt_tokens, plans[0].completion_tokens)
    seen: set[str] = set()
    prompt = 0
    for plan in plans:
        if plan.sub.request_id not in seen:
            seen.add(plan.sub.request_id)
            prompt += plan.prompt_tokens
    return wire.Usage(prompt, sum(p.completion_tokens for p in plans))


class LlmdFrontend:
    """The chat and text completion endpoints of one rank in v0.10.2's manner."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        cfg = rank.holder.current
        self._uuid_seed = cfg.seed if cfg.seed is not None else time.time_ns()
        self._uuid_count = 0
        self._producers: set[asyncio.Task[None]] = set()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def text(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "text")

    async def close(self, _: web.Application) -> None:
        for task in list(self._producers):
            task.cancel()

    # --- admission ----------------------------------------------------------------------

    def _request_id(self, cfg: SimConfig, incoming: str | None) -> str:
        if cfg.enable_request_id_headers and incoming:
            return incoming
        # As the real one names them: a SHA-1 UUID of "<seed>-<port>-<count>".
        name = f"{self._uuid_seed}-{self.rank.port}-{self._uuid_count}"
        self._uuid_count += 1
        return str(uuid.uuid5(uuid.NAMESPACE_URL, name))

    def _refusal(self, cfg: SimConfig, req: ParsedRequest, headers: Any) -> RequestError | None:
        rng = self.rank.rng
        forced = headers.get("X-Return-Error")
        if forced:
            try:
                code = int(forced)
            except ValueError:
                return RequestError(
                    400, f"Invalid X-Return-Error header value {forced!r}: must be an integer"
                )
            return RequestError(
                code, f"Simulated error triggered by X-Return-Error header (code {code})"
            )
        if cfg.failure_injection_rate and rng.randint(1, 100) <= cfg.failure_injection_rate:
            kinds = cfg.failure_types or FAILURE_TYPES
            failure: ApiError = injected_failure(kinds[rng.randint(0, len(kinds) - 1)], cfg.model)
            return RequestError(failure.status, failure.message, failure.param)
        if req.model not in self.rank.catalog:
            return RequestError(404, f"The model `{req.model}` does not exist.")
        try:
            if req.kind == "chat":
                tools.validate_tools(req.tools)
            validate(req)
        except RequestError as exc:
            return exc
        return None

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        # A request read is a request served, whether or not its client is still there.
        admission = asyncio.ensure_future(self._admit(request, kind))
        admitted = await asyncio.shield(admission)
        if isinstance(admitted, web.Response):
            return admitted
        req, choices, out, headers = admitted
        if req.stream:
            return await self._stream(request, req, choices, out, headers)
        return await self._complete(req, choices, out, headers)

    async def _admit(
        self, request: web.Request, kind: Kind
    ) -> web.Response | tuple[ParsedRequest, int, asyncio.Queue[Item], dict[str, str]]:
        """An error answer, or the request with its sub-requests queued for slots."""
        started = time.monotonic()
        cfg = self.rank.holder.current
        try:
            req = parse_body(kind, await request.read())
        except BodyError as exc:
            return _error("Failed to read and parse request body, " + str(exc), 400)
        request_id = self._request_id(cfg, request.headers.get("X-Request-Id"))
        refusal = self._refusal(cfg, req, request.headers)
        if refusal is not None:
            return _error(refusal.message, refusal.status, refusal.param)
        headers = {"Server": "fasthttp"}
        if cfg.enable_request_id_headers:
            headers["X-Request-Id"] = request_id
        out: asyncio.Queue[Item] = asyncio.Queue()
        subs = _split(req, request_id)
        self._start(cfg, req, subs, out, started)
        return req, len(subs), out, headers

    def _start(
        self,
        cfg: SimConfig,
        req: ParsedRequest,
        subs: list[SubRequest],
        out: asyncio.Queue[Item],
        started: float,
    ) -> None:
        served = self.rank.catalog[req.model]
        stats = self.rank.metrics.for_model(served.display)
        remaining = [len(subs)]

        def done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                out.put_nowait(_ALL_DONE)

        for sub in subs:
            try:
                ticket = self.rank.engine.admit()
            except ApiError as exc:  # the waiting queue is full
                out.put_nowait(Failure(sub.index, RequestError(exc.status, exc.message)))
                done()
                continue
            run = self._produce(cfg, req, sub, ticket, stats, out, started)
            task = asyncio.get_running_loop().create_task(run)
            self._producers.add(task)
            task.add_done_callback(self._producers.discard)
            task.add_done_callback(lambda _: done())

    # --- generation (never sees the client) ---------------------------------------------

    def _plan(self, cfg: SimConfig, req: ParsedRequest, sub: SubRequest) -> Plan:
        rng = self.rank.rng
        if req.kind == "chat":
            prompt_tokens = len(split(render_messages(list(req.messages))))
            last = req.messages[-1].plain_text(False) if req.messages else ""
            echo = split(last)
        else:
            assert sub.prompt is not None
            if sub.prompt.ids is not None:
                prompt_tokens = len(sub.prompt.ids)
                ids = [str(i) for i in sub.prompt.ids]
                echo = [s + "," for s in ids[:-1]] + ids[-1:]
            else:
                echo = split(sub.prompt.text)
                prompt_tokens = len(echo)
        requested = prompt_tokens + (req.max_tokens or 0)
        if requested > cfg.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {requested} tokens ({prompt_tokens} in the messages, "
                f"{req.max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion",
            )
        calls = None
        if req.kind == "chat" and req.tools is not None and req.tool_choice.mode != "none":
            try:
                calls = tools.make_calls(req.tools, req.tool_choice, cfg, rng)
            except tools.ToolError as exc:
                raise RequestError(
                    500,
                    f"failed to create response for chat completion request "
                    f"(req id {sub.request_id}) {exc}",
                ) from exc
        if calls is not None:
            tokens, reason = [], answers.FINISH_TOOLS
        else:
            if cfg.mode == "echo":
                answer = answers.echo_answer(echo, req.max_tokens)
            else:
                context_left = cfg.max_model_len - prompt_tokens
                answer = answers.random_answer(req.max_tokens, req.ignore_eos, context_left, rng)
            tokens, reason = answer.tokens, answer.finish_reason
        if req.remote_decode and not req.stream:
            reason = "remote_decode"
        return Plan(sub, prompt_tokens, tokens, calls, reason)

    async def _produce(
        self,
        cfg: SimConfig,
        req: ParsedRequest,
        sub: SubRequest,
        ticket: Ticket,
        stats: ModelStats,
        out: asyncio.Queue[Item],
        started: float,
    ) -> None:
        engine = self.rank.engine
        rng: random.Random = self.rank.rng
        try:
            if ticket.waiting:
                stats.waiting += 1
                try:
                    await ticket.wait()
                finally:
                    stats.waiting -= 1
            run_start = time.monotonic()
            stats.queue.observe(run_start - started)
            stats.running += 1
            try:
                try:
                    plan = self._plan(cfg, req, sub)
                except RequestError as exc:
                    out.put_nowait(Failure(sub.index, exc))
                    return
                ttft = latency.time_to_first_token(cfg, plan.prompt_tokens, engine.running, rng)
                if ttft > 0:
                    await asyncio.sleep(ttft)
                out.put_nowait(Created(plan))
                first = time.monotonic()
                stats.ttft.observe(first - started)
                stats.prefill.observe(first - run_start)
                await self._emit(cfg, plan, out, stats)
                ended = time.monotonic()
                stats.decode.observe(ended - first)
                stats.inference.observe(ended - run_start)
                stats.e2e.observe(ended - started)
                stats.prompt_tokens += plan.prompt_tokens
                stats.generation_tokens += plan.completion_tokens
                stats.finished(
                    plan.prompt_tokens, plan.completion_tokens, req.max_tokens, plan.finish_reason
                )
            finally:
                stats.running -= 1
        finally:
            ticket.release()

    async def _emit(
        self, cfg: SimConfig, plan: Plan, out: asyncio.Queue[Item], stats: ModelStats
    ) -> None:
        if plan.tool_calls is not None:
            pieces = [(t, call) for call in plan.tool_calls for t in call.argument_tokens]
        else:
            pieces = [(t, None) for t in plan.tokens]
        if not pieces:
            out.put_nowait(Empty(plan))
            return
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        for position, (text, call) in enumerate(pieces):
            if position and cfg.inter_token_latency > 0:
                gap = latency.inter_token_latency(cfg, self.rank.engine.running, self.rank.rng)
                stats.itl.observe(gap)
                next_at += gap
                delay = next_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            out.put_nowait(Token(plan, text, call))

    # --- the HTTP side ------------------------------------------------------------------

    async def _complete(
        self, req: ParsedRequest, choices: int, out: asyncio.Queue[Item], headers: dict[str, str]
    ) -> web.Response:
        plans: list[Plan | None] = [None] * choices
        tokens: list[list[str]] = [[] for _ in range(choices)]
        while (item := await out.get()) is not _ALL_DONE:
            if isinstance(item, Failure):
                # Fail fast; the other sub-requests run on unseen.
                return _error(item.error.message, item.error.status, item.error.param, headers)
            index = item.plan.sub.index
            plans[index] = plans[index] or item.plan
            if isinstance(item, Token) and item.call is None:
                tokens[index].append(item.text)
        done = [p for p in plans if p is not None]
        first = done[0]
        body = wire.completion(
            req.kind == "chat",
            _response_id(req, first),
            self.rank.catalog[req.model].display,
            int(time.time()),
            _usage(done),
            [
                wire.FinalChoice(tokens[i], p.finish_reason, p.tool_calls, req.logprobs)
                for i, p in enumerate(done)
            ],
            remote_decode=req.remote_decode,
        )
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def _stream(
        self,
        request: web.Request,
        req: ParsedRequest,
        choices: int,
        out: asyncio.Queue[Item],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        response.content_type = "text/event-stream"
        await response.prepare(request)
        writer = _StreamWriter(req, choices, self.rank.catalog[req.model].display)
        try:
            while True:
                item = await out.get()
                data, finished = writer.feed(item)
                while not finished and not out.empty():  # write what is ready at once
                    more, finished = writer.feed(out.get_nowait())
                    data += more
                if data:
                    await response.write(data)
                if finished:
                    break
            await response.write_eof()
        except ConnectionError:
            pass  # the client left; generation goes on regardless
        return response


class _StreamWriter:
    """The bytes of a stream for each thing read from the sub-requests, in order."""

    def __init__(self, req: ParsedRequest, choices: int, model: str) -> None:
        self.req = req
        self.model = model
        self.plans: list[Plan | None] = [None] * choices
        self.first: Plan | None = None
        self.chunks: wire.Chunks | None = None
        self.role_sent = [False] * choices
        self.last_call: list[tools.ToolCall | None] = [None] * choices
        self.call_position = [0] * choices

    def feed(self, item: Item) -> tuple[bytes, bool]:
        """(bytes to write, whether the stream is over)."""
        if isinstance(item, Failure):
            body = wire.error_body(item.error.status, item.error.message, item.error.param)
            return wire.sse(body) + wire.DONE, True
        if item is _ALL_DONE:
            return self._closing(), True
        plan = item.plan
        index = plan.sub.index
        if self.first is None:
            self.first = plan
            chat = self.req.kind == "chat"
            self.chunks = wire.Chunks(
                chat, _response_id(self.req, plan), self.model, int(time.time())
            )
        self.plans[index] = self.plans[index] or plan
        chunks = self.chunks
        assert chunks is not None
        if isinstance(item, Created):
            return b"", False
        if isinstance(item, Empty):
            # The real writer reports the error to a response already under way and stops:
            # the stream ends with no finish chunk and no [DONE].
            log.warning("%s: answer of no tokens", _EMPTY_RESPONSE_ERROR)
            return b"", True
        data = b""
        if not self.role_sent[index]:
            self.role_sent[index] = True
            if self.req.kind == "chat":
                data = chunks.role(index)
        if item.call is None:
            return data + chunks.content(index, item.text, self.req.logprobs), False
        call = item.call
        if self.last_call[index] is not call:
            self.last_call[index], self.call_position[index] = call, 0
        else:
            self.call_position[index] += 1
        position = self.call_position[index]
        reason = self.first.finish_reason
        closes = position == len(call.argument_tokens) - 1 and reason in ("length", "tool_calls")
        finish = reason if closes else None
        return data + chunks.tool(index, call, position == 0, item.text, finish), False

    def _closing(self) -> bytes:
        assert self.first is not None and self.chunks is not None
        data = b""
        for index, plan in enumerate(self.plans):
            assert plan is not None
            if self.req.kind == "chat" and plan.finish_reason == answers.FINISH_TOOLS:
                continue  # the last tool-call chunk carried it
            data += self.chunks.finish(index, self.first.finish_reason)
        if self.req.include_usage:
            plans = [p for p in self.plans if p is not None]
            data += self.chunks.usage(_usage(plans))
        return data + wire.DONE


def _split(req: ParsedRequest, request_id: str) -> list[SubRequest]:
    copies = req.choices
    if req.kind == "chat":
        return [SubRequest(i, request_id, None) for i in range(copies)]
    assert req.prompts is not None
    subs = []
    for p, prompt in enumerate(req.prompts):
        for _ in range(copies):
            subs.append(SubRequest(len(subs), f"{request_id}-{p}", prompt))
    return subs


def _response_id(req: ParsedRequest, plan: Plan) -> str:
    prefix = wire.CHAT_ID_PREFIX if req.kind == "chat" else wire.TEXT_ID_PREFIX
    return prefix + plan.sub.request_id


def _error(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=wire.error_body(status, message, param),
        status=status,
        content_type="application/json",
        headers={"Server": "fasthttp", **(headers or {})},
    )
