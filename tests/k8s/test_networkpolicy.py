"""k8s/networkpolicy.yaml fences Ray's ports: it selects the RayService's pods (head and workers), lets anyone
reach only the Serve port, and names who else may reach which of Ray's other ports (docs/security.md)."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import RAYSERVICES, break_path, manifest_errors, the

SERVE_PORT = 8000
RAY_PORTS = {6379: "GCS", 8265: "dashboard and jobs API", 10001: "Ray client", 8080: "metrics"}


def _pod_labels() -> list[dict[str, str]]:
    labels = []
    for name in RAYSERVICES:
        cluster = the("RayService", name)["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        labels += [t["metadata"]["labels"] for t in templates]
    return labels


def test_it_selects_every_ray_pod_of_the_service():
    selector = the("NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    for labels in _pod_labels():
        assert selector.items() <= labels.items(), f"{selector} does not select a pod labelled {labels}"


def _admitted_from_anywhere(policy: dict) -> set[int | None]:
    """Ports any peer may reach (None: every port): the rules without a `from`."""
    ports: set[int | None] = set()
    for rule in policy["spec"]["ingress"]:
        if not rule.get("from"):
            ports |= {p["port"] for p in rule.get("ports", [])} or {None}
    return ports


def test_only_the_serve_port_is_open_to_anyone():
    policy = the("NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert _admitted_from_anywhere(policy) == {SERVE_PORT}


def test_rays_own_ports_admit_named_peers_only():
    """Every rule reaching a Ray port (or every port) comes from the cluster's own pods or a named peer."""
    own = the("NetworkPolicy")["spec"]["podSelector"]
    for rule in the("NetworkPolicy")["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and not ports & set(RAY_PORTS):
            continue
        peers = rule.get("from")
        assert peers, f"a rule opens {ports or 'every port'} to anyone"
        for peer in peers:
            named = peer.get("podSelector") == own or peer.get("podSelector", {}).get("matchLabels") or \
                peer.get("namespaceSelector", {}).get("matchLabels")
            assert named, f"peer {peer} of ports {ports or 'all'} names nobody in particular"


def test_the_operator_can_still_deploy_the_serve_config():
    rules = the("NetworkPolicy")["spec"]["ingress"]
    operator = [r for r in rules if any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
                                        == "kuberay-operator" for p in r.get("from", []))]
    assert operator and {p["port"] for p in operator[0]["ports"]} == {8265}


@pytest.mark.parametrize("path, value, expected", [
    ("spec.policyTypes", ["ingress"], "'ingress' is not one of"),
    ("spec.ingres", [], "Additional properties are not allowed ('ingres'"),
    ("spec.ingress.1.ports.0.endPort", "9000", "'9000' is not of type 'integer'"),
    ("spec.ingress.0.from.0.podSelector.matchLabel", {"app": "inflight"}, "('matchLabel' was unexpected)"),
    ("spec.podSelector", None, "'podSelector' is a required property"),
])
def test_a_broken_network_policy_fails(path, value, expected):
    manifest = break_path(the("NetworkPolicy"), path, value)
    errors = manifest_errors(manifest)
    assert any(expected in line for line in errors), f"no error containing {expected!r}: {errors}"
