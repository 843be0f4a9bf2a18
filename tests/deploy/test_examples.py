"""A newcomer's first ten minutes: examples/first-tenant.yaml loads on its own,
examples/envoy-processor.yaml validates when dropped into a minimal bootstrap (the real
Envoy binary) and is the shipped bootstrap's processor configuration, and both run a
streamed request end to end."""

from __future__ import annotations

import copy
import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from extproc.config import load_config
from loadlab.gateway import Envoy, Processor
from loadlab.procs import free_ports
from loadlab.simulator import Simulator
from stack.envoy import EnvoyPorts, ProcessorHealthCheck, render_bootstrap, validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FIRST = EXAMPLES / "first-tenant.yaml"
SNIPPET = EXAMPLES / "envoy-processor.yaml"
DEMO_KEY = "sk-team-a-demo"  # the key the first config's comment names
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"  # noqa: E501


def test_the_first_config_is_short_and_loads_on_its_own() -> None:
    assert len(FIRST.read_text().splitlines()) <= 20
    config = load_config(FIRST)  # what check-config and serve load
    (tenant,) = config.tenants.values()
    assert tenant.key_sha256 == (hashlib.sha256(DEMO_KEY.encode()).hexdigest(),)
    (plan,) = yaml.safe_load(FIRST.read_text())["plans"].values()
    assert plan["limits"]["*"]["tpm"] > 0


def minimal_bootstrap(snippet: dict[str, Any], ports: EnvoyPorts, backend: int) -> dict:
    """The smallest bootstrap a user might have (a listener routing everything to one
    model server), with the snippet's five pieces put where its comments say."""
    hcm: dict[str, Any] = {
        "@type": HCM,
        "stat_prefix": "ingress",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "my_llm"}}],
                }
            ]
        },
        "http_filters": [],
    }
    hcm |= snippet["http_connection_manager"]
    hcm["http_filters"] = snippet["http_filters"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"] |= snippet["route"]
    listener = {
        "name": "ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": ports.listen}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    } | snippet["listener"]
    endpoint = {
        "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": backend}}}
    }
    mine = {
        "name": "my_llm",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "my_llm", "endpoints": [{"lb_endpoints": [endpoint]}]},
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": ports.admin}}
        },
        "static_resources": {"listeners": [listener], "clusters": [mine, *snippet["clusters"]]},
    }


def snippet() -> dict[str, Any]:
    return yaml.safe_load(SNIPPET.read_text())


def with_processor_port(doc: dict[str, Any], port: int) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    (cluster,) = [c for c in doc["clusters"] if c["name"] == "quota_extproc"]
    (group,) = cluster["load_assignment"]["endpoints"]
    group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] = port
    return doc


def test_the_envoy_snippet_validates_in_a_minimal_bootstrap(tmp_path: Path) -> None:
    ports = EnvoyPorts(listen=10000, admin=9901)  # validate mode binds nothing
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(minimal_bootstrap(snippet(), ports, 8000)))
    done = validate(path)
    assert done.returncode == 0, done.stdout + done.stderr
    # The check reads every field: one misspelt in the snippet fails it.
    broken = snippet()
    outlier = broken["clusters"][0]["outlier_detection"]
    outlier["consecutive_local_origin_failures"] = outlier.pop("consecutive_local_origin_failure")
    path.write_text(yaml.safe_dump(minimal_bootstrap(broken, ports, 8000)))
    failed = validate(path)
    assert failed.returncode != 0 and "consecutive_local_origin_failures" in failed.stderr + (
        failed.stdout
    )


def test_the_snippet_is_the_shipped_bootstraps_processor_configuration() -> None:
    shipped = yaml.safe_load(
        render_bootstrap(EnvoyPorts(10000, 9901), [50051], [8000], 1114112, ProcessorHealthCheck())
    )
    mine = snippet()
    (cluster,) = [
        c for c in shipped["static_resources"]["clusters"] if c["name"] == "quota_extproc"
    ]
    assert mine["clusters"] == [cluster]
    listener = shipped["static_resources"]["listeners"][0]
    assert (
        mine["listener"]["per_connection_buffer_limit_bytes"]
        == (listener["per_connection_buffer_limit_bytes"])
    )
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for key, value in mine["http_connection_manager"].items():
        assert hcm[key] == value, key
    ext_proc = hcm["http_filters"][0]["typed_config"]["extension_config"]["typed_config"]
    assert mine["http_filters"][0]["typed_config"] == ext_proc
    assert mine["http_filters"][-1] == hcm["http_filters"][-1]  # the router, last
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert {k: route[k] for k in mine["route"]} == mine["route"]


@pytest.mark.slow
def test_the_first_tenant_streams_through_the_snippet(tmp_path: Path) -> None:
    """The two example files together, as a user would run them: llmsim as the model server,
    the processor on the first config, Envoy on the minimal bootstrap with the snippet."""
    sim = Simulator("fast.yaml", log_dir=tmp_path)
    processor = envoy = None
    try:
        processor = Processor.start(FIRST, tmp_path, drain_delay_s=0.0)
        ports = EnvoyPorts(*free_ports(2))
        path = tmp_path / "envoy.yaml"
        doc = minimal_bootstrap(with_processor_port(snippet(), processor.port), ports, sim.port)
        path.write_text(yaml.safe_dump(doc))
        envoy = Envoy.launch(path, ports, tmp_path / "envoy.log")
        client = openai.OpenAI(base_url=f"{envoy.base_url}/v1", api_key=DEMO_KEY, max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=10,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        request = urllib.request.Request(
            f"{envoy.base_url}/v1/chat/completions",
            data=json.dumps({"model": "gpt-4.1", "messages": []}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer sk-other"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401
        assert json.loads(refused.value.read())["error"]["message"]
        assert processor.metrics()["extproc_requests_admitted_total"] == 1
    finally:
        for part in (envoy, processor, sim):
            if part is not None:
                part.stop()
