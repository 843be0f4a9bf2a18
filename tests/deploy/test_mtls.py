"""deploy/mtls/, the mutual-TLS Component: its Envoy bootstrap is the shipped one plus the
transport_socket the template renders, its two Secret files are the rendered ones, and all
pass ``envoy --mode validate`` with real certificates; its patches, applied to the base
Deployments, give valid objects whose flags, mounts and probes agree with each other (the
TLS path itself runs in tests/gateway/test_tls.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from stack.envoy import ProcessorTls, processor_secrets, processor_transport_socket, validate
from tests.deploy.certs import make_ca, make_leaf
from tests.deploy.conftest import DEPLOY, flag, k8s_object, load_yaml
from tests.deploy.test_manifests import DEFINITIONS
from tests.deploy.test_manifests import validate as validate_schema

MTLS = DEPLOY / "mtls"
ENVOY_TLS_DIR = "/etc/envoy/tls"
ENVOY_CONFIG_DIR = "/etc/envoy"  # the envoy-config ConfigMap's mount
TLS = ProcessorTls(
    ca_file=f"{ENVOY_TLS_DIR}/ca.crt",
    cert_file=f"{ENVOY_TLS_DIR}/tls.crt",
    key_file=f"{ENVOY_TLS_DIR}/tls.key",
    secrets_dir=ENVOY_CONFIG_DIR,
    server_name="extproc",
)


def _quota_cluster(doc: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "quota_extproc"]
    return cluster


def test_the_mtls_bootstrap_is_the_shipped_one_plus_the_rendered_transport_socket():
    variant = load_yaml(MTLS / "envoy.yaml")
    shipped = load_yaml(DEPLOY / "envoy" / "envoy.yaml")
    socket = _quota_cluster(variant).pop("transport_socket")
    assert variant == shipped
    assert socket == yaml.safe_load(processor_transport_socket(TLS))["transport_socket"]


def test_the_components_secret_files_are_the_rendered_ones_and_in_envoys_config_map():
    (generator,) = load_yaml(MTLS / "kustomization.yaml")["configMapGenerator"]
    for path, text in processor_secrets(TLS).items():
        name = Path(path).name
        assert Path(path).parent == Path(ENVOY_CONFIG_DIR) and name in generator["files"]
        assert (MTLS / name).read_text() == text


def test_the_mtls_bootstrap_passes_envoy_validate(tmp_path: Path):
    ca = make_ca(tmp_path, "ca")
    client = make_leaf(tmp_path, ca, "envoy", "DNS:envoy")
    files = {"ca.crt": ca[0], "tls.crt": client[0], "tls.key": client[1]}
    for name in ("envoy.yaml", *(Path(p).name for p in processor_secrets(TLS))):
        text = (MTLS / name).read_text()
        for cert, path in files.items():
            text = text.replace(f"{ENVOY_TLS_DIR}/{cert}", str(path))
        text = text.replace(ENVOY_TLS_DIR, str(tmp_path))  # the watched directory
        text = text.replace(f"{ENVOY_CONFIG_DIR}/", f"{tmp_path}/")
        (tmp_path / name).write_text(text)
    config = tmp_path / "envoy.yaml"
    result = validate(config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


_MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath",
               "ports": "containerPort"}  # fmt: skip


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """Kubernetes' strategic merge for what the patches touch: maps merge, lists of
    containers, volumes, mounts and ports merge by their key, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        merge_key = _MERGE_KEYS[key]
        out = list(base)
        for item in patch:
            same = [i for i, b in enumerate(out) if b.get(merge_key) == item.get(merge_key)]
            if same:
                out[same[0]] = strategic_merge(out[same[0]], item)
            else:
                out.append(item)
        return out
    return patch


def _component() -> dict[str, Any]:
    return load_yaml(MTLS / "kustomization.yaml")


def _patched(k8s_objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for entry in _component()["patches"]:
        patch = load_yaml(MTLS / entry["path"])
        if patch["kind"] == "Deployment" and patch["metadata"]["name"] == name:
            return strategic_merge(
                copy.deepcopy(k8s_object(k8s_objects, "Deployment", name)), patch
            )
    raise AssertionError(f"no patch for {name}")


def test_the_component_replaces_envoys_bootstrap_and_patches_both_deployments(k8s_objects):
    component = _component()
    assert component["kind"] == "Component"
    (generator,) = component["configMapGenerator"]
    assert generator["name"] == "envoy-config" and generator["behavior"] == "replace"
    assert generator["files"][0] == "envoy.yaml" and (MTLS / "envoy.yaml").is_file()
    kustomization = (DEPLOY / "kustomization.yaml").read_text()
    assert "# components: [mtls]" in kustomization  # documented, off by default
    for name in ("extproc", "envoy"):
        patched = _patched(k8s_objects, name)
        assert validate_schema(patched, DEFINITIONS["io.k8s.api.apps.v1.Deployment"]) == []


def test_the_patched_processor_serves_tls_from_its_secret_and_probes_the_health_port(
    k8s_objects,
):
    base = k8s_object(k8s_objects, "Deployment", "extproc")["spec"]["template"]["spec"]
    pod = _patched(k8s_objects, "extproc")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (base_c,) = base["containers"]
    assert c["args"][: len(base_c["args"])] == base_c["args"]  # nothing of the base dropped
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {
        "tls": "extproc-tls"
    }
    for option, name in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                         ("--tls-client-ca", "ca.crt")):  # fmt: skip
        assert flag(c["args"], option) == f"{mounts['tls']}/{name}"
    health = int(flag(c["args"], "--health-listen").rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health
        assert c[probe]["grpc"]["service"] == base_c[probe]["grpc"]["service"]
        assert c[probe]["periodSeconds"] == base_c[probe]["periodSeconds"]  # merged, not lost
    assert {p["containerPort"] for p in c["ports"]} >= {50051, 9464, health}
    envoy = _patched(k8s_objects, "envoy")["spec"]["template"]["spec"]
    (e,) = envoy["containers"]
    assert {m["mountPath"] for m in e["volumeMounts"]} >= {"/etc/envoy", ENVOY_TLS_DIR}
    assert any(v.get("secret", {}).get("secretName") == "envoy-extproc-client-tls"
               for v in envoy["volumes"])  # fmt: skip
