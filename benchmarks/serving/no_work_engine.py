"""An engine that computes nothing, for measuring what the serving path itself costs.

It has the interface ``LLMReplica`` uses (``submit``, ``stats``, ``check_health``, ``step_observer``)
and emits one token per request every ``STEP_S`` seconds of ``asyncio.sleep``: no CPU, no GIL held
between tokens. Behind the real Router and LLMReplica it shows the floor that Ray Serve, HTTP and our
own serving code put under any engine on a given machine (``benchmarks.serving.serving_overhead --engine no-work``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from inflight.engine.async_engine import RequestStream
from inflight.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.engine.sampling_params import SamplingParams

STEP_S = 0.006  # about a demo-tiny decode step at 64 rows on this machine
TOKEN_ID, TOKEN_TEXT = 65, "A"


class NoWorkEngine:
    def __init__(self, model: str = "demo-tiny", max_num_seqs: int = 64, max_model_len: int = 2048,
                 max_outputs_per_s: float | None = None, **_: Any) -> None:
        self.max_outputs_per_s = max_outputs_per_s  # paced as AsyncLLMEngine paces its streams' outputs
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_observer = None
        self.tokenizer = None  # completions with token-id prompts only
        self.num_running = 0

    def check_health(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        blocks = 1024
        return {"num_running": self.num_running, "num_waiting": 0, "num_queued_prompt_tokens": 0,
                "kv_blocks_used": 0, "kv_blocks_total": blocks, "kv_blocks_free": blocks, "kv_blocks_cached": 0,
                "kv_blocks_empty": blocks, "kv_block_usage": 0.0, "kv_token_usage": 0.0,
                "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0, "kv_diagnosis": None,
                "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len, "block_size": 16,
                "num_preemptions": 0,
                "num_finished_requests": 0, "num_generated_tokens": 0, "time": time.time()}

    async def check_structured_output(self, params: SamplingParams, timeout_s: float) -> None:
        if params.structured_output is not None:
            raise ValueError("structured_outputs: the no-work engine generates no text to constrain")

    def submit(self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0,
               continuations: dict | None = None) -> RequestStream:
        if not isinstance(prompt, list):
            raise ValueError("prompt: the no-work engine takes token-id prompts only")
        done_already = max((len(c.token_ids) for c in (continuations or {}).values()), default=0)
        return RequestStream(request_id, list(prompt), self._tokens(request_id, list(prompt), params, done_already))

    async def _tokens(self, request_id: str, prompt: list[int], params: SamplingParams,
                      done_already: int = 0) -> AsyncIterator[RequestOutput]:
        """Delta outputs (what the replica asks for): a token after each step's sleep, each step's token in an output
        of its own, or (``max_outputs_per_s``) gathered as ``AsyncLLMEngine`` gathers them: the first and the last at
        once, and in between an output once every (streams / ``max_outputs_per_s``) seconds."""
        metrics = RequestMetrics(arrival_time=time.time())
        num_tokens = params.max_tokens or 16
        self.num_running += 1
        shown_at, held = float("-inf"), 0
        try:
            for i in range(done_already, num_tokens):
                await asyncio.sleep(STEP_S)
                done, held = i + 1 == num_tokens, held + 1
                now = time.monotonic()
                if not done and i > done_already and self.max_outputs_per_s \
                        and now - shown_at < self.num_running / self.max_outputs_per_s:
                    continue
                shown_at = now
                ids, text = [TOKEN_ID] * held, TOKEN_TEXT * held
                output = CompletionOutput(0, ids, text, ids, text, "length" if done else None)
                yield RequestOutput(request_id, None, prompt if i == done_already else None, [output], done, metrics)
                held = 0
        finally:
            self.num_running -= 1

