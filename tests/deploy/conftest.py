"""Loaders for the files in deploy/: the compose file, the Kubernetes objects (as kustomize
would assemble them), the Envoy bootstrap and the quota file."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadlab.gateway import Envoy, Processor, wait_until
from loadlab.procs import free_ports
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from stack.envoy import EnvoyPorts

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PRO_KEY = "sk-demo-pro"  # the demo key whose digest deploy/extproc/quota.yaml lists


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


def k8s_object_any(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The one workload (Deployment, StatefulSet, CronJob) called ``name``."""
    kinds = ("Deployment", "StatefulSet", "CronJob")
    found = [o for o in objects if o["kind"] in kinds and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{name}: {len(found)} workloads"
    return found[0]


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every Deployment, StatefulSet and CronJob."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]
        elif obj["kind"] == "CronJob":
            yield obj["metadata"]["name"], obj["spec"]["jobTemplate"]["spec"]["template"]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, container) of every container in the manifests."""
    for name, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            yield name, container


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


@dataclass
class Deployed:
    envoy: Envoy
    processors: list[Processor]
    sim: Simulator

    @property
    def base_url(self) -> str:
        return self.envoy.base_url


def loopback_bootstrap(ports: EnvoyPorts, processors: list[int], backend: int) -> str:
    doc = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = ports.admin
    listener = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    listener.update(address="127.0.0.1", port_value=ports.listen)
    endpoints = {"quota_extproc": processors, "llm_backends": [backend]}
    for cluster in doc["static_resources"]["clusters"]:
        assert cluster["type"] == "STRICT_DNS"  # resolved like the service names would be
        hosts = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in endpoints[cluster["name"]]
        ]
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": hosts}]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="session")
def deployed(tmp_path_factory, redis_server: RedisServer) -> Iterator[Deployed]:
    """deploy/envoy/envoy.yaml (only its addresses moved to free loopback ports, STRICT_DNS
    kept), two processors on deploy/extproc/quota.yaml sharing one real redis-server, and
    llmsim on deploy/llm-sim/fast.yaml. What containers add (images, DNS names) is not
    exercised; everything the files say is."""
    log_dir = tmp_path_factory.mktemp("deployed")
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/7"  # a db of its own: the demo tenants
    started: list = []
    try:
        sim = Simulator(DEPLOY / "llm-sim" / "fast.yaml", log_dir=log_dir)
        started.append(sim)
        with pytest.MonkeyPatch.context() as env:  # the variable the Secret provides
            env.setenv("UPSTREAM_API_KEY", "the-simulator-checks-no-key")
            processors = [
                Processor.start(DEPLOY / "extproc" / "quota.yaml", log_dir, redis_url)
                for _ in range(2)
            ]
        started += processors
        ports = EnvoyPorts(*free_ports(2))
        config = log_dir / "envoy.yaml"
        config.write_text(loopback_bootstrap(ports, [p.port for p in processors], sim.port))
        envoy = Envoy.launch(config, ports, log_dir / "envoy.log")
        started.append(envoy)
        for p in processors:
            assert wait_until(lambda p=p: envoy.processor_health(p.port) == "healthy", 30)
        yield Deployed(envoy, processors, sim)
    finally:
        for part in reversed(started):
            part.stop()
