"""Every manifest in k8s/ validates against its CRD's schema; broken ones do not (tests/k8s/manifests.py)."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import break_path, close_objects, file_errors, load_documents, manifest_errors, manifest_files, the


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates(path):
    errors = file_errors(path)
    assert not errors, "\n".join(errors)


def test_k8s_holds_the_expected_kinds():
    kinds = sorted(doc["kind"] for path in manifest_files() for doc in load_documents(path))
    assert kinds == ["NetworkPolicy", "PersistentVolumeClaim", "Pod", "PodMonitor", "RayService", "RayService"], kinds


WORKER = "spec.rayClusterConfig.workerGroupSpecs.0"
HEAD = "spec.rayClusterConfig.headGroupSpec"


@pytest.mark.parametrize("path, value, expected", [
    (f"{HEAD}.rayStartParams.num-cpus", 0, "num-cpus: 0 is not of type 'string'"),       # values must be strings
    (f"{WORKER}.rayStartParams.metrics-export-port", 8080, "is not of type 'string'"),
    (f"{WORKER}.groupName", None, "'groupName' is a required property"),
    (f"{WORKER}.maxReplicas", "eight", "'eight' is not of type 'integer'"),
    (f"{WORKER}.template.spec.containers.0.resources.limits.nvidia.com/gpu", "one", "does not match"),
    ("spec.rayClusterConfig.enableInTreeAutoscaling", "yes", "'yes' is not of type 'boolean'"),
    ("spec.serveConfigV2", {"applications": []}, "is not of type 'string'"),  # a mapping, not the YAML text
    ("spec.rayClusterConfig.workerGroupSpec", [], "Additional properties are not allowed ('workerGroupSpec'"),
    (f"{HEAD}.template.spec.containers.0.port", [], "Additional properties are not allowed ('port'"),
    ("spec.serveService.spec.ports.0.port", "8000", "'8000' is not of type 'integer'"),
    ("spec.rayClusterConfig.authOptions.mode", "password", "'password' is not one of"),
])
def test_broken_rayservice_fails(path, value, expected):
    if path.endswith("limits.nvidia.com/gpu"):  # the key holds dots: set it by hand
        manifest = the("RayService", "inflight")
        container = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        container["resources"]["limits"]["nvidia.com/gpu"] = value
    else:
        manifest = break_path(the("RayService", "inflight"), path, value)
    errors = manifest_errors(manifest)
    assert any(expected in line for line in errors), f"no error containing {expected!r}: {errors}"


def test_broken_podmonitor_pvc_and_pod_fail():
    monitor = the("PodMonitor")
    del monitor["spec"]["selector"]
    assert any("'selector' is a required property" in e for e in manifest_errors(monitor))
    monitor = the("PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    assert any("does not match" in e for e in manifest_errors(monitor))
    claim = the("PersistentVolumeClaim")
    claim["spec"]["accessModes"] = "ReadWriteMany"
    assert any("is not of type 'array'" in e for e in manifest_errors(claim))
    claim = the("PersistentVolumeClaim")
    del claim["metadata"]["name"]
    assert "metadata.name: required" in manifest_errors(claim)
    pod = the("Pod")
    pod["spec"]["containers"][0]["volumeMount"] = pod["spec"]["containers"][0].pop("volumeMounts")
    assert any("('volumeMount' was unexpected)" in e for e in manifest_errors(pod))


@pytest.mark.parametrize("text, expected", [
    ("apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: x}\nspec:\n  rayClusterConfig: [\n", "not YAML"),
    ("apiVersion: ray.io/v1alpha1\nkind: RayService\nmetadata: {name: x}\nspec: {}\n", "no schema for"),
    ("apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: x}\nspec: {}\n",
     "'rayClusterConfig' is a required property"),
    ("apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: x}\nstatus: {}\nspec:\n"
     "  rayClusterConfig: {headGroupSpec: {template: {}}}\n", "unknown top-level field 'status'"),
    ("", "no manifest in it"),
])
def test_a_broken_manifest_file_fails(tmp_path, text, expected):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    errors = file_errors(path)
    assert any(expected in line for line in errors), errors


def test_closing_objects_keeps_maps_and_preserved_fields_open():
    schema = close_objects({"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "raw": {"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True},
        "typed": {"type": "object", "properties": {"a": {}}}}})
    assert schema["additionalProperties"] is False
    assert schema["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in schema["properties"]["raw"]
    assert schema["properties"]["typed"]["additionalProperties"] is False
