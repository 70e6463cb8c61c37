"""The multi-node tests share one Ray cluster (a head and two worker nodes), shut down after the last of them.

Starting it takes ~20 s of the suite's time, so it is started once for the package; each module deploys its app
and deletes it at its end, and a test that removes a worker node adds one back."""

from __future__ import annotations

import os

os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray >= 2.59 turns token auth on for local clusters

import pytest

from tests.multinode.cluster import local_cluster


@pytest.fixture(scope="package")
def cluster():
    with local_cluster(num_workers=2) as running:
        yield running
