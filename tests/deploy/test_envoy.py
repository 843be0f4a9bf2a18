"""The container deployment's Envoy bootstrap passes `envoy --mode validate` and is the
shipped template (envoy_config/envoy.yaml.tmpl, as stack/envoy.py renders it) except for
addresses: listener bind address, cluster discovery type and endpoints."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from stack.envoy import EnvoyPorts, render_bootstrap, validate
from tests.deploy.conftest import DEPLOY

ENVOY_CONFIGS = sorted((DEPLOY / "envoy").glob("*.yaml"))


@pytest.mark.parametrize("path", ENVOY_CONFIGS, ids=lambda p: p.name)
def test_deploy_envoy_config_passes_envoy_validate(path: Path):
    result = validate(path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"configuration '{path}' OK" in result.stdout + result.stderr


def _addressless(doc: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap with what a deployment must choose itself taken out."""
    doc = copy.deepcopy(doc)
    for listener in doc["static_resources"]["listeners"]:
        listener["address"]["socket_address"].pop("address")
    for cluster in doc["static_resources"]["clusters"]:
        for key in ("type", "dns_lookup_family"):
            cluster.pop(key, None)
        cluster["load_assignment"]["endpoints"] = "<endpoints>"
    return doc


def test_deploy_bootstrap_is_the_template_but_for_addresses(bootstrap, tmp_path):
    ports = EnvoyPorts(
        listen=bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"][
            "port_value"
        ],
        admin=bootstrap["admin"]["address"]["socket_address"]["port_value"],
    )
    template = yaml.safe_load(render_bootstrap(ports, [50051], [8000]))
    assert _addressless(bootstrap) == _addressless(template)
    # What differs is what the header comment says, and only that.
    assert bootstrap["admin"] == template["admin"]  # admin stays on loopback
    for cluster in bootstrap["static_resources"]["clusters"]:
        assert cluster["type"] == "STRICT_DNS"
        assert cluster["dns_lookup_family"] == "V4_ONLY"
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["address"] == "0.0.0.0"


def test_the_comparison_sees_a_changed_filter(bootstrap):
    """The check above is not vacuous: one processing-mode field changed is a difference."""
    changed = copy.deepcopy(bootstrap)
    hcm = changed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    ext_proc = hcm["typed_config"]["http_filters"][0]["typed_config"]["extension_config"]
    ext_proc["typed_config"]["processing_mode"]["response_trailer_mode"] = "SKIP"
    assert _addressless(changed) != _addressless(bootstrap)
