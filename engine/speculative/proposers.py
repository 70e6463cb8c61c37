"""Where proposed tokens come from. A proposer looks at one request and guesses up to ``k`` tokens that follow its
tokens so far; it may guess fewer, or none. Per-request state lives in the request's ``spec_state`` slot (it goes
with the request). A draft model or an EAGLE-style head would be a proposer that guesses for the whole batch in one
forward: ``propose_batch`` is the entry point the speculator calls, so such a proposer overrides it."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from inflight.engine.request import Request

_TOKEN_BYTES = array("i").itemsize  # token ids as native 32-bit ints: searched with bytes.rfind, in C


class Proposer:
    def propose(self, request: "Request", k: int) -> list[int]:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """The request ended: state kept for it outside the request (a draft model's KV blocks) goes."""

    def propose_batch(self, requests: list["Request"], ks: list[int]) -> list[list[int]]:
        propose = self.propose
        return [propose(request, k) if k > 0 else [] for request, k in zip(requests, ks)]


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier place where the request's last n tokens (n from ``max_n`` down to
    ``min_n``) occurred in its prompt or output, and propose the tokens that followed there. Free (no model), and
    right whenever the output copies its input: code edits, quoting, summaries, a model that loops.

    The request's tokens are kept as a byte string grown by the new tokens each step, so a match is one
    ``bytes.rfind`` (C, no Python loop over the history); a hit must fall on a token boundary."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: "Request", k: int) -> list[int]:
        tokens = request.all_token_ids
        history = request.spec_state
        if history is None:
            history = request.spec_state = bytearray()
        have = len(history) // _TOKEN_BYTES
        if have < len(tokens):
            history += array("i", tokens[have:]).tobytes()
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            pattern = bytes(history[-n * _TOKEN_BYTES:])
            end = len(history) - _TOKEN_BYTES  # the match must end before the last token: something follows it
            while True:
                at = history.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % _TOKEN_BYTES == 0:
                    follows = at // _TOKEN_BYTES + n
                    return tokens[follows:follows + k]
                end = at + len(pattern) - 1  # a hit across token boundaries: look further back
        return []


class OracleProposer(Proposer):
    """Proposes what an earlier run produced for the same prompt (tests and benchmarks only): with greedy
    decoding every proposal is accepted, which measures the mechanism at its ceiling."""

    def __init__(self, outputs: Mapping[tuple[int, ...], tuple[int, ...]]) -> None:
        self.outputs = outputs

    def propose(self, request: "Request", k: int) -> list[int]:
        expected = request.spec_state
        if expected is None:
            expected = request.spec_state = tuple(self.outputs.get(tuple(request.prompt_token_ids), ()))
        done = len(request.output_token_ids)
        return list(expected[done:done + k])


def make_proposer(config, draft: Proposer | None = None) -> Proposer:
    """The proposer ``config.method`` names; ``draft``: the engine's ``DraftProposer`` for method ``draft`` (it
    needs the engine's device, sizes and KV budget, so the engine builds it)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "oracle":
        return OracleProposer(config.oracle_outputs)
    if config.method == "draft" and draft is not None:
        return draft
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")
