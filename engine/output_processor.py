"""Turns sampled tokens into text and ``RequestOutput``s: detokenization, stop strings, logprobs."""

from __future__ import annotations

import time

from engine.model_runner import PromptOutput
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import TokenLogprobs
from engine.tokenizer import Tokenizer

_FINISHED = RequestStatus.FINISHED


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob entries name every token)

    def process_tokens(self, requests: list[Request], logprobs_by_id: dict[str, list[TokenLogprobs]] | None = None,
                       num_appended: dict[str, int] | None = None) -> list[Request]:
        """Account for the token each of ``requests`` just got (its logprobs, in a one-entry list); returns those a
        stop string ended. ``num_appended``: requests that got several tokens (a speculative step), and how many.

        One call per step with its loop inside: this runs for every row of every step."""
        stopped = []
        for request in requests:
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = time.time()
            count = num_appended.get(request.request_id, 1) if num_appended else 1
            decoder = request.decoder
            if decoder is None:
                decoder = request.decoder = self.tokenizer.decode_stream(request.params.skip_special_tokens)
                for token_id in request.output_token_ids[:-count]:  # a continued sequence's earlier tokens (if any)
                    request.text += decoder.step(token_id) or ""
            if logprobs_by_id is not None and request.logprobs is not None:
                for token_logprobs in logprobs_by_id.get(request.request_id, ()):
                    self._append_logprobs(request, token_logprobs)
            if count > 1:
                if self._several_tokens(request, decoder, count):
                    stopped.append(request)
                continue
            # One token, _several_tokens' loop unrolled: this runs for every row of every step, and a call per row
            # would cost the plain path more than all of speculation's hooks (benchmarks.scheduler --opcodes).
            piece = decoder.step(request.output_token_ids[-1])
            if piece:
                request.text += piece
                if request.params.stop and self._cut_at_stop_string(request, len(request.text) - len(piece)):
                    stopped.append(request)
        return stopped

    def _several_tokens(self, request: Request, decoder, count: int) -> bool:
        """The last ``count`` output tokens, each checked for a stop string; True if one ended the request (the
        tokens after it go: they would not have been generated)."""
        output_token_ids = request.output_token_ids
        for index in range(len(output_token_ids) - count, len(output_token_ids)):
            piece = decoder.step(output_token_ids[index])
            if piece:
                request.text += piece
                if request.params.stop and self._cut_at_stop_string(request, len(request.text) - len(piece)):
                    request.drop_tokens_after(index + 1)
                    return True
        return False

    @staticmethod
    def _cut_at_stop_string(request: Request, old_len: int) -> bool:
        """If the text (``old_len`` chars before this token) now holds a stop string, cut it there and end."""
        # A stop string may straddle tokens: look back far enough to catch one that began earlier.
        search_from = max(0, old_len - request.params.max_stop_chars + 1)
        hits = [(i, s) for s in request.params.stop if (i := request.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        request.text = request.text[:index]  # the stop string itself is not returned
        request.finish_reason, request.stop_reason = "stop", stop
        return True

    def _append_logprobs(self, request: Request, token_logprobs: TokenLogprobs) -> None:
        request.logprobs.append(self._logprob_entry(token_logprobs))
        request.cumulative_logprob += token_logprobs[0][1]

    def _logprob_entry(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The token's logprob and rank, then its top alternatives (rank 1 first), each with its text."""
        (token_id, logprob, rank), top = token_logprobs
        text = self._token_text
        entry = {token_id: Logprob(logprob, rank, text(token_id))}
        for r, (tid, lp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, text(tid))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def add_prompt_outputs(self, request: Request, start: int, output: PromptOutput) -> None:
        """A prompt chunk from position ``start``: its prompt tokens' logprobs and its pooled hidden states."""
        if output.logprobs is not None:
            assert len(request.prompt_logprobs) == start + 1, "prompt logprobs must arrive chunk after chunk"
            request.prompt_logprobs.extend(self._logprob_entry(lp) for lp in output.logprobs)
        if output.pooled_sum is not None:
            pooled = request.pooled_sum
            request.pooled_sum = output.pooled_sum if pooled is None else pooled + output.pooled_sum

    def make_output(self, children: list[Request]) -> RequestOutput:
        """Snapshot of a request (all ``n`` children) with what is new since the last snapshot, shaped by its
        ``output_kind``: a delta output holds only what is new, and the prompt's fields in the first one only."""
        first = children[0]
        complete = _delta if first.params.output_kind == "delta" else _completion
        if len(children) == 1:  # the usual case, once per request per step: no generator for all()
            completions = [complete(first)]
            finished = first.status is _FINISHED
        else:
            completions = [complete(child) for child in children]
            finished = all(c.is_finished for c in children)
        prompt_token_ids, prompt_logprobs = first.prompt_token_ids, first.prompt_logprobs
        if complete is _delta:
            if first.sent_first_output:
                prompt_token_ids = prompt_logprobs = None
            first.sent_first_output = True
        # Positional, in field order: keyword arguments cost twice as much, and this runs per request per step.
        output = RequestOutput(first.parent_id, first.prompt, prompt_token_ids, completions, finished,
                               first.metrics, prompt_logprobs)
        if finished and first.pool and first.pooled_sum is not None:
            output.embedding = (first.pooled_sum / first.num_prompt_tokens).tolist()
        return output


def _visible_text_len(request: Request, finished: bool) -> int:
    """How much of the text may be sent: all of it, except what could be the start of a stop string while the
    request runs (so a stop string is never streamed)."""
    text, stops = request.text, request.params.stop
    if finished or not stops:
        # Without stop strings nothing is held back. Never below what was sent: a continued sequence
        # (engine.request.Continuation) has sent text before its detokenizer has replayed it.
        return max(request.sent_text_len, len(text))
    return max(request.sent_text_len, len(text) - max(0, request.params.max_stop_chars - 1))


def _completion(request: Request) -> CompletionOutput:
    """One sequence's snapshot, everything so far; advances what has been sent of it."""
    text = request.text
    finished = request.status is _FINISHED
    visible = _visible_text_len(request, finished)
    output_token_ids = request.output_token_ids
    new_text = text[request.sent_text_len:visible]
    new_tokens = output_token_ids[request.sent_token_len:]
    request.sent_text_len = visible
    request.sent_token_len = len(output_token_ids)
    # Positional, in field order (index, token_ids, text, new_token_ids, new_text, finish_reason, stop_reason,
    # logprobs, cumulative_logprob), for the same reason as in make_output.
    return CompletionOutput(request.index, list(output_token_ids), text[:visible], new_tokens, new_text,
                            request.finish_reason if finished else None, request.stop_reason,
                            list(request.logprobs) if request.logprobs is not None else None,
                            request.cumulative_logprob)


def _delta(request: Request) -> CompletionOutput:
    """One sequence's new tokens, text and logprobs since the previous output; advances what has been sent."""
    finished = request.status is _FINISHED
    visible = _visible_text_len(request, finished)
    sent_tokens = request.sent_token_len
    new_text = request.text[request.sent_text_len:visible]
    new_tokens = request.output_token_ids[sent_tokens:]
    request.sent_text_len = visible
    request.sent_token_len = sent_tokens + len(new_tokens)
    logprobs = request.logprobs[sent_tokens:] if request.logprobs is not None else None  # one entry per token
    return CompletionOutput(request.index, new_tokens, new_text, new_tokens, new_text,
                            request.finish_reason if finished else None, request.stop_reason, logprobs,
                            request.cumulative_logprob)
