"""Turns sampled tokens into text and ``RequestOutput``s: detokenization, stop strings, logprobs."""

from __future__ import annotations

import time

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Request
from engine.sampler import TokenLogprobs
from engine.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def process_token(self, request: Request, token_logprobs: TokenLogprobs | None) -> bool:
        """Account for the token just appended to ``request``. True if a stop string ended it."""
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.time()
        if request.decoder is None:
            request.decoder = self.tokenizer.decode_stream(request.params.skip_special_tokens)
        token_id = request.output_token_ids[-1]
        old_len = len(request.text)
        request.text += request.decoder.step(token_id)
        if token_logprobs is not None and request.logprobs is not None:
            self._append_logprobs(request, token_logprobs)
        stops = request.params.stop
        if not stops or len(request.text) == old_len:
            return False
        # A stop string may straddle tokens: look back far enough to catch one that began earlier.
        search_from = max(0, old_len - request.params.max_stop_chars + 1)
        hits = [(i, s) for s in stops if (i := request.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        request.text = request.text[:index]  # the stop string itself is not returned
        request.finish_reason, request.stop_reason = "stop", stop
        return True

    def _append_logprobs(self, request: Request, token_logprobs: TokenLogprobs) -> None:
        (token_id, logprob, rank), top = token_logprobs
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(logprob, rank, decode([token_id], skip_special_tokens=False))}
        for r, (tid, lp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, decode([tid], skip_special_tokens=False))
        request.logprobs.append(entry)
        request.cumulative_logprob += logprob

    def make_output(self, children: list[Request]) -> RequestOutput:
        """Snapshot of a request (all ``n`` children) with what is new since the last snapshot."""
        completions = [self._completion(child) for child in children]
        first = children[0]
        return RequestOutput(
            request_id=first.parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(c.is_finished for c in children),
            metrics=first.metrics,
        )

    @staticmethod
    def _completion(request: Request) -> CompletionOutput:
        text = request.text
        if request.is_finished:
            visible = len(text)
        else:
            # Hold back what could be the start of a stop string, so a stop string is never streamed.
            visible = max(request.sent_text_len, len(text) - max(0, request.params.max_stop_chars - 1))
        new_text = text[request.sent_text_len:visible]
        new_tokens = request.output_token_ids[request.sent_token_len:]
        request.sent_text_len = visible
        request.sent_token_len = len(request.output_token_ids)
        return CompletionOutput(
            index=request.index,
            token_ids=list(request.output_token_ids),
            text=text[:visible],
            new_token_ids=new_tokens,
            new_text=new_text,
            finish_reason=request.finish_reason if request.is_finished else None,
            stop_reason=request.stop_reason,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            cumulative_logprob=request.cumulative_logprob,
        )
