"""inflight's engine: continuous batching over a paged KV cache. No Ray, no HTTP here.

The names below are imported when first used (PEP 562), not with the package: a module that needs only a light
part of it (``engine.cpu_list`` for ``make run``'s CPU plan) does not pay for torch.
"""

from __future__ import annotations

# This folder is the package inflight.engine (pyproject.toml): imported under the folder's name too, it would be a
# second copy of every module, with state of its own.
if __name__ == "engine":
    raise ImportError("import inflight.engine, not engine (the folder installs as inflight.engine)")

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "AsyncLLMEngine": "inflight.engine.async_engine", "EngineDeadError": "inflight.engine.async_engine",
    "EngineConfig": "inflight.engine.config", "LLM": "inflight.engine.llm", "LLMEngine": "inflight.engine.llm_engine",
    "CompletionOutput": "inflight.engine.outputs", "DeadlineUnmeetableError": "inflight.engine.outputs", "Logprob": "inflight.engine.outputs",
    "RequestMetrics": "inflight.engine.outputs", "RequestOutput": "inflight.engine.outputs", "Continuation": "inflight.engine.request",
    "PoolingParams": "inflight.engine.sampling_params", "SamplingParams": "inflight.engine.sampling_params",
    "StructuredOutput": "inflight.engine.structured_output",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:
    from inflight.engine.async_engine import AsyncLLMEngine, EngineDeadError
    from inflight.engine.config import EngineConfig
    from inflight.engine.llm import LLM
    from inflight.engine.llm_engine import LLMEngine
    from inflight.engine.outputs import CompletionOutput, DeadlineUnmeetableError, Logprob, RequestMetrics, RequestOutput
    from inflight.engine.request import Continuation
    from inflight.engine.sampling_params import PoolingParams, SamplingParams
    from inflight.engine.structured_output import StructuredOutput


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'inflight.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
