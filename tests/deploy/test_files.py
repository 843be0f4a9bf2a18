"""deploy/ without a Docker engine or a cluster: every file parses, every file and name it
refers to exists, images are pinned, ports agree with the Envoy bootstrap and the processor's
configuration, and the Dockerfile installs what the README documents."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib

import pytest
import yaml
from setuptools import find_packages

import extproc
from extproc.config import load_config
from stack.envoy import envoy_binary
from tests.deploy.conftest import (
    DEPLOY,
    ROOT,
    cluster_endpoints,
    container,
    containers,
    flag,
    k8s_object,
    k8s_object_any,
    load_yaml,
    pod_templates,
    port_of,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = extproc.__version__  # the one version source (pyproject reads it)
LAB = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
EXACT_TAG = re.compile(r"^v?\d+\.\d+\.\d+(-[a-z0-9.-]+)?$")

# Every YAML key llm-d-inference-sim v0.10.2 reads (pkg/common/config.go, its `yaml:` tags).
_REAL_SIM_KEYS = """block-size data-parallel-rank data-parallel-size dataset-in-memory dataset-path
    dataset-table-name dataset-url default-embedding-dimensions ec-transfer-config enable-kvcache
    enable-prefix-caching enable-request-id-headers enable-sleep-mode enforce-eager
    event-batch-size failure-injection-rate failure-types fake-metrics
    fake-metrics-refresh-interval force-dummy-tokenizer global-cache-hit-threshold hash-seed
    image-emission-rate inter-token-latency inter-token-latency-std-dev kv-cache-size
    kv-cache-transfer-latency kv-cache-transfer-latency-std-dev kv-cache-transfer-time-per-token
    kv-cache-transfer-time-std-dev latency-calculator log-http lora-modules max-cpu-loras
    max-loras max-model-len max-num-seqs max-request-body-size-mb
    max-tool-call-array-param-length max-tool-call-integer-param max-tool-call-number-param
    max-waiting-queue-length min-tool-call-array-param-length min-tool-call-integer-param
    min-tool-call-number-param mm-encoder-only mm-processor-kwargs mm-render-timeout mode model
    object-tool-call-not-required-field-probability omni port prefill-overhead
    prefill-time-per-token prefill-time-std-dev render-timeout render-url seed
    self-signed-certs served-model-name ssl-certfile ssl-keyfile startup-duration
    time-factor-under-load time-to-first-token time-to-first-token-std-dev
    time-to-generate-image time-to-generate-image-std-dev
    tool-call-not-required-param-probability use-vllm-map-event-format zmq-endpoint"""
REAL_SIM_KEYS = set(_REAL_SIM_KEYS.split())


def all_images(compose, k8s_objects) -> dict[str, str]:
    """Where each image is used -> image reference."""
    images = {f"compose:{n}": s["image"] for n, s in compose["services"].items()}
    images |= {f"k8s:{d}/{c['name']}": c["image"] for d, c in containers(k8s_objects)}
    (base,) = re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    images["Dockerfile"] = base
    return images


def test_every_deploy_file_parses():
    parsed = 0
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix in (".yaml", ".yml"):
            docs = list(yaml.safe_load_all(path.read_text()))
            assert docs and all(isinstance(d, dict) for d in docs if d is not None), path
            parsed += 1
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
            parsed += 1
    assert parsed >= 12


def test_every_image_is_pinned_to_an_exact_version(compose, k8s_objects):
    for where, image in all_images(compose, k8s_objects).items():
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and EXACT_TAG.match(tag.split("-slim")[0]), f"{where}: {image} not pinned"


def test_images_are_the_versions_the_tests_run(compose, k8s_objects):
    images = set(all_images(compose, k8s_objects).values())
    envoy = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True)
    (version,) = re.findall(r"/(1\.40\.\d+)/", envoy.stdout)
    assert f"envoyproxy/envoy:v{version}" in images
    assert {i for i in images if i.startswith("envoyproxy/")} == {f"envoyproxy/envoy:v{version}"}
    assert {i for i in images if i.startswith("redis:")} == {"redis:7.0.15"}
    assert {i for i in images if "llm-d-inference-sim" in i} == {
        "ghcr.io/llm-d/llm-d-inference-sim:v0.10.2"
    }
    assert {i for i in images if "token-quota-extproc" in i} == {f"token-quota-extproc:{VERSION}"}
    assert compose["services"]["extproc"]["build"]["dockerfile"] == "Dockerfile"
    assert f'org.opencontainers.image.version="{VERSION}"' in (ROOT / "Dockerfile").read_text()


def test_one_version_source_and_everything_that_names_a_version_agrees():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "extproc.__version__"}
    assert LAB["project"]["version"] == VERSION
    assert f"token-quota-extproc=={VERSION}" in LAB["project"]["dependencies"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert set(re.findall(r"token-quota-extproc:([\w.]+)", dockerfile)) == {VERSION}
    assert f"## [{VERSION}]" in (ROOT / "CHANGELOG.md").read_text()


def test_every_file_compose_mounts_or_builds_exists(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            if ":" not in volume:
                continue  # an anonymous volume (redis's data): nothing to find here
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), f"{name}: {source}"
        if "build" in service:
            context = DEPLOY / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file()
        for dep in service.get("depends_on", {}):
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        (c["dns_sd_configs"][0]["names"][0] if "dns_sd_configs" in c else None)
        for c in prometheus["scrape_configs"]
    }
    assert "extproc" in targets


def test_every_file_and_name_the_kustomization_refers_to_exists(kustomization, k8s_objects):
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    generated = set()
    for gen in kustomization["configMapGenerator"]:
        for entry in gen["files"]:
            assert (DEPLOY / entry.split("=", 1)[1]).is_file(), entry
        generated.add(gen["name"])
    secrets = {
        o["metadata"]["name"]: set(o.get("stringData", {})) | set(o.get("data", {}))
        for o in k8s_objects
        if o["kind"] == "Secret"
    }
    generated_secrets = {g["name"] for g in kustomization.get("secretGenerator", [])}
    for gen in kustomization.get("secretGenerator", []):
        for entry in gen["files"]:
            assert (DEPLOY / entry.split("=", 1)[1]).is_file(), entry
    claims = {o["metadata"]["name"] for o in k8s_objects if o["kind"] == "PersistentVolumeClaim"}
    templates = dict(pod_templates(k8s_objects))
    for workload, c in containers(k8s_objects):
        pod = templates[workload]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for claim in (
            k8s_object_any(k8s_objects, workload).get("spec", {}).get("volumeClaimTemplates", [])
        ):
            volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": "template"}
        for mount in c.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                assert volume["configMap"]["name"] in generated, workload
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in secrets or name in generated_secrets, workload
            if isinstance(volume.get("persistentVolumeClaim"), dict):
                assert volume["persistentVolumeClaim"]["claimName"] in claims, workload
        for env in c.get("env", []):
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]], env
    for obj in k8s_objects:
        if obj["kind"] in ("Service", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [
                name for name, template in templates.items()
                if selector.items() <= template["metadata"]["labels"].items()
            ]  # fmt: skip
            assert matched, f"{obj['kind']}/{obj['metadata']['name']} selects no workload"


def test_processor_ports_match_the_bootstrap_and_its_config(bootstrap, compose, k8s_objects):
    ((host, port),) = cluster_endpoints(bootstrap, "quota_extproc")
    assert host == "extproc"
    config = load_yaml(DEPLOY / "extproc" / "quota.yaml")
    assert port_of(config["listen"]) == port
    service = compose["services"][host]
    assert port_of(flag(service["command"], "--listen")) == port
    assert str(port) in service["expose"]
    assert "127.0.0.1:50051" in " ".join(service["healthcheck"]["test"])
    assert flag(service["command"], "--config") == "/etc/extproc/quota.yaml"
    assert any(v.endswith(":/etc/extproc/quota.yaml:ro") for v in service["volumes"])
    metrics_port = port_of(flag(service["command"], "--metrics-listen"))
    # Kubernetes: the headless Service named like the cluster's host, onto the --listen port.
    svc = k8s_object(k8s_objects, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"  # every pod its own endpoint
    c = container(k8s_objects, "extproc")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    by_target = {p["targetPort"]: p["port"] for p in svc["spec"]["ports"]}
    assert named["grpc"] == by_target["grpc"] == port == port_of(flag(c["args"], "--listen"))
    assert named["metrics"] == by_target["metrics"] == metrics_port
    assert port_of(flag(c["args"], "--metrics-listen")) == metrics_port
    annotations = k8s_object(k8s_objects, "Deployment", "extproc")["spec"]["template"]["metadata"]
    assert annotations["annotations"]["prometheus.io/port"] == str(metrics_port)
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/etc/extproc" in mounts and flag(c["args"], "--config") == "/etc/extproc/quota.yaml"
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "extproc"]
    assert job["dns_sd_configs"][0]["port"] == metrics_port


def test_model_server_ports_match_the_bootstrap_and_the_profile(bootstrap, compose, k8s_objects):
    ((host, port),) = cluster_endpoints(bootstrap, "llm_backends")
    assert host == "llm-sim"
    profile = load_yaml(DEPLOY / "llm-sim" / "fast.yaml")
    assert profile["port"] == port
    service = compose["services"][host]
    assert str(port) in service["expose"]
    assert flag(service["command"], "--config") == "/etc/llm-sim/fast.yaml"
    svc = k8s_object(k8s_objects, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"
    c = container(k8s_objects, host)
    assert c["ports"][0]["containerPort"] == svc["spec"]["ports"][0]["port"] == port
    assert flag(c["args"], "--config") == "/etc/llm-sim/fast.yaml"
    for argv in (service["command"], c["args"]):
        flags = {a[2:] for a in argv if a.startswith("--")}
        assert flags - {"config"} <= REAL_SIM_KEYS, flags  # every flag is also a YAML key


def test_envoy_listener_and_config_path_match(bootstrap, compose, k8s_objects):
    (listener,) = bootstrap["static_resources"]["listeners"]
    port = listener["address"]["socket_address"]["port_value"]
    service = compose["services"]["envoy"]
    assert service["ports"] == [f"{port}:{port}"]
    assert flag(service["command"], "-c") == "/etc/envoy/envoy.yaml"
    assert service["volumes"] == ["./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro"]
    c = container(k8s_objects, "envoy")
    assert c["ports"][0]["containerPort"] == port
    assert flag(c["args"], "-c") == "/etc/envoy/envoy.yaml"
    assert k8s_object(k8s_objects, "Service", "envoy")["spec"]["ports"][0]["port"] == port


def test_the_deployed_profile_is_the_repositorys_fast_profile():
    deployed = DEPLOY / "llm-sim" / "fast.yaml"
    assert deployed.read_bytes() == (ROOT / "simulator_profiles" / "fast.yaml").read_bytes()


@pytest.mark.parametrize(
    "profile", sorted(p.name for p in (ROOT / "simulator_profiles").glob("*.yaml"))
)
def test_profile_keys_are_the_real_simulators_or_ext_extensions(profile):
    doc = load_yaml(ROOT / "simulator_profiles" / profile)
    unknown = {k for k in doc if k not in REAL_SIM_KEYS and not k.startswith("ext-")}
    assert not unknown, f"the real simulator does not read {sorted(unknown)}"


def test_termination_grace_covers_drain_and_shutdown(compose, k8s_objects, monkeypatch):
    monkeypatch.setenv("UPSTREAM_API_KEY", "k")
    config = load_config(DEPLOY / "extproc" / "quota.yaml")
    needed = config.drain_delay_s + config.shutdown_grace_s
    pod = k8s_object(k8s_objects, "Deployment", "extproc")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > needed
    stop = compose["services"]["extproc"]["stop_grace_period"]
    assert stop.endswith("s") and int(stop[:-1]) > needed


def test_probes_are_grpc_health_checks_of_the_processor(bootstrap, k8s_objects):
    (cluster,) = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "quota_extproc"
    ]
    service_name = cluster["health_checks"][0]["grpc_health_check"]["service_name"]
    assert service_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    c = container(k8s_objects, "extproc")
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": service_name}
    assert c["startupProbe"]["grpc"] == {"port": 50051, "service": service_name}
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    for name in ("extproc", "envoy"):
        pdb = k8s_object(k8s_objects, "PodDisruptionBudget", name)
        replicas = k8s_object(k8s_objects, "Deployment", name)["spec"]["replicas"]
        assert pdb["spec"]["maxUnavailable"] < replicas


def test_secrets_reach_the_processor_the_way_the_loader_reads_them(compose, k8s_objects):
    quota = load_yaml(DEPLOY / "extproc" / "quota.yaml")
    key_envs = {m["upstream_api_key_env"] for m in quota["models"].values()}
    c = container(k8s_objects, "extproc")
    from_secret = {e["name"] for e in c["env"] if "secretKeyRef" in e["valueFrom"]}
    assert key_envs | {"REDIS_URL"} <= from_secret
    assert flag(c["args"], "--redis-url") == "$(REDIS_URL)"  # expanded by the kubelet
    assert key_envs <= set(compose["services"]["extproc"]["environment"])


def test_processors_run_as_non_root(k8s_objects):
    dockerfile = (ROOT / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    uid = int(user.split(":")[0])
    assert uid != 0
    pod = k8s_object(k8s_objects, "Deployment", "extproc")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid


OTEL_PROTO_REPAIR = "$(pip freeze | grep '^opentelemetry-proto==')"


def _pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` in shell text (line continuations joined)."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in re.split(r"&&|;", line):
            words = shlex.split(part, comments=True)
            if "install" in words and any(w.rsplit("/", 1)[-1] == "pip" for w in words):
                out.append(words[words.index("install") + 1 :])
    return out


def _targets(args: list[str]) -> list[str]:
    return [a for a in args if not a.startswith("-")]


def test_dockerfile_installs_what_the_readme_documents():
    """What "the same steps" means: the same Python minor as pyproject's requires-python, and `pip
    install .` of the same pyproject, in the Dockerfile as in both READMEs; scripts/setup.sh
    (the README's set-up command) installs that package too, editable and with the test
    extras on top, and the lab's (lab/pyproject.toml) beside it."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+python:(3\.\d+)\.\d+-slim", dockerfile, re.M)
    assert f">={base}" in PYPROJECT["project"]["requires-python"]
    install, *repairs = _pip_installs(
        "\n".join(re.findall(r"^RUN ((?:.*\\\n)*.*)", dockerfile, re.M))
    )
    assert _targets(install) == ["."]
    # Then only the documented repair of opentelemetry-proto's modules (README "Deploying").
    assert [_targets(r) for r in repairs] == [[OTEL_PROTO_REPAIR]]
    assert all({"--force-reinstall", "--no-deps"} <= set(r) for r in repairs)
    assert f'"{OTEL_PROTO_REPAIR}"' in (ROOT / "README.md").read_text()
    for readme in (ROOT / "README.md", DEPLOY / "README.md"):
        text = readme.read_text()
        assert "pip install ." in text, readme
        assert f"Python {base}" in text, readme
    setup, *repairs = _pip_installs((ROOT / "scripts" / "setup.sh").read_text())
    assert [t.split("[")[0] for t in _targets(setup)] == [".", "./lab"]  # + the lab's
    assert len(repairs) == 1 and _targets(repairs[0])[0].endswith(OTEL_PROTO_REPAIR[7:])
    # The image holds the processor's package alone: no tests, simulator or load tools
    # (tests/deploy/test_docker_context.py checks the build context itself).
    copied = {c.split()[0] for c in re.findall(r"^COPY\s+(.*)$", dockerfile, re.M)}
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert "extproc" in copied and not copied & {"tests", "llmsim", "loadlab", "stack"}
    installed = find_packages(str(ROOT), include=list(find["include"]))
    assert installed and not [p for p in installed if p.split(".")[0] == "tests"]
    (entry,) = re.findall(r'^ENTRYPOINT \["(\w+)"\]', dockerfile, re.M)
    assert entry in PYPROJECT["project"]["scripts"]
