"""The Kubernetes manifests, offline: every object validates against the Kubernetes API
schemas (tests/deploy/schemas/, vendored from the 1.36 OpenAPI document), and the
NetworkPolicies leave no Service open: each Service's pods are selected by a policy that
names the peers allowed on each of its ports, behind a default deny; and behind a default
deny of egress each workload may send to the cluster's DNS and to exactly the Services its
configuration names (Envoy's clusters, the Redis URLs), on their ports."""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.conftest import DEPLOY, flag, k8s_object, load_yaml, pod_templates
from tests.deploy.k8s_schema import DEFINITIONS, definition_of, validate


def test_every_manifest_validates_against_the_kubernetes_schemas(k8s_objects):
    kinds = set()
    for obj in k8s_objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        errors = validate(obj, DEFINITIONS[definition_of(obj)], name)
        assert not errors, "\n".join(errors)
        kinds.add(obj["kind"])
    assert {"Deployment", "StatefulSet", "CronJob", "Service", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize(
    "break_it",
    [
        lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=1),
        lambda o: o["spec"]["template"]["spec"].update(securityContex={}),  # a typo
        lambda o: o["spec"].pop("selector"),
        lambda o: o["spec"]["template"]["spec"]["containers"][0].update(
            resources={"limits": {"memory": "1 GB"}}
        ),
    ],
    ids=["wrong type", "unknown field", "required field", "bad quantity"],
)
def test_the_validator_rejects_a_broken_manifest(k8s_objects, break_it):
    (deployment,) = [
        copy.deepcopy(o)
        for o in k8s_objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "extproc"
    ]
    assert validate(deployment, DEFINITIONS[definition_of(deployment)]) == []
    break_it(deployment)
    assert validate(deployment, DEFINITIONS[definition_of(deployment)])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a set of labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]:
            return False
    return True


def _policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _container_port(templates: dict[str, dict], pods: list[str], target: Any) -> int:
    """A Service's targetPort (a name or a number) as the number the pods listen on."""
    if isinstance(target, int):
        return target
    for pod in pods:
        for c in templates[pod]["spec"]["containers"]:
            for p in c.get("ports", []):
                if p.get("name") == target:
                    return int(p["containerPort"])
    raise AssertionError(f"no container port named {target}")


def test_ingress_is_denied_by_default(k8s_objects):
    deny = [
        p
        for p in _policies(k8s_objects)
        if p["spec"]["podSelector"] == {}
        and "Ingress" in p["spec"]["policyTypes"]
        and not p["spec"].get("ingress")
    ]
    assert deny, "no default-deny ingress policy"


def test_every_service_is_covered_by_a_policy_naming_its_peers(k8s_objects):
    templates = dict(pod_templates(k8s_objects))
    labels = {name: t["metadata"]["labels"] for name, t in templates.items()}
    services = [o for o in k8s_objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"envoy", "extproc", "llm-sim", "redis"}
    allowed: dict[str, dict[int, list[dict]]] = {}
    for service in services:
        name = service["metadata"]["name"]
        pods = [
            p
            for p, lab in labels.items()
            if selects({"matchLabels": service["spec"]["selector"]}, lab)
        ]
        assert pods, f"Service {name} selects no pods"
        policies = [
            p
            for p in _policies(k8s_objects)
            if any(selects(p["spec"]["podSelector"], labels[x]) for x in pods)
        ]
        named = [p for p in policies if p["spec"]["podSelector"]]  # not only the default deny
        assert named, f"Service {name}: no policy selects its pods {pods}"
        for port in service["spec"]["ports"]:
            number = _container_port(templates, pods, port.get("targetPort", port["port"]))
            peers = [
                peer
                for policy in named
                for rule in policy["spec"].get("ingress", [])
                if any(
                    p.get("port") in (number, port.get("targetPort")) for p in rule.get("ports", [])
                )
                for peer in rule.get("from", [])
            ]
            # Every allowing rule names its peers (a rule without `from` admits anyone).
            open_rules = [
                rule
                for policy in named
                for rule in policy["spec"].get("ingress", [])
                if not rule.get("from")
                and (not rule.get("ports") or any(p.get("port") == number for p in rule["ports"]))
            ]
            assert peers and not open_rules, f"Service {name} port {number}: peers {peers}"
            allowed.setdefault(name, {})[number] = peers

    def pod_peers(peers: list[dict]) -> set[str]:
        """The workloads of deploy/ a list of peers admits (in-namespace pod selectors)."""
        return {
            w
            for peer in peers
            if "podSelector" in peer and "namespaceSelector" not in peer
            for w, lab in labels.items()
            if selects(peer["podSelector"], lab)
        }

    # What each port admits, by workload: the who-talks-to-whom.
    assert pod_peers(allowed["llm-sim"][8000]) == {"envoy"}
    assert pod_peers(allowed["extproc"][50051]) == {"envoy"}
    assert pod_peers(allowed["redis"][6379]) == {"extproc", "ledger-export"}
    # Metrics: only the scraper, a Prometheus pod in the monitoring namespace.
    (scraper,) = allowed["extproc"][9464]
    assert scraper["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
    }
    assert scraper["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    # The entry point is open to clients by name (an ipBlock), and to nothing else in-cluster.
    assert allowed["envoy"][10000] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]


def test_the_coverage_check_sees_an_open_port(k8s_objects):
    """Not vacuous: a policy that lets anyone reach Redis fails the check above."""
    opened = copy.deepcopy(k8s_objects)
    for obj in opened:
        if obj["kind"] == "NetworkPolicy" and obj["metadata"]["name"].startswith("redis-"):
            obj["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 6379}]})
    with pytest.raises(AssertionError, match="Service redis port 6379"):
        test_every_service_is_covered_by_a_policy_naming_its_peers(opened)


KUBE_DNS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}


def _egress_policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in _policies(objects) if "Egress" in p["spec"]["policyTypes"]]


def test_egress_is_denied_by_default(k8s_objects):
    deny = [
        p
        for p in _egress_policies(k8s_objects)
        if p["spec"]["podSelector"] == {} and not p["spec"].get("egress")
    ]
    assert deny, "no default-deny egress policy"


def egress_allowed(objects: list[dict[str, Any]]) -> dict[str, set[tuple[str, int]]]:
    """What each workload may send to, as (peer, port): a peer is the workloads of deploy/
    a pod selector admits, ``dns`` (the cluster DNS) or ``anywhere`` (a rule with no
    ``to``, an ipBlock, another namespace); port 0 is every port."""
    labels = {name: t["metadata"]["labels"] for name, t in pod_templates(objects)}

    def peer_name(peer: dict[str, Any] | None) -> str:
        if peer == KUBE_DNS:
            return "dns"
        if peer is None or set(peer) != {"podSelector"}:
            return "anywhere"
        return ",".join(sorted(w for w, lab in labels.items() if selects(peer["podSelector"], lab)))

    out: dict[str, set[tuple[str, int]]] = {w: set() for w in labels}
    for policy in _egress_policies(objects):
        for workload, lab in labels.items():
            if not selects(policy["spec"]["podSelector"], lab):
                continue
            for rule in policy["spec"].get("egress", []):
                ports = [p["port"] for p in rule.get("ports", [])] or [0]
                for peer in rule.get("to") or [None]:
                    out[workload] |= {(peer_name(peer), port) for port in ports}
    return out


def configured_destinations(objects: list[dict[str, Any]]) -> dict[str, set[tuple[str, int]]]:
    """(workload, container port) each workload's configuration sends to, by Service name."""
    templates = dict(pod_templates(objects))
    labels = {name: t["metadata"]["labels"] for name, t in templates.items()}

    def service_target(host: str, port: int) -> tuple[str, int]:
        service = k8s_object(objects, "Service", host.split(".", 1)[0])
        (pod,) = [
            p
            for p, lab in labels.items()
            if selects({"matchLabels": service["spec"]["selector"]}, lab)
        ]
        (entry,) = [e for e in service["spec"]["ports"] if e["port"] == port]
        return pod, _container_port(templates, [pod], entry.get("targetPort", port))

    envoy = load_yaml(DEPLOY / "envoy" / "envoy.yaml")
    envoy_to = set()
    for cluster in envoy["static_resources"]["clusters"]:
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                address = endpoint["endpoint"]["address"]["socket_address"]
                envoy_to.add(service_target(address["address"], address["port_value"]))

    def redis_of(url: str) -> tuple[str, int]:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        return service_target(parts.hostname, parts.port)

    processor_url = k8s_object(objects, "Secret", "extproc-secrets")["stringData"]["REDIS_URL"]
    (export,) = templates["ledger-export"]["spec"]["containers"]
    return {
        "envoy": envoy_to,
        "extproc": {redis_of(processor_url)},
        "ledger-export": {redis_of(flag(export["args"], "--redis-url"))},
    }


def test_each_workload_may_send_only_to_dns_and_what_its_configuration_names(k8s_objects):
    allowed = egress_allowed(k8s_objects)
    configured = configured_destinations(k8s_objects)
    assert configured["envoy"] == {("extproc", 50051), ("llm-sim", 8000)}
    assert configured["extproc"] == configured["ledger-export"] == {("redis", 6379)}
    for workload, peers in allowed.items():
        assert peers == {("dns", 53)} | configured.get(workload, set()), workload


def test_the_egress_check_sees_an_open_destination(k8s_objects):
    """Not vacuous: a rule letting the processors send anywhere fails the check above."""
    opened = copy.deepcopy(k8s_objects)
    for obj in opened:
        if obj["kind"] == "NetworkPolicy" and obj["metadata"]["name"].endswith("-to-redis"):
            obj["spec"]["egress"].append({"ports": [{"protocol": "TCP", "port": 443}]})
    with pytest.raises(AssertionError, match="extproc"):
        test_each_workload_may_send_only_to_dns_and_what_its_configuration_names(opened)


def test_redis_persists_to_an_append_only_file_on_a_volume(compose, k8s_objects):
    """Compose and Kubernetes both run AOF with a one-second fsync, in a directory on a
    volume (tests/deploy/test_redis_aof.py kills the Kubernetes one under load)."""
    argv = compose["services"]["redis"]["command"]
    assert flag(argv, "--appendonly") == "yes" and flag(argv, "--appendfsync") == "everysec"
    assert flag(argv, "--dir") in compose["services"]["redis"]["volumes"]
    redis = k8s_object(k8s_objects, "StatefulSet", "redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert flag(c["args"], "--appendonly") == "yes"
    assert flag(c["args"], "--appendfsync") == "everysec"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag(c["args"], "--dir")
    assert flag(c["args"], "--aclfile").startswith(mounts["acl"] + "/")
