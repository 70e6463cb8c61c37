"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), with Serve on a port of its own.

Nodes are separate raylets (their own worker processes), so replicas on a removed node die as they would
on a lost machine. Worker nodes offer ``REPLICA_SLOT``, one unit each, and the test apps' replicas require
one: at most one replica per worker node, never one on the head. The head offers ``HEAD_SLOT``, which the
router requires, so losing a worker node never takes the router with it.

Nothing here touches another Ray on this machine: the cluster picks its own GCS port, Serve listens on
``HTTP_PORT`` (not 8000), and the Ray address file that ``Cluster`` overwrites (``ray start``'s record of
the current cluster) is put back afterwards.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from tests.serving.helpers import port_free

HOST = "127.0.0.1"
HTTP_PORT = 8123
HTTP_BASE = f"http://{HOST}:{HTTP_PORT}"
HEAD_SLOT = "inflight_test_head"
REPLICA_SLOT = "inflight_test_replica_slot"
NODE_CPUS = 1  # logical: a replica takes 0.5, so a node's CPU never stops a replica from fitting

# Serve's metric pushes default to every 10 s; the autoscaling test needs to see load within a second or two.
# Read by replicas and routers when they start, so they are set before the nodes start and inherited.
FAST_AUTOSCALING_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
# A worker node killed without notice is declared dead after period x threshold (default 3 s x 5).
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}

# What the test apps share: demo-tiny, four batch slots (so modest load queues), one replica per worker node.
REPLICA_ARGS: dict[str, Any] = {
    "model": "demo-tiny",
    "engine_args": {"max_model_len": 2048, "max_num_seqs": 4, "num_threads": 1},
    "num_cpus_per_replica": 0.5,
    "replica_resources": {REPLICA_SLOT: 1},
    "router_resources": {HEAD_SLOT: 0.01},
    "max_pending_requests": 128,
    "max_queued_requests_per_replica": 64,
    "routing_policy": "least_loaded",
    "routing_stats_period_s": 0.2,
    # Deadlines far off: the engine refuses (429) a request whose predicted first token misses its deadline,
    # and these tests load replicas on purpose; what they check is where requests go, not that refusal.
    "default_timeout_s": 300,
}


class LocalCluster:
    """The running cluster: its head, its worker nodes (``ray._private.node.Node``), add and remove."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    @property
    def workers(self) -> list:
        return sorted(self.cluster.worker_nodes, key=lambda node: node.node_id)

    def worker_node_ids(self) -> set[str]:
        return {node.node_id for node in self.cluster.worker_nodes}

    def head_node_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_worker(self):
        node = self.cluster.add_node(num_cpus=NODE_CPUS, resources={REPLICA_SLOT: 1})
        self.cluster.wait_for_nodes()
        return node

    def remove_worker(self, node_id: str, graceful: bool = False) -> None:
        """Kill a worker node's raylet and every process on it (``graceful=False``: as a crashed machine)."""
        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=graceful)


@contextmanager
def local_cluster(num_workers: int = 2) -> Iterator[LocalCluster]:
    """Head + ``num_workers`` worker nodes, the driver connected, Serve's proxy on ``HTTP_PORT``; all gone after."""
    import ray
    from ray import serve
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    if not port_free(HTTP_PORT):
        raise RuntimeError(f"port {HTTP_PORT} on {HOST} is taken; the multi-node tests need it")
    address_file = get_ray_address_file(None)
    saved_address = open(address_file).read() if os.path.exists(address_file) else None
    saved_env = {key: os.environ.get(key) for key in FAST_AUTOSCALING_ENV}
    os.environ.update(FAST_AUTOSCALING_ENV)
    cluster = None
    try:
        # dashboard_agent_listen_port=None: a free port, not the fixed default another Ray may hold.
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": NODE_CPUS, "resources": {HEAD_SLOT: 1}, "include_dashboard": False,
            "dashboard_agent_listen_port": None, "_system_config": FAST_NODE_DEATH})
        local = LocalCluster(cluster)
        for _ in range(num_workers):
            local.add_worker()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": HOST, "port": HTTP_PORT})
        yield local
    finally:
        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if saved_address is not None:
                with open(address_file, "w") as f:
                    f.write(saved_address)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll ``predicate()`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except Exception as e:  # a proxy or replica in the middle of restarting
            last = e
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what} within {timeout}s (last: {last!r})")
        time.sleep(interval)
