import hashlib
import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray >= 2.59 turns token auth on for local clusters
from inflight.serve_app import ray_env  # noqa: E402

ray_env.apply()  # the Serve settings `make run` and the image use, before any test starts Ray

import pytest
import torch

# The Ray cluster and demo app that tests/serving and tests/security share (one session cluster for both).
pytest_plugins = ["tests.serving.fixtures"]

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on a CPU; it must be chosen before Triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: the test models are tiny, and with 2 threads OpenMP spin-waits make every step
# ~50x slower as soon as anything else (a benchmark, a second pytest) competes for the 2 cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch, **make_checkpoint_kwargs) -> Path``: each distinct checkpoint is written once per session."""
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    cache = {}

    def get(arch: str, **kwargs):
        key = (arch, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in cache:
            name = "-".join([arch, *(f"{k}{v}" for k, v in key[1])]).replace("/", "_").replace(".", "_")
            name = name if len(name) <= 80 else f"{name[:60]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
            cache[key] = make_checkpoint(root / f"{len(cache)}-{name}", arch, **kwargs)
        return cache[key]

    return get


# Test tiers: `make test` runs everything; `make test-fast` (-m "not server and not slow") the unit tiers. A test
# under these folders starts a Ray cluster or an HTTP server (tests/serving/fixtures.py): marked `server` here,
# by place, so that a new test there needs no marker of its own. Slow ones elsewhere say `slow` themselves.
SERVER_FOLDERS = ("serving", "multinode", "security")


def pytest_collection_modifyitems(config, items):
    tests_dir = os.path.dirname(__file__)
    for item in items:
        parts = os.path.relpath(str(item.path), tests_dir).split(os.sep)
        if parts[0] in SERVER_FOLDERS:
            item.add_marker(pytest.mark.server)
