"""The Ray Serve processes on this machine, as a soak watches them: each one's role, RSS and open files (read from
/proc: psutil is not a dependency), and, for chaos runs, killing one ``LLMReplica`` actor (Serve starts another)."""

from __future__ import annotations

import os
import random
from typing import Any


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_by_role(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds each role's processes used between two ``sample_processes`` (processes of both samples)."""
    start = {p["pid"]: p["cpu_s"] for p in before}
    used: dict[str, float] = {}
    for p in after:
        if p["pid"] in start:
            used[p["role"]] = used.get(p["role"], 0.0) + p["cpu_s"] - start[p["pid"]]
    return used


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def role_of(title: str, app: str | None) -> str | None:
    """A Ray Serve process's role from its title (Ray rewrites argv: ``ray::ProxyActor``, ``ray::ServeReplica:
    <app>:<deployment>``, with ``.method`` appended while an actor runs a task), or None for other processes."""
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    if title.startswith("ray::ServeController"):
        return "controller"
    if not title.startswith("ray::ServeReplica:"):
        return None
    parts = title[len("ray::ServeReplica:"):].split(":")
    if len(parts) < 2 or (app is not None and parts[0] != app):
        return None
    deployment = parts[1].split(".")[0].split()[0] if parts[1].strip() else ""
    return {"Router": "router", "LLMReplica": "replica"}.get(deployment, deployment.lower() or None)


def sample_processes(app: str | None = None) -> list[dict[str, Any]]:
    """RSS (MiB), open fds and CPU seconds used so far (user + system) of every Ray Serve process here, and of
    the replicas' children (the engines)."""
    found: dict[int, tuple[str, str, int, float]] = {}  # pid -> (role, title, ppid, CPU seconds)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            title = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            stat = _read(f"/proc/{pid}/stat")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        found[pid] = (role_of(title, app) or "", title, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS)
    replicas = {pid for pid, (role, _, _, _) in found.items() if role == "replica"}
    procs = []
    for pid, (role, title, ppid, cpu_s) in found.items():
        if not role and ppid in replicas:
            role = "engine" if "engine_core_child" in title else "replica child"
        if not role:
            continue
        try:
            rss_kb = next(int(line.split()[1]) for line in _read(f"/proc/{pid}/status").splitlines()
                          if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
        procs.append({"pid": pid, "role": role, "title": title[:120], "rss_mb": round(rss_kb / 1024, 2), "fds": fds,
                      "cpu_s": cpu_s})
    return sorted(procs, key=lambda p: (p["role"], p["pid"]))


# -- chaos --------------------------------------------------------------------------------------------------
def connect_ray() -> bool:
    """Join the running cluster (unless this process already is a driver, as in the tests); True if we joined."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray >= 2.59 turns token auth on for local clusters
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="auto", log_to_driver=False, configure_logging=False)
    return True


def replica_actor_names(app: str | None) -> list[str]:
    """Serve's replica actors (``SERVE_REPLICA::<app>#LLMReplica#<id>``, namespace "serve")."""
    import ray

    names = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor.get("namespace") == "serve" and "#LLMReplica#" in name:
            if app is None or name.startswith(f"SERVE_REPLICA::{app}#"):
                names.append(name)
    return sorted(names)


def kill_one_replica(app: str | None, rng: random.Random) -> dict[str, Any]:
    import ray

    names = replica_actor_names(app)
    if not names:
        return {"killed": None, "error": "no LLMReplica actor found"}
    name = rng.choice(names)
    try:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    except Exception as e:  # it died meanwhile, or is not yet registered
        return {"killed": None, "error": f"{name}: {type(e).__name__}: {e}"[:200]}
    return {"killed": name, "replicas_before": len(names)}
