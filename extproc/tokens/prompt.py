"""Prompt tokens of an OpenAI-style request, counted the way the model will see them.

``count_prompt_tokens(body, tok)`` is the one call admission makes: a parsed request body
in, the prompt token count out, or ``MalformedRequest`` naming the bad field.

Chat formula (``messages``), per family overhead in ``CHAT_OVERHEAD``::

    tokens = reply_priming
           + Σ_messages ( per_message
                          + count(role) + count(content text parts) + image_tokens × images
                          + [count(name) + per_name]
                          + Σ_tool_calls ( per_tool_call + count(function.name)
                                           + count(function.arguments) )
                          + count(tool_call_id) )
           + [tools_preamble + Σ_tools ( per_tool + count(compact JSON of the function) )]

Sources: ``openai`` follows the OpenAI cookbook "How to count tokens with tiktoken"
(``num_tokens_from_messages``: 3 tokens per message, +1 for a name, +3 for the
``<|start|>assistant<|message|>`` reply priming; exact for gpt-3.5-turbo-0613 onward,
gpt-4 and gpt-4o). OpenAI does not publish how tool definitions are rendered; the same
cookbook's ``num_tokens_for_tools`` uses 7 tokens per function and 12 at the end, and
renders them as a TypeScript-like namespace that is shorter than JSON, so counting the
compact JSON of each function over-counts slightly, which is the safe side for a quota.
``llama`` is the Mistral/Llama-2 ``[INST]`` template counted with the Mistral v1 model:
``"[INST]"`` is 3 tokens, ``" [/INST]"`` 4, BOS 1, ``</s>`` 1, so a message costs at most
7 and the BOS is the 1-token "priming". ``generic`` (the estimator) takes the larger of each.

Completions (``prompt``): a string, an array of strings (summed), an array of token ids
(its length) or an array of token-id arrays (summed lengths); ``suffix`` is added.

Work is bounded: nesting is fixed by the schema (a part is never recursed into), message,
part and tool-call counts are capped, and the text counted is never more than the body
itself, so cost is linear in the body size the transport already limited. The texts are
summed through ``TokenTally``, which counts them with one tokenizer call where that is
provably the same number (``extproc.tokens.tally``).

The walk (``prompt_texts``) is a generator that validates the body, collects the texts and
yields after every ``WALK_STEP`` messages, parts, tool calls or prompts (``ID_STEP`` token
ids): ``count_prompt_tokens`` runs it straight through, admission can let the event loop
run at each yield and count a big prompt's texts off the loop
(``extproc.tokens.offload``). Both give the same number.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import orjson

from extproc.tokens.errors import MalformedRequest
from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.tally import TokenTally

__all__ = [
    "CHAT_OVERHEAD",
    "Limits",
    "MalformedRequest",
    "PromptTexts",
    "count_prompt_tokens",
    "prompt_texts",
]

DEFAULT_IMAGE_TOKENS: Final = 765  # OpenAI's cost of a 512x512 tile-pair "high" image
# The walk yields after this many messages / parts / tool calls / prompts (~1 ms of work
# at most between yields), and after this many token ids of a pre-tokenized prompt.
WALK_STEP: Final = 1024
ID_STEP: Final = 16384

_T = TypeVar("_T")
Walk = Generator[None, None, _T]


@dataclass(frozen=True, slots=True)
class ChatOverhead:
    """Tokens a chat template adds around the text; see the module docstring for sources."""

    per_message: int
    per_name: int
    reply_priming: int
    per_tool_call: int
    per_tool: int
    tools_preamble: int


CHAT_OVERHEAD: Final[dict[str, ChatOverhead]] = {
    "openai": ChatOverhead(
        per_message=3, per_name=1, reply_priming=3, per_tool_call=3, per_tool=7, tools_preamble=12
    ),
    "llama": ChatOverhead(
        per_message=7, per_name=1, reply_priming=1, per_tool_call=3, per_tool=7, tools_preamble=12
    ),
    "generic": ChatOverhead(
        per_message=7, per_name=1, reply_priming=3, per_tool_call=3, per_tool=7, tools_preamble=12
    ),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps that keep a hostile body's accounting cost bounded (far above real requests)."""

    max_messages: int = 100_000
    max_content_parts: int = 100_000
    max_tool_calls: int = 10_000
    max_tools: int = 1_024
    max_prompts: int = 10_000


DEFAULT_LIMITS: Final = Limits()

ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TEXT_PART_FIELD: Final = {"text": "text", "refusal": "refusal"}
ATTACHMENT_PARTS: Final = frozenset({"image_url", "input_audio", "file"})
PART_TYPES: Final = "text, image_url, input_audio, file, refusal"


_JSON_TYPE_NAMES: Final[dict[type, str]] = {str: "string", list: "array", dict: "object"}


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _require_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedRequest(f"{where} must be a string, got {_type_name(value)}")
    return value


@dataclass(slots=True)
class PromptTexts:
    """A walked body: tokens known without the tokenizer, and the texts it has to count."""

    flat: int  # template overhead, attachments, client-tokenized prompts
    tally: TokenTally

    @property
    def chars(self) -> int:
        """Characters the tokenizer will read: what counting them costs."""
        return self.tally.chars

    def total(self) -> int:
        return self.flat + self.tally.total()


def count_prompt_tokens(
    body: dict[str, Any],
    tok: ModelTokenizer,
    *,
    image_tokens: int = DEFAULT_IMAGE_TOKENS,
    limits: Limits = DEFAULT_LIMITS,
) -> int:
    """Prompt tokens of a chat (``messages``) or completions (``prompt``) request body.

    Raises MalformedRequest when the body does not have the OpenAI shape; the message
    names the field (``messages[3].content must be a string or an array of content parts``).
    """
    walk = prompt_texts(body, tok, image_tokens=image_tokens, limits=limits)
    return run_through(walk).total()


def run_through(walk: Walk[_T]) -> _T:
    """A walk run to its end without pausing: its result."""
    try:
        while True:
            next(walk)
    except StopIteration as done:
        result: _T = done.value  # what the generator returned
        return result


def prompt_texts(
    body: dict[str, Any],
    tok: ModelTokenizer,
    *,
    image_tokens: int = DEFAULT_IMAGE_TOKENS,
    limits: Limits = DEFAULT_LIMITS,
) -> Walk[PromptTexts]:
    """The walk of ``count_prompt_tokens``, as a generator that pauses every ``WALK_STEP``
    items; its result holds the texts still to count. Raises MalformedRequest as it goes."""
    if not isinstance(body, dict):
        raise MalformedRequest(f"request body must be a JSON object, got {_type_name(body)}")
    tally = TokenTally(tok)
    if "messages" in body:
        flat = yield from _count_chat(body, tok, tally, image_tokens, limits)
    elif "prompt" in body:
        flat = yield from _count_completion(body, tally, limits)
    else:
        raise MalformedRequest("'messages' (chat) or 'prompt' (completions) is required")
    return PromptTexts(flat, tally)


def _count_chat(
    body: dict[str, Any], tok: ModelTokenizer, tally: TokenTally, image_tokens: int, limits: Limits
) -> Walk[int]:
    messages = body["messages"]
    if not isinstance(messages, list):
        raise MalformedRequest(f"messages must be an array, got {_type_name(messages)}")
    if not messages:
        raise MalformedRequest("messages must contain at least one message")
    if len(messages) > limits.max_messages:
        raise MalformedRequest(f"messages has {len(messages)} items; at most {limits.max_messages}")
    overhead = CHAT_OVERHEAD[tok.family]
    budget = _PartBudget(limits)
    total = overhead.reply_priming + overhead.per_message * len(messages)
    for i, message in enumerate(messages):
        if i % WALK_STEP == WALK_STEP - 1:
            yield
        if not isinstance(message, dict):
            raise MalformedRequest(f"messages[{i}] must be an object, got {_type_name(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise MalformedRequest(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}")
        tally.add(role)
        content = message.get("content")
        if isinstance(content, str):
            tally.add(content)
        elif isinstance(content, list):
            total += yield from _count_parts(content, f"messages[{i}]", tally, image_tokens, budget)
        elif content is not None or role != "assistant":
            # Only an assistant turn (one that calls tools) may have null content.
            raise MalformedRequest(
                f"messages[{i}].content must be a string or an array of content parts"
            )
        # Most messages are just role and content; only look for the rest when present.
        if len(message) > (2 if "content" in message else 1):
            total += yield from _count_message_extras(
                message, f"messages[{i}]", tally, overhead, budget
            )
    total += _count_tools(body, tally, overhead, limits)
    return total


def _count_message_extras(
    message: dict[str, Any],
    where: str,
    tally: TokenTally,
    overhead: ChatOverhead,
    budget: _PartBudget,
) -> Walk[int]:
    """Name, tool calls, legacy function call, tool call id and refusal of one message."""
    total = 0
    name = message.get("name")
    if name is not None:
        tally.add(_require_str(name, f"{where}.name"))
        total += overhead.per_name
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        total += yield from _count_tool_calls(tool_calls, where, tally, overhead, budget)
    function_call = message.get("function_call")
    if function_call is not None:
        _count_call(function_call, f"{where}.function_call", tally)
        total += overhead.per_tool_call
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None:
        tally.add(_require_str(tool_call_id, f"{where}.tool_call_id"))
    refusal = message.get("refusal")
    if refusal is not None:
        tally.add(_require_str(refusal, f"{where}.refusal"))
    return total


class _PartBudget:
    """Total content parts and tool calls seen so far across the whole request."""

    __slots__ = ("limits", "parts", "tool_calls")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.parts = 0
        self.tool_calls = 0

    def take_parts(self, n: int, where: str) -> None:
        self.parts += n
        if self.parts > self.limits.max_content_parts:
            raise MalformedRequest(
                f"{where}: request has more than {self.limits.max_content_parts} content parts"
            )

    def take_tool_calls(self, n: int, where: str) -> None:
        self.tool_calls += n
        if self.tool_calls > self.limits.max_tool_calls:
            raise MalformedRequest(
                f"{where}: request has more than {self.limits.max_tool_calls} tool calls"
            )


def _count_parts(
    parts: list[Any],
    where: str,
    tally: TokenTally,
    image_tokens: int,
    budget: _PartBudget,
) -> Walk[int]:
    """Adds the text parts to ``tally``; returns the flat cost of the attachments."""
    budget.take_parts(len(parts), f"{where}.content")
    total = 0
    for j, part in enumerate(parts):
        if j % WALK_STEP == WALK_STEP - 1:
            yield
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise MalformedRequest(f"{at} must be an object, got {_type_name(part)}")
        kind = part.get("type")
        field_name = TEXT_PART_FIELD.get(kind) if isinstance(kind, str) else None
        if field_name is not None:
            tally.add(_require_str(part.get(field_name), f"{at}.{field_name}"))
        elif kind in ATTACHMENT_PARTS:
            # Images cost a configured flat amount; audio and files are charged the same
            # flat amount (their real cost depends on decoding we do not do here).
            payload = part.get(kind)
            if not isinstance(payload, (dict, str)):
                raise MalformedRequest(f"{at}.{kind} must be an object")
            total += image_tokens
        else:
            raise MalformedRequest(f"{at}.type must be one of {PART_TYPES}")
    return total


def _count_call(call: object, where: str, tally: TokenTally) -> None:
    if not isinstance(call, dict):
        raise MalformedRequest(f"{where} must be an object, got {_type_name(call)}")
    tally.add(_require_str(call.get("name"), f"{where}.name"))
    tally.add(_require_str(call.get("arguments", ""), f"{where}.arguments"))


def _count_tool_calls(
    tool_calls: object,
    where: str,
    tally: TokenTally,
    overhead: ChatOverhead,
    budget: _PartBudget,
) -> Walk[int]:
    if not isinstance(tool_calls, list):
        raise MalformedRequest(f"{where}.tool_calls must be an array")
    budget.take_tool_calls(len(tool_calls), f"{where}.tool_calls")
    total = overhead.per_tool_call * len(tool_calls)
    for k, call in enumerate(tool_calls):
        if k % WALK_STEP == WALK_STEP - 1:
            yield
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise MalformedRequest(f"{at} must be an object, got {_type_name(call)}")
        _count_call(call.get("function"), f"{at}.function", tally)
        call_id = call.get("id")
        if call_id is not None:
            tally.add(_require_str(call_id, f"{at}.id"))
    return total


def _count_tools(
    body: dict[str, Any], tally: TokenTally, overhead: ChatOverhead, limits: Limits
) -> int:
    """Tool (``tools``) and legacy function (``functions``) definitions."""
    definitions: list[tuple[str, object]] = []
    for key, nested in (("tools", "function"), ("functions", None)):
        items = body.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise MalformedRequest(f"{key} must be an array, got {_type_name(items)}")
        if len(items) > limits.max_tools:
            raise MalformedRequest(f"{key} has {len(items)} items; at most {limits.max_tools}")
        for i, item in enumerate(items):
            where = f"{key}[{i}]"
            if not isinstance(item, dict):
                raise MalformedRequest(f"{where} must be an object, got {_type_name(item)}")
            if nested is not None:
                where = f"{where}.{nested}"
                item = item.get(nested)
                if not isinstance(item, dict):
                    raise MalformedRequest(f"{where} must be an object")
            _require_str(item.get("name"), f"{where}.name")
            definitions.append((where, item))
    if not definitions:
        return 0
    total = overhead.tools_preamble + overhead.per_tool * len(definitions)
    for where, definition in definitions:
        try:
            # orjson refuses nesting deeper than 254 levels instead of recursing without end.
            rendered = orjson.dumps(definition).decode()
        except (orjson.JSONEncodeError, TypeError) as exc:
            raise MalformedRequest(f"{where} cannot be rendered as JSON: {exc}") from None
        tally.add(rendered)
    return total


def _count_completion(body: dict[str, Any], tally: TokenTally, limits: Limits) -> Walk[int]:
    prompt = body["prompt"]
    total = 0
    if isinstance(prompt, str):
        tally.add(prompt)
    elif isinstance(prompt, list):
        total = yield from _count_prompt_array(prompt, tally, limits)
    else:
        raise MalformedRequest(
            "prompt must be a string, an array of strings, an array of tokens, "
            "or an array of token arrays"
        )
    suffix = body.get("suffix")
    if suffix is not None:
        tally.add(_require_str(suffix, "suffix"))
    return total


def _count_prompt_array(prompt: list[Any], tally: TokenTally, limits: Limits) -> Walk[int]:
    """Adds string prompts to ``tally``; returns the count of client-tokenized prompts."""
    if not prompt:
        return 0
    first = prompt[0]
    if isinstance(first, (str, list)) and len(prompt) > limits.max_prompts:
        raise MalformedRequest(f"prompt has {len(prompt)} prompts; at most {limits.max_prompts}")
    if isinstance(first, str):
        for i, item in enumerate(prompt):
            if i % WALK_STEP == WALK_STEP - 1:
                yield
            tally.add(_require_str(item, f"prompt[{i}]"))
        return 0
    if _is_token_id(first):
        yield from _check_token_ids(prompt, "prompt")
        return len(prompt)  # the client already tokenized; ids count one each
    if isinstance(first, list):
        total = 0
        for i, ids in enumerate(prompt):
            if i % WALK_STEP == WALK_STEP - 1:
                yield
            if not isinstance(ids, list):
                raise MalformedRequest(f"prompt[{i}] must be an array of integer token ids")
            yield from _check_token_ids(ids, f"prompt[{i}]")
            total += len(ids)
        return total
    raise MalformedRequest(
        "prompt[0] must be a string, an integer token id, or an array of token ids"
    )


def _check_token_ids(ids: list[Any], where: str) -> Walk[None]:
    for start in range(0, len(ids), ID_STEP):
        if start:
            yield
        for j, item in enumerate(ids[start : start + ID_STEP], start):
            if not _is_token_id(item):
                raise MalformedRequest(f"{where}[{j}] must be an integer token id")


def _is_token_id(value: object) -> bool:
    return type(value) is int and value >= 0
