"""Loaders for the files in deploy/: the compose file, the Kubernetes objects (as kustomize
would assemble them), the Envoy bootstrap and the quota file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "docker-compose.yaml")


@pytest.fixture(scope="session")
def kustomization() -> dict[str, Any]:
    return load_yaml(DEPLOY / "kustomization.yaml")


@pytest.fixture(scope="session")
def k8s_objects(kustomization) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        out += [doc for doc in yaml.safe_load_all((DEPLOY / resource).read_text()) if doc]
    return out


def k8s_object(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(Deployment name, container) of every container in the manifests."""
    for obj in objects:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                yield obj["metadata"]["name"], container


def container(objects: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    pod = k8s_object(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    (only,) = pod["containers"]
    return only


@pytest.fixture(scope="session")
def bootstrap() -> dict[str, Any]:
    return load_yaml(DEPLOY / "envoy" / "envoy.yaml")


def cluster_endpoints(bootstrap: dict[str, Any], name: str) -> list[tuple[str, int]]:
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == name]
    return [
        (sa["address"], sa["port_value"])
        for group in cluster["load_assignment"]["endpoints"]
        for ep in group["lb_endpoints"]
        for sa in [ep["endpoint"]["address"]["socket_address"]]
    ]


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` in an argument list."""
    assert name in argv, f"{name} not in {argv}"
    return argv[argv.index(name) + 1]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
