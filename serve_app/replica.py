"""``LLMReplica``: one engine per replica, streaming plain-dict chunks to the router.

The engine class is injected (``engine_cls``) so tests and other engines can stand in. Messages are
plain dicts, never tensors: chunks of new tokens, the first of them also saying ``"started"`` with the
prompt's length, or a single ``{"error": ...}`` when the request is refused. (The first tokens and
the acknowledgement travel in one message: one Ray round trip less before the first token.)

Messages through Ray Serve cost CPU that the engine shares (a few thousand per second is all two
cores give), so the replica paces them: the first tokens go at once (time to first token is
untouched), then a request's tokens are gathered for ``active streams / max_messages_per_s``
seconds, so the replica as a whole sends about ``max_messages_per_s`` messages whatever the load:
one token per message with a single stream, several with many. Leaving the stream early aborts the request in the engine,
which frees its KV blocks in the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

import ray
from ray import serve

from engine import AsyncLLMEngine, DeadlineUnmeetableError, SamplingParams
from engine.outputs import RequestOutput
from serve_app.admission import DrainRate
from serve_app.autoscaling import autoscaling_metrics
from serve_app.errors import BadRequestError, OverloadedError, param_of_value_error
from serve_app.metrics import ReplicaMetrics

logger = logging.getLogger("ray.serve")

STATS_PERIOD_S = 0.5


class LLMReplica:
    def __init__(self, model: str = "demo-tiny", engine_args: dict[str, Any] | None = None,
                 served_model_name: str | None = None, max_queued_requests: int = 256,
                 max_messages_per_s: float = 200.0, engine_cls: type = AsyncLLMEngine) -> None:
        self.model_name = served_model_name or model
        self.engine = engine_cls(model, **(engine_args or {}))
        self.max_queued_requests = max_queued_requests
        self.max_messages_per_s = max_messages_per_s
        self.num_streams = 0
        self.metrics = ReplicaMetrics()
        self.engine.step_observer = self.metrics.observe_step
        self.drain = DrainRate()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use): no replica context
            self.replica_id = "local"
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self._stats_task: asyncio.Task | None = None

    # -- requests -----------------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._ensure_stats_task()
        stats = self.engine.stats()
        if stats["num_waiting"] >= self.max_queued_requests:
            self.metrics.rejections.inc()
            retry = self.drain.seconds_to_drain(stats["num_waiting"] - self.max_queued_requests + 1)
            yield {"error": OverloadedError(f"replica queue is full ({stats['num_waiting']} waiting)",
                                            retry_after_s=retry).to_dict()}
            return
        try:
            prompt = self._prompt(request)
            params = SamplingParams(**request["params"], timeout_s=request.get("timeout_s"),
                                    reject_unmeetable_deadline=request.get("strict_deadline", True))
            stream = self.engine.submit(prompt, params, request_id=request["request_id"],
                                        priority=request.get("priority", 0))
        except ValueError as e:
            yield {"error": BadRequestError(str(e), param=param_of_value_error(str(e))).to_dict()}
            return
        num_prompt_tokens = len(stream.prompt_token_ids)
        self.metrics.prompt_tokens.inc(max(1, num_prompt_tokens * params.n))
        started = {"started": True, "prompt_tokens": num_prompt_tokens, "replica_id": self.replica_id}
        sent_logprobs = [0] * params.n
        held: dict[str, Any] | None = None
        last_sent = 0.0  # nothing with tokens sent yet: the first tokens go at once
        self.num_streams += 1
        try:
            async for output in stream:
                held = _merge_chunks(held, self._chunk(output, sent_logprobs, params.logprobs or 0))
                now = time.monotonic()
                if output.finished or now - last_sent >= self.num_streams / self.max_messages_per_s:
                    if started is not None:
                        held, started = {**started, **held}, None
                    yield held
                    held, last_sent = None, now
                if output.finished:
                    self._on_finished(output)
        except DeadlineUnmeetableError as e:  # refused at admission (before any output): a late first token predicted
            self.metrics.rejections.inc()
            yield {"error": OverloadedError(str(e), retry_after_s=e.retry_after_s).to_dict()}
        finally:
            self.num_streams -= 1

    def _prompt(self, request: dict[str, Any]):
        if request["kind"] == "chat":
            tokenizer = self.engine.tokenizer
            text = tokenizer.apply_chat_template(request["messages"],
                                                 add_generation_prompt=request.get("add_generation_prompt", True))
            # The template writes the special tokens itself.
            return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        return request["prompt"]

    def _chunk(self, output: RequestOutput, sent_logprobs: list[int], num_top: int) -> dict[str, Any]:
        choices = []
        for completion in output.outputs:
            choice = {"index": completion.index, "text": completion.new_text,
                      "num_tokens": len(completion.new_token_ids), "finish_reason": completion.finish_reason,
                      "stop_reason": completion.stop_reason}
            if completion.new_token_ids:
                self.metrics.generation_tokens.inc(len(completion.new_token_ids))
            if completion.logprobs is not None:
                new = completion.logprobs[sent_logprobs[completion.index]:]
                sent_logprobs[completion.index] = len(completion.logprobs)
                choice["logprobs"] = [_logprob_entry(entry, token_id, num_top) for entry, token_id in
                                      zip(new, completion.token_ids[len(completion.token_ids) - len(new):])]
            choices.append(choice)
        return {"choices": choices, "finished": output.finished}

    def _on_finished(self, output: RequestOutput) -> None:
        self.drain.record()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        timed_out = any(c.finish_reason == "timeout" for c in output.outputs)
        self.metrics.observe_finished(output.metrics, num_tokens // max(1, len(output.outputs)), timed_out)

    # -- state ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"replica_id": self.replica_id, "node_id": self.node_id, "model": self.model_name,
                "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                "num_queued_prompt_tokens": stats["num_queued_prompt_tokens"],
                "kv_blocks_used": stats["kv_blocks_used"], "kv_blocks_total": stats["kv_blocks_total"],
                "kv_blocks_free": stats["kv_blocks_free"], "kv_blocks_cached": stats["kv_blocks_cached"],
                "kv_token_usage": stats["kv_token_usage"],
                "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
                "prefix_cache_query_tokens": stats["prefix_cache_query_tokens"],
                "kv_diagnosis": stats["kv_diagnosis"],
                "max_num_seqs": stats["max_num_seqs"], "max_model_len": stats["max_model_len"],
                "num_preemptions": stats["num_preemptions"], "num_finished_requests": stats["num_finished_requests"],
                "num_generated_tokens": stats["num_generated_tokens"], "time": time.time()}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for the request router (and /stats): exact engine state, time-stamped."""
        self._ensure_stats_task()
        return self.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Serve's autoscaler when the deployment autoscales: this replica's engine load."""
        return autoscaling_metrics(self.engine.stats())

    async def check_health(self) -> None:
        self.engine.check_health()  # raises EngineDeadError if the step loop died

    async def ping(self) -> str:
        return self.replica_id

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None:
            self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        while True:
            try:
                self.metrics.observe_stats(self.engine.stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("failed to publish engine metrics")
            await asyncio.sleep(STATS_PERIOD_S)


def _merge_chunks(held: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """One chunk carrying ``held`` then ``new``: texts joined, token counts added, the latest finish reason."""
    if held is None:
        return new
    by_index = {c["index"]: c for c in held["choices"]}
    for choice in new["choices"]:
        old = by_index.get(choice["index"])
        if old is None:
            held["choices"].append(choice)
            continue
        old["text"] += choice["text"]
        old["num_tokens"] += choice["num_tokens"]
        old["finish_reason"], old["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
        if "logprobs" in choice:
            old["logprobs"] = old.get("logprobs", []) + choice["logprobs"]
    held["finished"] = new["finished"]
    return held


def _logprob_entry(entry: dict, token_id: int, num_top: int) -> dict[str, Any]:
    """One generated token's logprob and the top ``num_top`` alternatives, as (text, logprob) pairs."""
    chosen = entry[token_id]
    top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
    return {"token": chosen.decoded_token or "", "logprob": chosen.logprob,
            "top": [(lp.decoded_token or "", lp.logprob) for lp in top]}

