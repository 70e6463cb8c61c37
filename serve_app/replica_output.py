"""What the engine gives a replica, as the replica's messages: a delta ``RequestOutput`` as a stream message
(``messages.Started``, ``Chunk``, ``Finished``: its choices' new text and token ids, their logprobs as (text,
logprob) entries, a completion's echoed prompt before each choice's first text); the engine's stats as
``ReplicaStats``."""

from __future__ import annotations

import time
from typing import Any

from inflight.engine.outputs import RequestOutput
from inflight.serve_app.messages import Choice, Chunk, Finished, ReplicaStats, Started


def stream_message(output: RequestOutput, num_top: int, echo: "Echo | None", started: Started | None):
    """The message for one delta output: ``started`` (the request's first message, with its first tokens) when
    given, else a ``Chunk``, or ``Finished`` when the output is the request's last."""
    choices = tuple(_choice(completion, output, num_top, echo) for completion in output.outputs)
    if started is not None:
        return Started(started.replica_id, started.num_prompt_tokens, choices, output.finished)
    return Finished(choices) if output.finished else Chunk(choices)


def _choice(completion, output: RequestOutput, num_top: int, echo: "Echo | None") -> Choice:
    text = completion.text
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [logprob_entry(entry, token_id, num_top)
                    for entry, token_id in zip(completion.logprobs, completion.token_ids)]
    echoed = 0
    if echo is not None and completion.index not in echo.done:
        text, logprobs, echoed = echo.prepend(completion.index, text, logprobs, output)
    # The token ids too: the router keeps them, to continue the request elsewhere if this replica is lost.
    return Choice(completion.index, text, completion.token_ids, completion.finish_reason, completion.stop_reason,
                  logprobs, echoed)


class Echo:
    """A completion with ``echo``: the prompt's text goes before each choice's first text, and with logprobs
    (``num_top``) the prompt tokens' entries before the choice's own; the first prompt token has no logprob
    (null, as OpenAI sends it)."""

    def __init__(self, text: str, num_top: int | None, first_token_text: str) -> None:
        self.text = text
        self.num_top = num_top
        self.first_token_text = first_token_text
        self.done: set[int] = set()  # choices that got the prompt already
        self.entries: list[dict[str, Any]] | None = None

    def prepend(self, index: int, text: str, logprobs: list[dict[str, Any]] | None, output: RequestOutput
                ) -> tuple[str, list[dict[str, Any]] | None, int]:
        """(text, logprobs, characters echoed) of choice ``index``'s first message."""
        self.done.add(index)
        if self.num_top is None:
            return self.text + text, logprobs, len(self.text)
        if self.entries is None:
            prompt_logprobs = output.prompt_logprobs or [None]  # (a request that ended before its prompt has none)
            self.entries = [{"token": self.first_token_text, "logprob": None, "top": None}] + [
                logprob_entry(entry, token_id, self.num_top)
                for entry, token_id in zip(prompt_logprobs[1:], output.prompt_token_ids[1:])]
        return self.text + text, self.entries + (logprobs or []), len(self.text)


def logprob_entry(entry: dict, token_id: int, num_top: int) -> dict[str, Any]:
    """One generated token's logprob and the top ``num_top`` alternatives, as (text, logprob) pairs."""
    chosen = entry[token_id]
    top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
    return {"token": chosen.decoded_token or "", "logprob": chosen.logprob,
            "top": [(lp.decoded_token or "", lp.logprob) for lp in top]}


def replica_stats(stats: dict[str, Any], replica_id: str, node_id: str, model: str,
                  router_connections: int) -> ReplicaStats:
    """The engine's ``stats()`` as the replica publishes them (``router_connections``: its stream channel's
    connections not broken), time-stamped now."""
    return ReplicaStats(
        replica_id=replica_id, node_id=node_id, model=model,
        num_running=stats["num_running"], num_waiting=stats["num_waiting"],
        num_queued_prompt_tokens=stats["num_queued_prompt_tokens"],
        kv_blocks_used=stats["kv_blocks_used"], kv_blocks_total=stats["kv_blocks_total"],
        kv_blocks_free=stats["kv_blocks_free"], kv_blocks_cached=stats["kv_blocks_cached"],
        kv_token_usage=stats["kv_token_usage"], prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
        prefix_cache_query_tokens=stats["prefix_cache_query_tokens"], kv_diagnosis=stats["kv_diagnosis"],
        max_num_seqs=stats["max_num_seqs"], max_model_len=stats["max_model_len"],
        block_size=stats["block_size"],  # for the router's prefix affinity (engine.block_hash)
        num_preemptions=stats["num_preemptions"], num_finished_requests=stats["num_finished_requests"],
        num_generated_tokens=stats["num_generated_tokens"], router_connections=router_connections,
        spec={k: v for k, v in stats.items() if k.startswith("spec_")} or None, time=time.time())
