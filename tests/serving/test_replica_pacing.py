"""The replica's pacing of a stream's messages (serve_app.replica): the first text a client can see goes at once.

An ``LLMReplica`` is driven in this process (no Serve) with demo-tiny, whose byte-level tokens are often the first
bytes of a character: the detokenizer holds such a token's text back, and the router sends a client nothing for
it. The pacing window (``active streams / max_messages_per_s``) is made 1,000 s, so a message sent after a window
has started can only be the last one.

The engine is a ``LockstepEngine``: it hands the replica a step's output only once the replica has taken the one
before, as a consumer keeping up would. (A consumer that lags, on a busy machine, gets the outputs queued meanwhile
merged into one message: the first text and the last output would arrive together, or the first token with its
text, whatever the pacing did.)
"""

from __future__ import annotations

import asyncio

import pytest

from inflight.engine import LLM, SamplingParams
from inflight.serve_app.messages import GenerateRequest, Started
from inflight.serve_app.replica import LLMReplica
from tests.engine.helpers import LockstepEngine

pytestmark = pytest.mark.timeout(120, func_only=True)

ENGINE_ARGS = {"max_model_len": 256, "num_threads": 1}
MAX_TOKENS = 16


def _prompt_whose_first_token_shows_nothing() -> tuple[str, str]:
    """A prompt whose greedy first token decodes to no text, and the text of its first ``MAX_TOKENS`` tokens."""
    llm = LLM("demo-tiny", **ENGINE_ARGS)
    for i in range(200):
        prompt = f"Prompt number {i}:"
        if llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].text == "":
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            return prompt, llm.generate([prompt], params)[0].outputs[0].text
    raise AssertionError("no prompt of demo-tiny starts with a token that shows no text")


def test_a_first_token_without_text_does_not_hold_back_the_text_behind_it():
    prompt, expected = _prompt_whose_first_token_shows_nothing()
    assert expected  # the text comes with later tokens

    async def messages() -> list:
        replica = LLMReplica("demo-tiny", ENGINE_ARGS, max_messages_per_s=1e-3, engine_cls=LockstepEngine)
        request = GenerateRequest("paced", "completion", {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}, prompt=prompt)
        try:
            return [message async for message in replica.generate(request)]
        finally:
            await replica.engine.shutdown()

    got = asyncio.run(messages())
    texts = [message.choices[0].text for message in got]
    assert texts[0] == "" and isinstance(got[0], Started)  # the first token went at once, with nothing to show
    first_text = next(i for i, text in enumerate(texts) if text)
    assert first_text < len(got) - 1, texts  # the first text went when it came, not after the window
    assert "".join(texts) == expected and got[-1].finished
