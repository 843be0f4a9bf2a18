"""Regenerate kubernetes-definitions.json: the definitions the manifests in deploy/ use,
taken from a Kubernetes OpenAPI v2 document (swagger.json), descriptions dropped.

    cd tests/deploy/schemas && python extract.py swagger.json > kubernetes-definitions.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

# The kinds deploy/ may use: everything they reference comes along.
ROOTS = (
    "io.k8s.api.core.v1.Namespace",
    "io.k8s.api.core.v1.Secret",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.apps.v1.Deployment",
    "io.k8s.api.apps.v1.StatefulSet",
    "io.k8s.api.policy.v1.PodDisruptionBudget",
    "io.k8s.api.networking.v1.NetworkPolicy",
    "io.k8s.api.batch.v1.CronJob",
    "io.k8s.api.core.v1.PersistentVolumeClaim",
)


def _refs(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        out = [schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else []
        return out + [r for k, v in schema.items() if k != "$ref" for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


def _strip(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_strip(v) for v in schema]
    return schema


def main(path: str) -> None:
    with open(path) as f:
        definitions = json.load(f)["definitions"]
    seen: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _refs(definitions[name])
    subset = {name: _strip(definitions[name]) for name in sorted(seen)}
    json.dump({"definitions": subset}, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
