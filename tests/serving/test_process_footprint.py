"""Only the engine's own process loads torch. The router and the replica (HTTP, routing, tokenization, admission,
streaming) never import it, so each starts ~2.5 s sooner (a scale-up, a replaced replica, a redeploy) and holds
none of its memory. Checked on the running demo app by the shared libraries each process has mapped."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "inflight"  # tests/serving/fixtures.py's demo app


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past a name that may hold spaces


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_engines_process_loads_torch(server):
    processes = {int(p): _cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    replicas = [pid for pid, cmd in processes.items() if cmd.startswith(f"ray::ServeReplica:{APP_NAME}:LLMReplica")]
    routers = [pid for pid, cmd in processes.items() if cmd.startswith(f"ray::ServeReplica:{APP_NAME}:Router")]
    engines = [pid for pid, cmd in processes.items() if "inflight.engine.engine_core_child" in cmd and _parent(pid) in replicas]
    assert replicas and routers and engines, {pid: cmd for pid, cmd in processes.items() if cmd.startswith("ray::")}
    assert [pid for pid in replicas + routers if _maps_torch(pid)] == []
    assert all(_maps_torch(pid) for pid in engines)  # the check sees torch where it is
