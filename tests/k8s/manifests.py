"""Validating Kubernetes manifests offline: each kind against the schema its API server would use.

Schemas are the CRDs' own openAPIV3Schema, copied into tests/data/ (see SOURCES.yaml there). The API
server rejects unknown fields (kubectl's default field validation is strict), but a CRD schema only
lists the known ones; so every object schema that names its properties is closed here
(``additionalProperties: false``) unless it says ``x-kubernetes-preserve-unknown-fields``. A misspelt
key then fails the way ``kubectl apply`` fails instead of being dropped.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "k8s"
DATA = ROOT / "tests" / "data"


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects with listed properties admit no others (as the API server)."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and not closed.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed


@functools.cache
def _schema(name: str) -> dict[str, Any]:
    return close_objects(json.loads((DATA / name).read_text()))


def rayservice_schema() -> dict[str, Any]:
    return _schema("kuberay/rayservice_v1.json")


def worker_pod_spec_schema() -> dict[str, Any]:
    spec = rayservice_schema()["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    return spec["workerGroupSpecs"]["items"]["properties"]["template"]["properties"]["spec"]


def pod_schema() -> dict[str, Any]:
    """A Pod's metadata + spec: KubeRay's worker pod template is core/v1's PodTemplateSpec."""
    cluster = rayservice_schema()["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    return cluster["workerGroupSpecs"]["items"]["properties"]["template"]


def pvc_schema() -> dict[str, Any]:
    """A PersistentVolumeClaim's metadata + spec: KubeRay's pod template embeds core/v1's as an ephemeral volume."""
    volumes = worker_pod_spec_schema()["properties"]["volumes"]["items"]["properties"]
    return volumes["ephemeral"]["properties"]["volumeClaimTemplate"]


def network_policy_schema() -> dict[str, Any]:
    """networking.k8s.io/v1 NetworkPolicy (metadata + spec), assembled from the parts KubeRay 1.7's CRD embeds:
    its ``networkPolicy`` rules are networking/v1's NetworkPolicyIngressRule and EgressRule, its peers' selectors
    meta/v1's LabelSelector, and a pod template's metadata the ObjectMeta every object has."""
    cluster = rayservice_schema()["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    head = cluster["networkPolicy"]["properties"]["head"]["properties"]
    ingress_rule, egress_rule = head["ingressRules"]["items"], head["egressRules"]["items"]
    label_selector = ingress_rule["properties"]["from"]["items"]["properties"]["podSelector"]
    spec = {"type": "object", "required": ["podSelector"], "additionalProperties": False, "properties": {
        "podSelector": label_selector,
        "policyTypes": {"type": "array", "items": {"type": "string", "enum": ["Ingress", "Egress"]}},
        "ingress": {"type": "array", "items": ingress_rule},
        "egress": {"type": "array", "items": egress_rule}}}
    return {"type": "object", "additionalProperties": False, "required": ["spec"],
            "properties": {"metadata": pod_schema()["properties"]["metadata"], "spec": spec}}


# (apiVersion, kind) -> its schema.
KINDS = {
    ("ray.io/v1", "RayService"): lambda: rayservice_schema(),
    ("v1", "PersistentVolumeClaim"): lambda: pvc_schema(),
    ("v1", "Pod"): lambda: pod_schema(),
    ("networking.k8s.io/v1", "NetworkPolicy"): lambda: network_policy_schema(),
    ("monitoring.coreos.com/v1", "PodMonitor"): lambda: _schema("prometheus-operator/podmonitor_v1_subset.json"),
}
TOP_LEVEL = {"apiVersion", "kind", "metadata", "spec"}


def manifest_errors(manifest: Any) -> list[str]:
    """Why the API server would refuse ``manifest``: one line per problem, empty when it validates."""
    if not isinstance(manifest, dict):
        return [f"<root>: a manifest is a mapping, got {type(manifest).__name__}"]
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    if key not in KINDS:
        return [f"<root>: no schema for apiVersion/kind {key}; known: {sorted(KINDS)}"]
    errors = [f"<root>: unknown top-level field {name!r}" for name in sorted(set(manifest) - TOP_LEVEL)]
    name = (manifest.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        errors.append("metadata.name: required")
    schema = KINDS[key]()
    # Core kinds are checked through the parts KubeRay embeds (metadata + spec); apiVersion/kind were matched above.
    core = key[0] in ("v1", "networking.k8s.io/v1")
    document = manifest if not core else {k: v for k, v in manifest.items() if k in ("metadata", "spec")}
    for error in sorted(Draft7Validator(schema).iter_errors(document), key=lambda e: list(e.absolute_path)):
        errors.append(f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}")
    return errors


def load_documents(path: Path) -> list[Any]:
    """Every YAML document in ``path`` (``---``-separated), empty ones skipped."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def file_errors(path: Path) -> list[str]:
    try:
        documents = load_documents(path)
    except yaml.YAMLError as e:
        return [f"{path.name}: not YAML: {e}"]
    if not documents:
        return [f"{path.name}: no manifest in it"]
    return [f"{path.name}[{i}] {line}" for i, doc in enumerate(documents) for line in manifest_errors(doc)]


def manifest_files() -> list[Path]:
    return sorted(K8S_DIR.glob("*.yaml")) + sorted(K8S_DIR.glob("*.yml"))


RAYSERVICES = ("inflight", "inflight-tp2")  # k8s/rayservice.yaml, k8s/rayservice-tp2.yaml


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (named ``name``, where there are several) in k8s/ (a deep copy: tests may break
    it)."""
    found = [doc for path in manifest_files() for doc in load_documents(path)
             if doc.get("kind") == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in k8s/, found {len(found)}"
    return copy.deepcopy(found[0])


def break_path(manifest: dict, path: str, value) -> dict:
    """Set (or with ``value`` None, delete) the dotted ``path``; numbers index lists."""
    *parents, last = path.split(".")
    node = manifest
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is None:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return manifest
