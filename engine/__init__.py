"""inflight's engine: continuous batching over a paged KV cache. No Ray, no HTTP here."""

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, DeadlineUnmeetableError, Logprob, RequestMetrics, RequestOutput
from engine.request import Continuation
from engine.sampling_params import PoolingParams, SamplingParams
from engine.structured_output import StructuredOutput

__all__ = [
    "LLM", "LLMEngine", "AsyncLLMEngine", "EngineDeadError", "EngineConfig", "SamplingParams", "PoolingParams",
    "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "DeadlineUnmeetableError", "StructuredOutput",
    "Continuation",
]
