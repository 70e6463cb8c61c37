"""Each RayService's serveConfigV2 is its config file verbatim (configs/gpu-llama.yaml, configs/gpu-tp2.yaml;
k8s/sync_serve_config.py keeps them so), and Ray Serve's own schema and the app's builder accept it. (Every file in configs/ is checked the same way in
tests/serving/test_app_config.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from inflight.serve_app.config import AppConfig
from tests.k8s.manifests import K8S_DIR, load_documents, manifest_files

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = K8S_DIR / "sync_serve_config.py"
CONFIG = ROOT / "configs" / "gpu-llama.yaml"


def serve_configs() -> list[tuple[str, str]]:
    return [(f"{path.name}:{doc['metadata']['name']}", doc["spec"]["serveConfigV2"]) for path in manifest_files()
            for doc in load_documents(path) if doc.get("kind") == "RayService"]


def test_there_is_a_serve_config():
    assert serve_configs()


@pytest.mark.parametrize("name, text", serve_configs(), ids=[n for n, _ in serve_configs()])
def test_serve_config_v2_validates_against_ray_serve_schema(name, text):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    assert schema.applications, name
    for app in schema.applications:
        assert app.import_path == "inflight.serve_app.app:build_app"
        AppConfig.model_validate(app.args)  # what build_app does first: names any bad argument


@pytest.mark.parametrize("manifest, config", [("rayservice.yaml", "gpu-llama.yaml"),
                                              ("rayservice-tp2.yaml", "gpu-tp2.yaml")])
def test_serve_config_v2_is_its_config_file(manifest, config):
    (name, text), = [(n, t) for n, t in serve_configs() if n.startswith(manifest + ":")]
    assert text == (ROOT / "configs" / config).read_text(), f"{name} drifted from {config}: run `make k8s-config`"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_sync_check_passes_on_the_repository():
    result = _run("--check")
    assert result.returncode == 0, result.stderr


def test_sync_check_fails_on_drift_and_sync_repairs_it(tmp_path):
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text((K8S_DIR / "rayservice.yaml").read_text().replace("max_replicas: 8", "max_replicas: 9"))
    result = _run("--check", "--config", str(CONFIG), "--manifest", str(manifest))
    assert result.returncode == 1 and "make k8s-config" in result.stderr, result
    assert _run("--config", str(CONFIG), "--manifest", str(manifest)).returncode == 0
    assert manifest.read_text() == (K8S_DIR / "rayservice.yaml").read_text()


@pytest.mark.parametrize("change, named", [
    ("import_path: inflight.serve_app.app:build_app", "import_path"),
    ("route_prefix: /", "route_prefix"),
])
def test_a_broken_serve_config_fails_ray_serve_schema(change, named):
    text = CONFIG.read_text().replace(change, change.split(":")[0] + ": [not, a, string]")
    with pytest.raises(ValueError, match=named):
        ServeDeploySchema.model_validate(yaml.safe_load(text))


def test_a_bad_app_argument_in_the_serve_config_is_named():
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    with pytest.raises(ValueError, match="num_gpus_per_replica"):
        AppConfig.model_validate({**args, "num_gpus_per_replica": "one"})
