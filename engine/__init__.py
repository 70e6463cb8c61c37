"""inflight's engine: continuous batching over a paged KV cache. No Ray, no HTTP here.

The names below are imported when first used (PEP 562), not with the package: a module that needs only a light
part of it (``engine.cpu_list`` for ``make run``'s CPU plan) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "AsyncLLMEngine": "engine.async_engine", "EngineDeadError": "engine.async_engine",
    "EngineConfig": "engine.config", "LLM": "engine.llm", "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs", "DeadlineUnmeetableError": "engine.outputs", "Logprob": "engine.outputs",
    "RequestMetrics": "engine.outputs", "RequestOutput": "engine.outputs", "Continuation": "engine.request",
    "PoolingParams": "engine.sampling_params", "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.structured_output",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine, EngineDeadError
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, DeadlineUnmeetableError, Logprob, RequestMetrics, RequestOutput
    from engine.request import Continuation
    from engine.sampling_params import PoolingParams, SamplingParams
    from engine.structured_output import StructuredOutput


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
