"""Sliding-window layers and soft-capped scores (Gemma 2 and 3, Mistral): logprobs equal transformers' on prompts
several windows long, through each attention path (fresh prompt, chunk after cached context, decode, prefill lane).

Greedy tokens over the whole engine (chunked prefill, preemption, more requests than slots, async scheduling) are
compared for these families by tests/engine/test_vs_transformers.py (tests/checkpoints.ARCHITECTURES); a final
logit cap keeps the order of the logits, so only logprobs show it, here.
"""

from __future__ import annotations

import pytest
import torch

from inflight.engine import SamplingParams
from tests.checkpoints import SLIDING_WINDOW, hf_logits
from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts, run_engine
from tests.engine.test_prefill_lane import SCORE, assert_prompt_logprobs_match_hf

LONG = 4 * SLIDING_WINDOW + 5  # prompt tokens: four windows and a bit


@pytest.mark.parametrize("mode", ["lane", "mixed"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logprobs_match_transformers(checkpoint, arch, mode):
    """Scored whole in the prefill lane, or in chunks of 16 after cached context (mixed): every position's logprob."""
    path = checkpoint(arch)
    engine = make_engine(path, prefill_lane=mode == "lane", max_num_seqs=4, max_num_batched_tokens=16,
                         max_prefill_batch_tokens=64)
    prompt = [1, *random_prompts(1, LONG, LONG, seed=4)[0]]
    engine.add_request("score", prompt, SCORE)
    scored = run_engine(engine)["score"]
    assert_prompt_logprobs_match_hf(path, prompt, scored.prompt_logprobs)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_logprobs_match_transformers(checkpoint, backend):
    """Gemma 2 (windowed and capped scores, capped logits) decoding past four windows: each sampled token's
    logprob is transformers' at that position."""
    path = checkpoint("gemma2")
    engine = make_engine(path, attention_backend=backend)
    prompt = random_prompts(1, 2 * SLIDING_WINDOW, 2 * SLIDING_WINDOW, seed=5)[0]
    engine.add_request("r", prompt, greedy(2 * SLIDING_WINDOW + 3, logprobs=0))
    out = run_engine(engine)["r"].outputs[0]
    tokens = list(out.token_ids)
    want = torch.log_softmax(hf_logits(path, prompt + tokens), dim=-1)
    for i, (token, entry) in enumerate(zip(tokens, out.logprobs)):
        assert entry[token].logprob == pytest.approx(float(want[len(prompt) - 1 + i, token]), abs=1e-4), i


def test_seeded_samples_do_not_depend_on_the_batch(checkpoint):
    """A seeded request samples the same tokens alone and among others (Gemma 3: windowed and full layers)."""
    path = checkpoint("gemma3")
    prompts = random_prompts(5, SLIDING_WINDOW, 3 * SLIDING_WINDOW, seed=6)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = generate_ids(make_engine(path), prompts[:1], params)[0]
    together = generate_ids(make_engine(path, max_num_seqs=3, max_num_batched_tokens=16), prompts, params)[0]
    assert alone == together

