"""Tools as v0.10.2 takes them: a strict check of each function, then random calls.

The check is the real simulator's JSON schema for a function (name, description and
``parameters`` required; a parameter schema may only use ``type``, ``description``,
``enum``, ``properties``, ``items``, ``required``, ``additionalProperties``, ``minItems``
and ``maxItems``; arrays need ``items``, objects ``properties``), applied to the function as
its Go struct re-encodes it: a missing or empty ``parameters`` is missing, a missing
``description`` is "". Any other key, such as the ``title`` pydantic writes, is a 400.

Calls: with ``tool_choice`` "required" at least one, with a named function exactly that
one, otherwise (auto, or not given) between none and one per tool; each call picks a tool
at random (repeats allowed) and invents arguments that fit its schema. No calls at all
means a text answer. A call costs 3 tokens (name, id, type) plus its arguments' dummy
tokens; its arguments stream one dummy token per chunk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from llmsim.llmd import gojson
from llmsim.llmd.request import RequestError, ToolChoice, ToolSpec
from llmsim.llmd.tokenizer import split
from llmsim.settings import SimConfig

TOOL_ID_PREFIX = "chatcmpl-tool-"
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_PARAM_KEYS = frozenset(
    (
        "type",
        "description",
        "enum",
        "properties",
        "items",
        "required",
        "additionalProperties",
        "minItems",
        "maxItems",
    )
)
# llmsim's own words for string arguments (the real simulator has a list of its own).
STRING_ARGUMENTS = (
    "alpha",
    "hello",
    "Paris",
    "rainy",
    "humidity",
    "windy",
    "answer",
    "Horatio",
    "quiet",
    "season",
)


class ToolError(Exception):
    """Arguments cannot be made for a tool (the real one answers 500)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    id: str
    index: int
    argument_tokens: tuple[str, ...]

    @property
    def cost(self) -> int:
        return 3 + len(self.argument_tokens)


# --- validation ---------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return float(value).is_integer()


def _param_problem(schema: object, path: str) -> str | None:
    if not isinstance(schema, dict):
        return f"'{path}': expected object"
    extra = sorted(set(schema) - _PARAM_KEYS)
    if extra:
        return f"'{path}': additionalProperties {', '.join(repr(k) for k in extra)} not allowed"
    kind = schema.get("type")
    if kind is None:
        return f"'{path}': missing properties: 'type'"
    if kind not in _TYPES:
        return f"'{path}/type': value must be one of {', '.join(repr(t) for t in _TYPES)}"
    if "description" in schema and not isinstance(schema["description"], str):
        return f"'{path}/description': expected string"
    if "enum" in schema:
        enum = schema["enum"]
        if kind in ("null", "object", "array"):
            return f"'{path}': no enum allowed for type {kind}"
        fits = {
            "string": lambda v: isinstance(v, str),
            "number": _is_number,
            "integer": _is_integer,
            "boolean": lambda v: isinstance(v, bool),
        }[kind]
        if not isinstance(enum, list) or not all(fits(v) for v in enum):
            return f"'{path}/enum': every value must be of type {kind}"
    for key in ("minItems", "maxItems"):
        if key in schema and not (_is_integer(schema[key]) and schema[key] >= 0):
            return f"'{path}/{key}': expected a non-negative integer"
    if "additionalProperties" in schema and not isinstance(schema["additionalProperties"], bool):
        return f"'{path}/additionalProperties': expected boolean"
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        return f"'{path}/required': expected an array of strings"
    if kind == "array" and "items" not in schema:
        return f"'{path}': missing properties: 'items'"
    if kind == "object" and "properties" not in schema:
        return f"'{path}': missing properties: 'properties'"
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            return f"'{path}/properties': expected object"
        for name, sub in properties.items():
            problem = _param_problem(sub, f"{path}/properties/{name}")
            if problem:
                return problem
    items = schema.get("items")
    if items is not None:
        for i, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            problem = _param_problem(sub, f"{path}/items" + ("" if i is None else f"/{i}"))
            if problem:
                return problem
    return None


def validate_tools(tools: tuple[ToolSpec, ...] | None) -> None:
    for tool in tools or ():
        if not tool.parameters:  # omitempty: an empty map is not written either
            problem = "'': missing properties: 'parameters'"
        else:
            problem = _param_problem(tool.parameters, "/parameters")
        if problem:
            raise RequestError(400, f"Tool validation failed: jsonschema: {problem} (schema.json)")


# --- random calls ---------------------------------------------------------------------


def _required(schema: dict[str, Any]) -> set[str]:
    required = schema.get("required")
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _argument(schema: Any, cfg: SimConfig, rng: random.Random) -> Any:
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    kind = schema.get("type")
    if kind == "string":
        return rng.choice(STRING_ARGUMENTS)
    if kind == "integer":
        return rng.randint(cfg.min_tool_call_integer_param, cfg.max_tool_call_integer_param)
    if kind == "number":
        low, high = cfg.min_tool_call_number_param, cfg.max_tool_call_number_param
        return rng.random() * (high - low) + low
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            raise ToolError("array items given as a list are not supported")
        low = int(schema.get("minItems", cfg.min_tool_call_array_param_length))
        high = int(schema.get("maxItems", cfg.max_tool_call_array_param_length))
        if low > high:
            raise ToolError(f"minItems ({low}) is greater than maxItems({high})")
        return [_argument(items, cfg, rng) for _ in range(rng.randint(low, high))]
    if kind == "object":
        return _fields(schema, cfg.object_tool_call_not_required_field_probability, cfg, rng)
    raise ToolError(f"tool parameters of type {kind} are not supported")


def _fields(
    schema: dict[str, Any], optional_percent: int, cfg: SimConfig, rng: random.Random
) -> dict[str, Any]:
    properties = schema.get("properties")
    required = _required(schema)
    out: dict[str, Any] = {}
    for name, sub in properties.items() if isinstance(properties, dict) else ():
        if name not in required and not rng.random() < optional_percent / 100:
            continue
        out[name] = _argument(sub, cfg, rng)
    return out


def make_calls(
    tools: tuple[ToolSpec, ...],
    choice: ToolChoice,
    cfg: SimConfig,
    rng: random.Random,
) -> list[ToolCall] | None:
    """The calls of one answer, or None for a text answer; ToolError when args can't be made."""
    available = list(tools)
    minimum = 0
    if choice.mode == "function":
        named = [t for t in tools if t.name == choice.function]
        if not named:
            raise ToolError(
                f"tool with name '{choice.function}' requested in tool_choice but not found "
                "in the tools list"
            )
        available, minimum = named[:1], 1
    elif choice.mode == "required":
        minimum = 1
    if not available:
        raise ToolError("no tools available to create tool calls")
    count = minimum
    if len(available) > minimum:
        count = rng.randint(minimum, len(available))
    if count == 0:
        return None
    calls = []
    for index in range(count):
        tool = available[rng.randint(0, len(available) - 1)] if len(available) > 1 else available[0]
        params = tool.parameters or {}
        args = _fields(params, cfg.tool_call_not_required_param_probability, cfg, rng)
        text = gojson.dumps(args, sort_keys=True).decode()
        digits = "".join(str(rng.randint(0, 9)) for _ in range(10))
        calls.append(ToolCall(tool.name, text, TOOL_ID_PREFIX + digits, index, tuple(split(text))))
    return calls
