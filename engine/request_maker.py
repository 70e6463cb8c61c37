"""Turning a caller's prompt and parameters into engine ``Request``s: validation and tokenization.

Apart from the engine's state, so that whoever admits requests can do it in its own thread or process: the
engine's step loop may run in another thread (``AsyncLLMEngine``) or another process (``engine_core``), and
a bad request must fail where it was submitted, with a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from inflight.engine.request import Continuation, Request
from inflight.engine.sampling_params import PoolingParams, SamplingParams
from inflight.engine.structured_output import Constraints, GrammarCompiler, StructuredOutput
from inflight.engine.tokenizer import Tokenizer

PromptInput = str | Sequence[int] | dict[str, Any]


class RequestMaker:
    """Builds the ``n`` sequences of a request for an engine whose context is ``max_model_len`` tokens
    (``max_model_len_note`` says why, when the KV cache capped it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_model_len: int,
                 max_model_len_note: str = "", constraints: Constraints | None = None) -> None:
        """``constraints``: the engine's, when it is in this process (one grammar compiler and one cache for both);
        else grammars compile with a compiler of its own."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._max_model_len_note = max_model_len_note
        self._sequence_ids = itertools.count()
        self._constraints = constraints or Constraints(
            lambda: GrammarCompiler(tokenizer, vocab_size, eos_token_ids))

    def check_structured_output(self, constraint: StructuredOutput) -> None:
        """Compile ``constraint`` (a ``ValueError`` if it does not); cached, so checking again costs nothing."""
        self._constraints.compile(constraint)

    def make_requests(self, request_id: str, prompt: PromptInput,
                      params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                      arrival_time: float | None = None,
                      continuations: dict[int, Continuation] | None = None) -> list[Request]:
        """Validate and tokenize without touching the queue (safe from any thread).

        ``PoolingParams`` make an embedding request: prefill-only work whose output carries ``embedding``.
        ``continuations``: the request ran elsewhere and is continued here; by choice index, where each choice
        stopped (a choice not named had finished: it is not made again)."""
        params = params or SamplingParams()
        pool = isinstance(params, PoolingParams)
        if pool:
            params = params.sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or PoolingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        outside += [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:
            name = "logit_bias" if outside[0] in dict(params.logit_bias) else "stop_token_ids"
            raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured_output is not None:
            self.check_structured_output(params.structured_output)  # one that does not compile is a 400
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) > self.max_model_len or (len(token_ids) == self.max_model_len and not params.prefill_only):
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}"
                             f"{self._max_model_len_note}: no room to generate")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len}){self._max_model_len_note}")
        choices = dict.fromkeys(range(params.n)) if continuations is None else self._check_continuations(
            continuations, params, len(token_ids))
        # Sequences get internal ids nobody can choose, so a user id can never alias another's sequence.
        return [Request(f"{next(self._sequence_ids)}", token_ids, params, max_model_len=self.max_model_len,
                        eos_token_ids=self.eos_token_ids, prompt=text, priority=priority, parent_id=request_id,
                        index=i, arrival_time=arrival_time, pool=pool, continuation=continuation)
                for i, continuation in choices.items()]

    def _check_continuations(self, continuations: dict[int, Continuation], params: SamplingParams,
                             num_prompt_tokens: int) -> dict[int, Continuation]:
        if params.output_kind != "delta":
            raise ValueError("continuations: only a request with output_kind 'delta' can be continued (the tokens "
                             "before were sent by another engine)")
        if not continuations or any(not isinstance(i, int) or not 0 <= i < params.n for i in continuations):
            raise ValueError(f"continuations: choice indices must be in [0, {params.n}) and at least one is needed")
        limit = min(self.max_model_len, num_prompt_tokens + (params.max_tokens or self.max_model_len))
        for i, continuation in continuations.items():
            ids = continuation.token_ids
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                raise ValueError(f"continuations: choice {i}'s token ids must be in [0, {self.vocab_size})")
            if num_prompt_tokens + len(ids) >= limit:
                raise ValueError(f"continuations: choice {i} has nothing left to generate ({len(ids)} tokens)")
            if continuation.text_len < 0:
                raise ValueError("continuations: text_len must be >= 0")
        return dict(sorted(continuations.items()))

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _check_ids(ids: Sequence[int]) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be integers")
        return list(ids)
