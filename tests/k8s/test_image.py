"""One Ray version everywhere: the image's base (k8s/Dockerfile), the RayService's rayVersion, the pin in
pyproject.toml and the Ray these tests run. Ray refuses to join nodes of different versions."""

from __future__ import annotations

import re
from pathlib import Path

import ray

from tests.k8s.manifests import RAYSERVICES, the

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "k8s" / "Dockerfile"


def _pinned_ray() -> str:
    (version,) = re.findall(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    return version


def test_one_ray_version_everywhere():
    (base,) = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    image, _, tag = base.partition(":")
    assert image == "rayproject/ray" and re.fullmatch(r"[0-9.]+-py311-gpu", tag), base  # Ray's CUDA image, Python 3.11
    versions = {"Dockerfile": tag.split("-")[0], "pyproject.toml": _pinned_ray(), "installed": ray.__version__,
                **{f"rayVersion of {name}": the("RayService", name)["spec"]["rayClusterConfig"]["rayVersion"]
                   for name in RAYSERVICES}}
    assert len(set(versions.values())) == 1, versions


def test_image_installs_the_project_with_its_gpu_extras_and_every_pod_runs_it():
    text = DOCKERFILE.read_text()
    assert re.search(r'pip install [^\n]*"\.\[[^\]]*\bgpu\b[^\]]*\]"', text), "the GPU extras (triton, flash-attn)"
    for package in ("inflight", "engine", "kernels", "serve_app"):  # (inflight/ and the folders it maps)
        assert re.search(rf"^COPY .*\b{package}\b", text, flags=re.MULTILINE), package
    for name in RAYSERVICES:
        cluster = the("RayService", name)["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        images = {c["image"] for t in templates for c in t["spec"]["containers"]}
        assert len(images) == 1, f"{name}: head and workers must run the same image: {images}"


def test_image_starts_ray_with_the_serve_settings_make_run_uses():
    from inflight.serve_app.ray_env import SERVE_ENV

    text = DOCKERFILE.read_text().replace("\\\n", " ")  # continuation lines joined
    env_lines = re.findall(r"^ENV\s+(.*)$", text, flags=re.MULTILINE)
    env = dict(re.findall(r"\b(RAY_[A-Z_]+)=(\S+)", " ".join(env_lines)))
    assert env == SERVE_ENV, env
    assert "RAY_AUTH_MODE" not in DOCKERFILE.read_text(), "token auth is a cluster's own decision, not the image's"
