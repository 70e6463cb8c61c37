"""CPU lists as ``taskset -c`` writes them, for the engine process's CPUs (``engine_cpus``).

A module of its own, importing nothing heavy: ``python -m serve_app.cpu_plan``, which ``make run`` calls before Ray
starts, needs these and not torch.
"""

from __future__ import annotations


def parse_cpu_list(text: str) -> set[int]:
    """A CPU list as ``taskset -c`` takes it ("0", "0-3", "0,2,4-5"); ``ValueError`` naming engine_cpus."""
    cpus: set[int] = set()
    try:
        for part in str(text).split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"engine_cpus must be a CPU list such as '0', '0-3' or '0,2', got {text!r}") from None
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    """``parse_cpu_list``'s inverse, in ranges ("0-3,6")."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
