"""A replica's tensor-parallel ranks as Ray actors, one per bundle of the replica's placement group.

With ``tensor_parallel_size`` N the deployment asks Serve for a placement group per replica (``app.py``): N bundles,
``STRICT_PACK`` (one node: the ranks share memory), the replica itself in bundle 0 beside rank 0 (its engine
process), so the group's bundles are the replica's resources and the autoscaler and KubeRay see every rank. The
replica starts ranks 1..N-1 here, each an actor in its own bundle running ``engine.parallel.ranks.worker_main``,
and tells its engine (``tensor_parallel_workers="external"``) the port where rank 0 will wait for them.

The actors are the replica's: they die with it (Ray kills the actors an actor owns); ``stop`` kills them when the
replica's engine fails to start. ``check`` (the replica's health check) fails once a rank's run has ended; rank 0 notices a rank that died
mid-step at once, and an idle engine within a second (the pids in the shared memory).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(max_concurrency=2)  # run() holds one thread for the rank's life; pid() answers on the other
class RankActor:
    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, size: int, port: int) -> None:
        from inflight.engine.parallel.ranks import RankSetup, worker_main

        worker_main(RankSetup(rank, size, port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankActors:
    """Ranks 1..N-1 of one replica's engine."""

    def __init__(self, size: int, bundle: dict[str, float], name: str) -> None:
        group = get_current_placement_group()
        if group is None:
            raise ValueError("tensor_parallel_size > 1 needs the replica's placement group (serve_app.app makes it)")
        self.port = free_port()
        self.actors = [RankActor.options(
            name=f"{name}-rank-{rank}", num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank))
            .remote() for rank in range(1, size)]
        self.runs = [actor.run.remote(rank, size, self.port) for rank, actor in enumerate(self.actors, start=1)]

    def engine_args(self) -> dict[str, Any]:
        return {"tensor_parallel_workers": "external", "tensor_parallel_port": self.port}

    def check(self) -> None:
        """RuntimeError if a rank's run has ended (its error, if it raised)."""
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if ended:
            rank = self.runs.index(ended[0]) + 1
            try:
                ray.get(ended[0])
                why = "it stopped"
            except Exception as e:  # the rank's own error, or the actor's death
                why = f"{type(e).__name__}: {str(e)[:300]}"
            raise RuntimeError(f"tensor-parallel rank {rank} has ended: {why}")

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
