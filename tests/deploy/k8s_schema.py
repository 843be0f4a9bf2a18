"""A strict validator for Kubernetes objects against the vendored OpenAPI v2 definitions
(tests/deploy/schemas/, provenance in its README), offline."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).parent / "schemas" / "kubernetes-definitions.json"
DEFINITIONS: dict[str, Any] = json.loads(SCHEMAS.read_text())["definitions"]
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[munkMGTPE])?$")


def definition_of(obj: dict[str, Any]) -> str:
    group, _, version = obj["apiVersion"].rpartition("/")
    for name, schema in DEFINITIONS.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, obj["kind"]):
                return name
    raise AssertionError(f"no schema for {obj['apiVersion']} {obj['kind']}")


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Errors of ``value`` against a Kubernetes OpenAPI v2 schema: ``$ref``, ``type``,
    ``format`` (int-or-string, quantities), ``properties`` (unknown fields are errors, as
    with ``kubectl --validate=strict``), ``additionalProperties``, ``items``, ``required``
    and ``enum`` are what the definitions use."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        if name == "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
            ok = isinstance(value, str | int) and not isinstance(value, bool)
            return [] if ok else [f"{path}: {value!r} is not an int or a string"]
        if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
            ok = isinstance(value, int | float | str) and bool(_QUANTITY.match(str(value)))
            return [] if ok else [f"{path}: {value!r} is not a quantity"]
        return validate(value, DEFINITIONS[name], path)
    errors: list[str] = []
    kind = schema.get("type")
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": int | float,
    }
    if kind is not None and (
        not isinstance(value, types[kind]) or (isinstance(value, bool) and kind != "boolean")
    ):
        return [f"{path}: expected {kind}, got {type(value).__name__} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']}")
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                errors += validate(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(item, extra, f"{path}.{key}")
            elif properties is not None or extra is False:
                errors.append(f"{path}.{key}: unknown field")
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}.{key}: required")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors
