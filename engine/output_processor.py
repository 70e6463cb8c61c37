"""The front end of the engine's outputs: token ids become text and ``RequestOutput``s.

The engine's core (``LLMEngine.core_step``) reports, after each step, what each sequence got: its new token ids,
its end, the raw logprobs (``core_messages.SequenceUpdate``, or one ``PlainStep`` for a plain decode step). This class does the rest: incremental detokenization, stop strings,
the logprobs' token texts, and the outputs' shape (``output_kind``). It runs wherever the caller is: inside
``LLMEngine.step`` right after the core's step, or in a server's process (``AsyncLLMEngine``) while the core, in a
process of its own, already runs the next step. So the engine's loop never detokenizes (vLLM V1 splits its engine
core and its front end the same way).

A stop string is found here, so the core hears of it afterwards (``LLMEngine.finish_stopped``): at once in
``LLMEngine.step``, a step or two later across processes. Nothing the core computes for a sequence after its
stop string is ever shown: records for a sequence that ended here are ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.core_messages import CoreMetrics, PlainStep, Record
from inflight.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from inflight.engine.request import Request
from inflight.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from inflight.engine.sampler import TokenLogprobs



class _Request:
    """What the front end keeps of a request (all its ``n`` sequences) until its final output."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "sequences", "output_kind",
                 "sent_first_output", "metrics", "embedding", "shown_at")

    def __init__(self, first: Request) -> None:
        self.request_id = first.parent_id
        self.prompt = first.prompt
        self.prompt_token_ids = first.prompt_token_ids
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.sequences: list[_Sequence] = []
        self.output_kind = first.params.output_kind
        self.sent_first_output = False  # delta outputs carry the prompt's fields in the first one only
        self.metrics: RequestMetrics = first.metrics
        self.embedding: list[float] | None = None
        self.shown_at = float("-inf")  # when its latest output with something to show was made (``process``)


class _Sequence:
    """One sequence's text so far and what of it was sent."""

    __slots__ = ("request_id", "index", "parent", "token_ids", "text", "decoder", "skip_special_tokens", "stop",
                 "max_stop_chars", "sent_text_len", "sent_token_len", "logprobs", "cumulative_logprob",
                 "finish_reason", "stop_reason")

    def __init__(self, request: Request, parent: _Request) -> None:
        params = request.params
        self.request_id = request.request_id
        self.index = request.index
        self.parent = parent
        self.token_ids = list(request.output_token_ids)  # a continued sequence's earlier tokens (else empty)
        self.text = ""
        self.decoder = None  # built at the first token
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.max_stop_chars = params.max_stop_chars
        self.sent_token_len = len(self.token_ids)
        self.sent_text_len = request.continued_text_len
        with_logprobs = params.logprobs is not None
        # a continued sequence's earlier tokens' logprobs were sent by the engine that computed them
        self.logprobs: list[dict[int, Logprob] | None] | None = [None] * len(self.token_ids) if with_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob entries name every token)
        self._requests: dict[str, _Request] = {}
        self._sequences: dict[str, _Sequence] = {}

    def __len__(self) -> int:
        """Requests whose final output has not been made yet."""
        return len(self._requests)

    def add(self, requests: list[Request]) -> None:
        """A request's sequences (all ``n``), as the core got them."""
        parent = _Request(requests[0])
        self._requests[parent.request_id] = parent
        for request in requests:
            sequence = _Sequence(request, parent)
            parent.sequences.append(sequence)
            self._sequences[sequence.request_id] = sequence

    def forget(self, request_id: str) -> None:
        """A request the core refused: no output will come for it."""
        parent = self._requests.pop(request_id, None)
        if parent is not None:
            for sequence in parent.sequences:
                self._sequences.pop(sequence.request_id, None)

    def process(self, records: list[Record], now: float = 0.0,
                outputs_per_s: float | None = None) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """The outputs of a core step's records, and the sequences a stop string ended here while the core has
        them running: (request id, stop string), for ``LLMEngine.finish_stopped``.

        ``outputs_per_s`` paces the outputs: about that many a second in all, shared by the requests the records
        touch (those producing now: a request waiting for a batch slot takes no share). After an output that shows
        something (text, logprobs), a request's next comes once (requests touched / ``outputs_per_s``) seconds have
        passed (by ``now``, a monotonic clock), or with the request's end; the tokens of the steps between are in
        it (their text is made and checked for stop strings as they come, only no output is). A stream then costs
        its consumer an output per interval instead of one per step. (Dividing by every open stream instead gave
        64 streams, of which the KV held ~16, an output every 320 ms at 200 a second: inter-token latency 3.7x
        vLLM's, while the replica sent a quarter of its budget.)

        One call per step with its loop inside: this runs for every row of every step."""
        touched: dict[_Request, None] = {}
        stopped: list[tuple[str, str]] = []
        sequences = self._sequences
        for record in records:
            if record.__class__ is PlainStep:  # a plain step's rows: one new token each, nothing else
                self._add_plain(record.request_ids, record.token_ids, touched, stopped)
                continue
            request_id = record.request_id
            sequence = sequences.get(request_id)
            if sequence is None or sequence.finish_reason is not None:
                continue  # a stop string ended it here: the core's later work on it is not shown
            parent = sequence.parent
            finish_reason, logprobs, metrics = record.finish_reason, record.logprobs, record.metrics
            if finish_reason is None and logprobs is None and metrics is None:  # new tokens, nothing else
                touched[parent] = None
                if self._add_tokens(sequence, record.new_token_ids, None):
                    stopped.append((request_id, sequence.stop_reason))
                continue
            if metrics is not None:
                _copy_metrics(metrics, parent.metrics)
            if record.prompt_logprobs is not None and sequence.index == 0:
                parent.prompt_logprobs = [self._logprob_entry(lp) if lp is not None else None
                                          for lp in record.prompt_logprobs]
            if record.embedding is not None:
                parent.embedding = record.embedding
            token_ids = record.new_token_ids
            if token_ids and self._add_tokens(sequence, token_ids, logprobs) and finish_reason is None:
                stopped.append((request_id, sequence.stop_reason))
            if finish_reason is not None and sequence.finish_reason is None:
                sequence.finish_reason, sequence.stop_reason = finish_reason, record.stop_reason
            touched[parent] = None
        interval = len(touched) / outputs_per_s if outputs_per_s else 0.0
        outputs = []
        for parent in touched:
            children = parent.sequences
            finished = (children[0].finish_reason is not None if len(children) == 1
                        else all(s.finish_reason is not None for s in children))
            if not finished and (parent.output_kind == "final_only" or now - parent.shown_at < interval):
                continue
            output = self._make_output(parent, finished)
            outputs.append(output)
            if interval and _shows_something(output):
                parent.shown_at = now
            if finished:
                del self._requests[parent.request_id]
                for sequence in parent.sequences:
                    del sequences[sequence.request_id]
        return outputs, stopped

    def _add_plain(self, request_ids: list[str], token_ids: list[int], touched: dict[_Request, None],
                   stopped: list[tuple[str, str]]) -> None:
        """``process`` for a plain step's record: each sequence's one new token."""
        sequences, add = self._sequences, self._add_token
        for request_id, token_id in zip(request_ids, token_ids):
            sequence = sequences.get(request_id)
            if sequence is None or sequence.finish_reason is not None:
                continue  # a stop string ended it here: the core's later work on it is not shown
            touched[sequence.parent] = None
            if add(sequence, token_id):
                stopped.append((request_id, sequence.stop_reason))

    def _add_token(self, sequence: _Sequence, token_id: int) -> bool:
        """``_add_tokens`` for one token without logprobs, the usual case: this runs for every row of every step."""
        decoder = sequence.decoder or self._start_decoding(sequence)
        sequence.token_ids.append(token_id)
        piece = decoder.step(token_id)
        if piece:
            sequence.text += piece
            return bool(sequence.stop) and self._cut_at_stop_string(sequence, len(sequence.text) - len(piece))
        return False

    def _start_decoding(self, sequence: _Sequence):
        """The sequence's incremental decoder, fed a continued sequence's earlier tokens (if any)."""
        decoder = sequence.decoder = self.tokenizer.decode_stream(sequence.skip_special_tokens)
        for token_id in sequence.token_ids:
            sequence.text += decoder.step(token_id) or ""
        return decoder

    def _add_tokens(self, sequence: _Sequence, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> bool:
        """Append ``token_ids`` (their ``logprobs``, when asked for), each checked for a stop string; True if one
        ended the sequence (the tokens after it go: they would not have been generated)."""
        if len(token_ids) == 1 and logprobs is None:
            return self._add_token(sequence, token_ids[0])
        decoder = sequence.decoder or self._start_decoding(sequence)
        with_logprobs = logprobs is not None and sequence.logprobs is not None
        for i, token_id in enumerate(token_ids):
            sequence.token_ids.append(token_id)
            if with_logprobs and i < len(logprobs):
                self._append_logprobs(sequence, logprobs[i])
            piece = decoder.step(token_id)
            if piece:
                sequence.text += piece
                if sequence.stop and self._cut_at_stop_string(sequence, len(sequence.text) - len(piece)):
                    return True
        return False

    @staticmethod
    def _cut_at_stop_string(sequence: _Sequence, old_len: int) -> bool:
        """If the text (``old_len`` chars before this token) now holds a stop string, cut it there and end."""
        # A stop string may straddle tokens: look back far enough to catch one that began earlier.
        search_from = max(0, old_len - sequence.max_stop_chars + 1)
        hits = [(i, s) for s in sequence.stop if (i := sequence.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        sequence.text = sequence.text[:index]  # the stop string itself is not returned
        sequence.finish_reason, sequence.stop_reason = "stop", stop
        return True

    def _append_logprobs(self, sequence: _Sequence, token_logprobs: TokenLogprobs) -> None:
        sequence.logprobs.append(self._logprob_entry(token_logprobs))
        sequence.cumulative_logprob += token_logprobs[0][1]

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

    def _make_output(self, parent: _Request, finished: bool) -> RequestOutput:
        """Snapshot of a request (all ``n`` sequences) with what is new since the last snapshot, shaped by its
        ``output_kind``: a delta output holds only what is new, and the prompt's fields in the first one only."""
        complete = _delta if parent.output_kind == "delta" else _completion
        sequences = parent.sequences
        completions = [complete(sequences[0])] if len(sequences) == 1 else [complete(s) for s in sequences]
        prompt_token_ids, prompt_logprobs = parent.prompt_token_ids, parent.prompt_logprobs
        if complete is _delta:
            if parent.sent_first_output:
                prompt_token_ids = prompt_logprobs = None
            parent.sent_first_output = True
        # Positional, in field order: keyword arguments cost twice as much, and this runs per request per step.
        output = RequestOutput(parent.request_id, parent.prompt, prompt_token_ids, completions, finished,
                               parent.metrics, prompt_logprobs)
        if finished and parent.embedding is not None:
            output.embedding = parent.embedding
        return output


def _copy_metrics(metrics: CoreMetrics, into: RequestMetrics) -> None:
    into.first_scheduled_time, into.first_token_time = metrics.first_scheduled_time, metrics.first_token_time
    into.finished_time, into.num_preemptions = metrics.finished_time, metrics.num_preemptions
    into.predicted_ttft_s = metrics.predicted_ttft_s


def _shows_something(output: RequestOutput) -> bool:
    """Whether a client is shown anything of ``output``: new text, or new tokens' logprobs. (A token whose text the
    detokenizer holds back, the first bytes of a character, shows nothing: it starts no pacing interval, or the text
    behind it would wait an interval.)"""
    return any(c.new_text or (c.logprobs and c.new_token_ids) for c in output.outputs)


def _visible_text_len(sequence: _Sequence, finished: bool) -> int:
    """How much of the text may be sent: all of it, except what could be the start of a stop string while the
    sequence runs (so a stop string is never streamed)."""
    text_len = len(sequence.text)
    if finished or not sequence.stop:
        # Without stop strings nothing is held back. Never below what was sent: a continued sequence
        # (engine.request.Continuation) has sent text before its detokenizer has replayed it.
        return max(sequence.sent_text_len, text_len)
    return max(sequence.sent_text_len, text_len - max(0, sequence.max_stop_chars - 1))


def _completion(sequence: _Sequence) -> CompletionOutput:
    """One sequence's snapshot, everything so far; advances what has been sent of it."""
    text = sequence.text
    finished = sequence.finish_reason is not None
    visible = _visible_text_len(sequence, finished)
    token_ids = sequence.token_ids
    new_text = text[sequence.sent_text_len:visible]
    new_tokens = token_ids[sequence.sent_token_len:]
    sequence.sent_text_len = visible
    sequence.sent_token_len = len(token_ids)
    # Positional, in field order (index, token_ids, text, new_token_ids, new_text, finish_reason, stop_reason,
    # logprobs, cumulative_logprob), for the same reason as in _make_output.
    return CompletionOutput(sequence.index, list(token_ids), text[:visible], new_tokens, new_text,
                            sequence.finish_reason, sequence.stop_reason,
                            list(sequence.logprobs) if sequence.logprobs is not None else None,
                            sequence.cumulative_logprob)


def _delta(sequence: _Sequence) -> CompletionOutput:
    """One sequence's new tokens, text and logprobs since the previous output; advances what has been sent."""
    finished = sequence.finish_reason is not None
    visible = _visible_text_len(sequence, finished)
    sent_tokens = sequence.sent_token_len
    new_text = sequence.text[sequence.sent_text_len:visible]
    new_tokens = sequence.token_ids[sent_tokens:]
    sequence.sent_text_len = visible
    sequence.sent_token_len = sent_tokens + len(new_tokens)
    logprobs = sequence.logprobs[sent_tokens:] if sequence.logprobs is not None else None  # one entry per token
    return CompletionOutput(sequence.index, new_tokens, new_text, new_tokens, new_text, sequence.finish_reason,
                            sequence.stop_reason, logprobs, sequence.cumulative_logprob)
