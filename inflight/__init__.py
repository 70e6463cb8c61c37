"""inflight: an LLM inference server built around continuous (in-flight) batching over a paged KV cache.

The public API: ``from inflight import LLM, SamplingParams, LLMEngine, AsyncLLMEngine`` (and the other names of
``inflight.engine``). The code lives in three folders of the repository, installed as subpackages
(pyproject.toml's ``package-dir``): ``engine/`` as ``inflight.engine`` (scheduler, KV cache, model runner; no Ray,
no HTTP), ``kernels/`` as ``inflight.kernels`` (attention and the CPU kernels; no requests), ``serve_app/`` as
``inflight.serve_app`` (the Ray Serve application). Names are imported when first used (PEP 562): ``import
inflight`` does not load torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# In a checkout the subpackages are the folders beside this one, and this package, found first on a path that
# holds the checkout (its root as the working directory), would not see them: an installed inflight holds them
# inside itself instead.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "engine" / "__init__.py").is_file():
    __path__.append(str(_checkout))


def __getattr__(name: str) -> Any:
    # (import_module, not ``from inflight import engine``: that asks this function for "engine" first)
    engine = importlib.import_module("inflight.engine")
    if name in engine.__all__:
        return getattr(engine, name)
    raise AttributeError(f"module 'inflight' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *importlib.import_module("inflight.engine").__all__])
