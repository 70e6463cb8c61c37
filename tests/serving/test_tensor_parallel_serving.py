"""Tensor parallelism served (issue 42): two replicas of demo-tiny, each cut over two ranks (rank 0 its engine
process, rank 1 an actor in the replica's placement group). The placement groups are what the deployment asked for
(a bundle per rank, STRICT_PACK); answers are the one-rank engine's; a rank's process killed mid-stream fails its
replica, and every stream continues on the other replica exactly; deleting the app leaves no rank, placement group or
shared memory behind.

The app is deployed next to the demo app (name ``tp``, route prefix ``/tp``) for this module only."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import httpx
import pytest

from tests.serving.apps import DEMO_APP_ARGS, delete_app, deploy_app
from tests.serving.helpers import MODEL, parse_sse, wait_for_stats, wait_idle

APP_NAME = "tp"
TP_ARGS = {
    **DEMO_APP_ARGS,
    "engine_args": {"max_model_len": 1024, "max_num_seqs": 4, "num_threads": 1, "tensor_parallel_size": 2},
    "num_replicas": 2,
    "num_cpus_per_replica": 0.25,  # per rank: 2 replicas x 2 bundles = 1 of the session cluster's 4 CPUs
    "max_pending_requests": 64,
    "routing_policy": "least_loaded",
    "routing_stats_period_s": 0.2,
    "drain_timeout_s": 2.0,
}
NUM_TOKENS = 48


def _rank_actors(ray) -> dict[str, str]:
    """Live rank actors by name (``inflight-<replica id>-rank-1``) -> namespace."""
    return {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("inflight-") and "-rank-" in a["name"]}


def _app_groups(ray) -> list[dict]:
    return [g for g in ray.util.placement_group_table().values()
            if g["state"] != "REMOVED" and len(g["bundles"]) == 2 and g["strategy"] == "STRICT_PACK"]


@pytest.fixture(scope="module")
def tp(ray_cluster):
    base = deploy_app(TP_ARGS, name=APP_NAME, route_prefix="/" + APP_NAME)
    wait_for_stats(lambda s: len(s["replicas"]) == 2, base_url=base, timeout=60, what="2 replicas")
    yield base
    delete_app(APP_NAME)


def _offline_texts(bodies: list[dict]) -> list[str]:
    from inflight import LLM, SamplingParams

    llm = LLM("demo-tiny", max_model_len=1024, num_threads=1)  # one rank
    outputs = llm.generate([b["prompt"] for b in bodies],
                           [SamplingParams(max_tokens=b["max_tokens"], temperature=0.0, ignore_eos=True)
                            for b in bodies])
    return [o.outputs[0].text for o in outputs]


async def _stream(client: httpx.AsyncClient, base: str, body: dict) -> tuple[int, str, list]:
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        raw = (await response.aread()).decode()
    if response.status_code != 200:
        return response.status_code, raw, []
    stream = parse_sse(raw)
    return 200, stream.text(0), stream.errors


@pytest.mark.slow
@pytest.mark.timeout(300, func_only=True)
def test_two_rank_replicas_are_placed_answer_as_one_rank_and_survive_a_dead_rank(tp, ray_cluster):
    ray = ray_cluster
    groups = _app_groups(ray)
    assert len(groups) >= 2  # a group per replica: its bundle 0 holds the replica (rank 0), bundle 1 rank 1
    assert all(bundle == {"CPU": 0.25} for g in groups for bundle in g["bundles"].values())
    actors = _rank_actors(ray)
    assert len(actors) == 2, actors
    bodies = [{"model": MODEL, "prompt": f"rank {i} " * (1 + i % 3), "max_tokens": NUM_TOKENS, "ignore_eos": True,
               "stream": True, "temperature": 0.0} for i in range(8)]
    expected = _offline_texts(bodies)

    victims = []

    async def run(kill: bool) -> list:
        wait_idle(tp, timeout=30, num_replicas=2)
        async with httpx.AsyncClient(timeout=120.0) as client:
            tasks = [asyncio.create_task(_stream(client, tp, body)) for body in bodies]
            if kill:  # once both replicas are mid-generation: the busier one's rank 1 dies
                stats = await asyncio.to_thread(wait_for_stats, lambda s: len(s["replicas"]) == 2 and all(
                    r["num_running"] >= 2 for r in s["replicas"]), base_url=tp, timeout=30, interval=0.05,
                    what="both replicas generating")
                victim = max(stats["replicas"], key=lambda r: r["num_running"])["replica_id"]
                victims.append(victim)
                name = f"inflight-{victim}-rank-1"
                actor = ray.get_actor(name, namespace=actors[name])
                os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    for kill in (False, True):
        results = asyncio.run(run(kill))
        for i, (status, text, errors) in enumerate(results):
            assert status == 200 and not errors, (kill, i, status, errors)
            assert text == expected[i], f"stream {i} (kill={kill}): not the one-rank engine's text"
    # the rank's death failed its replica (its engine's next collective, or its idle check), and Serve replaced it
    wait_for_stats(lambda s: len(s["replicas"]) == 2 and victims[0] not in {r["replica_id"] for r in s["replicas"]},
                   base_url=tp, timeout=90, what="2 replicas again, the one that lost a rank replaced")


@pytest.mark.slow
@pytest.mark.timeout(180, func_only=True)
def test_an_idle_replica_that_loses_a_rank_is_replaced_and_deleting_the_app_frees_every_rank(ray_cluster):
    ray = ray_cluster
    actors_before, groups_before = set(_rank_actors(ray)), {g["placement_group_id"] for g in _app_groups(ray)}
    files_before = set(glob.glob("/dev/shm/inflight-*"))
    base = deploy_app({**TP_ARGS, "num_replicas": 1}, name="tp-once", route_prefix="/tp-once")
    first = wait_for_stats(lambda s: len(s["replicas"]) == 1, base_url=base, timeout=60, what="1 replica")
    (name, namespace), = [(n, ns) for n, ns in _rank_actors(ray).items() if n not in actors_before]
    os.kill(ray.get(ray.get_actor(name, namespace=namespace).pid.remote()), signal.SIGKILL)  # idle: no step notices
    old = first["replicas"][0]["replica_id"]
    wait_for_stats(lambda s: len(s["replicas"]) == 1 and s["replicas"][0]["replica_id"] != old, base_url=base,
                   timeout=90, what="the replica that lost a rank replaced")
    actors = {name: ns for name, ns in _rank_actors(ray).items() if name not in actors_before}
    assert len(actors) == 1, actors
    pids = [ray.get(ray.get_actor(name, namespace=ns).pid.remote()) for name, ns in actors.items()]
    groups = {g["placement_group_id"] for g in _app_groups(ray)} - groups_before
    assert len(groups) == 1, groups
    assert set(glob.glob("/dev/shm/inflight-*")) <= files_before  # (removed once every rank had attached them)
    delete_app("tp-once")

    def left() -> list:
        return [*(set(_rank_actors(ray)) & set(actors)), *(groups & {g["placement_group_id"] for g in _app_groups(ray)}),
                *(pid for pid in pids if _alive(pid)), *(set(glob.glob("/dev/shm/inflight-*")) - files_before)]

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left()


def _alive(pid: int) -> bool:
    from inflight.engine.parallel.shm import process_alive

    return process_alive(pid)
