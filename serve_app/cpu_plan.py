"""Which CPUs Ray's serving processes get when engines have cores of their own (``engine_cpus``).

An engine on a CPU is compute-bound; the proxy, the router, the replicas' event loops and Ray's own
processes are not, but together they keep a core busy under load, and wherever the OS puts them they take
turns with the engine on its core, slowing every step. So a config can give each replica's engine process
its own CPUs (``engine_cpus``), and the script that starts Ray (``scripts/serve.sh``, which ``make run``
uses) starts it on the CPUs left:

    python -m serve_app.cpu_plan CONFIG   # prints the CPU list for `taskset -c`, or nothing

On the 2-core demo machine, engine on CPU 0 and everything else on CPU 1 took the seed workload through
``vllm bench serve`` from ~390 to ~500 output tok/s (docs/benchmarks-history.md). Nothing is printed when no app
reserves CPUs, or when nothing would be left (then everything shares every CPU, as without the setting).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from inflight.engine.cpu_list import format_cpu_list, parse_cpu_list


def engine_cpus_of(serve_config: dict[str, Any]) -> set[int]:
    """The CPUs the config's apps reserve for their engines (``args.engine_cpus``), together."""
    reserved: set[int] = set()
    for app in serve_config.get("applications") or []:
        cpus = (app.get("args") or {}).get("engine_cpus")
        if cpus is not None:
            reserved |= parse_cpu_list(cpus)
    return reserved


def cpus_left(reserved: set[int], available: set[int] | None = None) -> set[int] | None:
    """``available`` (default: this process's CPUs) less ``reserved``; None when nothing is reserved or nothing
    would be left (then everything shares every CPU)."""
    rest = (set(os.sched_getaffinity(0)) if available is None else available) - reserved
    return rest if reserved and rest else None


def serving_cpus(serve_config: dict[str, Any], available: set[int] | None = None) -> set[int] | None:
    """The CPUs left for Ray's processes by the config's engines (``cpus_left``)."""
    return cpus_left(engine_cpus_of(serve_config), available)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m serve_app.cpu_plan SERVE_CONFIG.yaml", file=sys.stderr)
        return 2
    config = yaml.safe_load(Path(argv[0]).read_text()) or {}
    rest = serving_cpus(config)
    if rest is not None:
        print(format_cpu_list(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
