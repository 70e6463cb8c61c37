"""Offline batch inference: give it all the prompts, get all the outputs back in input order."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from inflight.engine.llm_engine import LLMEngine, PromptInput
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.engine.outputs import RequestOutput
from inflight.engine.sampling_params import PoolingParams, SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = LLMEngine(model, **engine_args)
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Prompts: a str, a list of str, or a list of token-id lists. Outputs come back in input order.

        ``SamplingParams(max_tokens=0, prompt_logprobs=k)`` scores the prompts: each output's
        ``prompt_logprobs`` holds every prompt token's logprob (None at position 0) and its top ``k``."""
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, "generate")

    def embed(self, prompts: PromptInput | Sequence[PromptInput], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """One embedding per prompt (``output.embedding``): the mean over its positions of the model's final-norm
        hidden state. Outputs come back in input order."""
        prompts = _as_list(prompts)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        return self._run(prompts, [pooling_params or PoolingParams()] * len(prompts), use_tqdm, "embed")

    def _run(self, prompts: list[PromptInput], params_list: list[SamplingParams | PoolingParams], use_tqdm: bool,
             desc: str) -> list[RequestOutput]:
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        batches = []
        for prompt, params in zip(prompts, params_list):
            if isinstance(params, SamplingParams):  # only finished outputs are read: no snapshot per step
                params = params.replace(output_kind="final_only")
            batches.append(self.engine.make_requests(str(self._next_id), prompt, params))
            self._next_id += 1
        order = {batch[0].parent_id: i for i, batch in enumerate(batches)}
        for batch in batches:
            self.engine.enqueue(batch)
        results: list[RequestOutput | None] = [None] * len(batches)
        with tqdm(total=len(batches), disable=not use_tqdm, desc=desc) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.chat_prompt(conversation, add_generation_prompt) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (a str, a dict, a list of token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)
