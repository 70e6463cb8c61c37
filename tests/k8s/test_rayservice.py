"""What the RayService must say beyond its schema: the head takes no work, GPUs come from pod limits, the Serve
config matches the worker pods, the weights are where the config looks, and metrics are scraped."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jsonschema import Draft7Validator

from inflight.serve_app.config import AppConfig
from tests.k8s.manifests import the, worker_pod_spec_schema

RAYSERVICE = Path(__file__).resolve().parents[2] / "k8s" / "rayservice.yaml"


@pytest.fixture
def rayservice() -> dict:
    return the("RayService", "inflight")


def _cluster(rayservice) -> dict:
    return rayservice["spec"]["rayClusterConfig"]


def _app_args(rayservice) -> dict:
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app["args"]


def _gpu_groups(rayservice) -> list[dict]:
    return [g for g in _cluster(rayservice)["workerGroupSpecs"]
            if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"].get("limits", {})]


def _ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0].get("ports", [])}


def test_head_takes_no_work_and_exposes_dashboard_and_metrics(rayservice):
    head = _cluster(rayservice)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "replicas and routers must not land on the head"
    assert {"dashboard": 8265, "metrics": 8080}.items() <= _ports(head["template"]).items()
    assert head["rayStartParams"]["metrics-export-port"] == str(_ports(head["template"])["metrics"])
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    # The routers need a CPU of their own, or they would fit on the 0-CPU head.
    assert AppConfig.model_validate(_app_args(rayservice)).router_num_cpus > 0
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True


def test_gpu_worker_group_fits_the_serve_config(rayservice):
    (group,) = _gpu_groups(rayservice)
    config = AppConfig.model_validate(_app_args(rayservice))
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus, cpus = int(limits["nvidia.com/gpu"]), float(limits["cpu"])
    assert config.num_gpus_per_replica <= gpus and config.num_cpus_per_replica + config.router_num_cpus <= cpus
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # Enough GPU pods for the most replicas the autoscaler may ask for, each replica on its own GPU(s).
    replicas_per_pod = int(gpus // config.num_gpus_per_replica)
    assert group["maxReplicas"] * replicas_per_pod >= config.autoscaling_config["max_replicas"]
    assert group["minReplicas"] * replicas_per_pod >= config.autoscaling_config["min_replicas"]
    assert all(isinstance(v, str) for g in [_cluster(rayservice)["headGroupSpec"], group]
               for v in g["rayStartParams"].values())


def test_autoscaling_and_upgrades_are_on(rayservice):
    assert _cluster(rayservice)["enableInTreeAutoscaling"] is True
    # KubeRay v1.7's RayServiceUpgradeType values (ray-operator/apis/ray/v1/rayservice_types.go); the CRD
    # schema types the field as a plain string, so a misspelling would pass it.
    assert rayservice["spec"]["upgradeStrategy"]["type"] in {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
    assert rayservice["spec"]["upgradeStrategy"]["type"] == "NewCluster"


def test_weights_come_from_the_pvc_where_the_config_looks(rayservice):
    (group,) = _gpu_groups(rayservice)
    spec = group["template"]["spec"]
    model = Path(_app_args(rayservice)["model"])
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (name,) = [n for n, m in mounts.items() if model.is_relative_to(m["mountPath"])]
    assert mounts[name].get("readOnly") is True
    assert volumes[name]["persistentVolumeClaim"]["claimName"] == the("PersistentVolumeClaim")["metadata"]["name"]


def test_commented_download_alternative_is_a_valid_init_container(rayservice):
    """Uncommented, the Hugging Face init container is a valid pod-spec entry that fills the models mount."""
    lines = RAYSERVICE.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.strip() == "# initContainers:"]
    column = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.startswith(" " * column + "#"):
            break
        block.append(line[column + 2:])  # drop "# "
    snippet = yaml.safe_load("\n".join(block))
    assert list(snippet) == ["initContainers"], snippet
    init_containers_schema = worker_pod_spec_schema()["properties"]["initContainers"]
    errors = list(Draft7Validator(init_containers_schema).iter_errors(snippet["initContainers"]))
    assert not errors, [e.message for e in errors]
    (container,) = snippet["initContainers"]
    model = _app_args(rayservice)["model"]
    assert model in " ".join(container["command"]), "the download writes where the config looks"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {str(Path(model).parent)}


def test_podmonitor_scrapes_every_ray_pod_on_its_metrics_port(rayservice):
    monitor = the("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = _cluster(rayservice)
    for template in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        assert selector.items() <= template["metadata"]["labels"].items(), template["metadata"]
        assert _ports(template)[endpoint["port"]] == 8080
    for group in cluster["workerGroupSpecs"]:
        assert group["rayStartParams"]["metrics-export-port"] == "8080"


def test_serve_service_is_port_8000(rayservice):
    ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in ports] == [(8000, 8000)]
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"] == 8000


def test_models_loader_fills_the_pvc_where_the_config_looks(rayservice):
    pod = the("Pod")["spec"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == the("PersistentVolumeClaim")["metadata"]["name"]
    (container,) = pod["containers"]
    model = _app_args(rayservice)["model"]
    assert f"local_dir='{model}'" in " ".join(container["command"])
    assert [m["mountPath"] for m in container["volumeMounts"]] == [str(Path(model).parent)]


def test_pods_outlive_the_apps_drain(rayservice):
    """A stopping pod's replicas have drain_timeout_s to finish or hand over their requests, and its routers a
    minute more for their streams: Kubernetes must not kill the pod before (terminationGracePeriodSeconds)."""
    from inflight.serve_app.app import ROUTER_DRAIN_EXTRA_S

    drain = AppConfig.model_validate(_app_args(rayservice)).drain_timeout_s
    cluster = _cluster(rayservice)
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        assert template["spec"]["terminationGracePeriodSeconds"] > drain + ROUTER_DRAIN_EXTRA_S


def test_the_tensor_parallel_service_fits_a_replicas_ranks_on_one_pod():
    """k8s/rayservice-tp2.yaml: a replica's placement group (a bundle of a GPU per rank, STRICT_PACK) and a router fit
    on one worker pod, whose Ray CPUs and GPUs are its limits; shared memory is a memory volume; the autoscaler may
    add a pod per replica."""
    service = the("RayService", "inflight-tp2")
    config = AppConfig.model_validate(_app_args(service))
    placement = config.placement()
    assert placement["placement_group_strategy"] == "STRICT_PACK"
    bundles = placement["placement_group_bundles"]
    assert len(bundles) == config.engine_args["tensor_parallel_size"] == 2
    (group,) = _cluster(service)["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    limits = container["resources"]["limits"]
    assert sum(b["CPU"] for b in bundles) + config.router_num_cpus <= float(limits["cpu"])
    assert all(b["GPU"] == 1 for b in bundles) and sum(b["GPU"] for b in bundles) == int(limits["nvidia.com/gpu"])
    assert group["maxReplicas"] == config.autoscaling_config["max_replicas"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (dshm,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert mounts["dshm"] == "/dev/shm" and dshm["emptyDir"]["medium"] == "Memory"
    assert _gpu_groups(service) == [group]
