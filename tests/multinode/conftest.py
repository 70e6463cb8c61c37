"""Each test module here gets a multi-node Ray cluster of its own, shut down when the module ends."""

from __future__ import annotations

import os

os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray >= 2.59 turns token auth on for local clusters

import pytest

from tests.multinode.cluster import local_cluster


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_workers=2) as running:
        yield running
