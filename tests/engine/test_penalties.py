"""Penalties and logit_bias: what they do to the tokens, against transformers and a step-by-step reference,
inside a batch of requests that use none (and must be untouched), in both engine loops."""

from __future__ import annotations

import pytest
import torch

from inflight.engine import SamplingParams
from tests.checkpoints import ARCHITECTURES, hf_greedy, hf_logits
from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts

PROMPTS = random_prompts(4, 5, 30, seed=21)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_forbids_one():
    forced = 97
    [plain] = generate_ids(make_engine(), PROMPTS[:1], greedy(8))
    [biased] = generate_ids(make_engine(), PROMPTS[:1], greedy(8, logit_bias={forced: 100.0}))
    assert biased == [forced] * 8 != plain
    sampled = generate_ids(make_engine(), PROMPTS[:1], SamplingParams(temperature=1.0, seed=4, max_tokens=8,
                                                                       ignore_eos=True, logit_bias={forced: 100}))
    assert sampled == [[forced] * 8], "a +100 bias wins a draw at temperature 1 as well"
    banned = set(plain)
    [avoiding] = generate_ids(make_engine(), PROMPTS[:1], greedy(8, logit_bias={t: -100.0 for t in banned}))
    assert not banned & set(avoiding)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_repetition_penalty_matches_transformers(checkpoint, arch):
    path = checkpoint(arch)
    prompts = random_prompts(3, 4, 40, seed=22)
    params = [greedy(12, repetition_penalty=1.8), greedy(12), greedy(12, repetition_penalty=0.7)]
    got = generate_ids(make_engine(path), prompts, params)
    for prompt, p, tokens in zip(prompts, params, got):
        want = hf_greedy(path, prompt, 12, repetition_penalty=p.repetition_penalty)
        assert tokens == want, f"repetition_penalty {p.repetition_penalty}: engine {tokens} != transformers {want}"
    assert any(got[i] != hf_greedy(path, prompts[i], 12) for i in (0, 2)), \
        "a penalty must change an output, or the test is blind"


def reference_openai_penalties(path, prompt, max_tokens, frequency, presence, bias=None):
    """Greedy decoding one token at a time from transformers' logits, with OpenAI's penalties applied by hand."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = hf_logits(path, prompt + tokens)[-1].clone()
        if bias:
            for token_id, value in bias.items():
                logits[token_id] += value
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=logits.shape[0]).float()
        logits -= frequency * counts + presence * (counts > 0).float()
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_frequency_and_presence_penalties_in_a_mixed_batch(checkpoint, async_scheduling):
    path = checkpoint("llama")
    # a negative presence penalty rewards what was generated: it must repeat tokens the plain run does not
    settings = [(1.5, 0.0, None), (0.0, -2.0, None), (0.8, 0.5, {11: 3.0, 12: -4.0})]
    params = [greedy(14, frequency_penalty=f, presence_penalty=p, logit_bias=b) for f, p, b in settings]
    params.append(greedy(14))  # a row without adjustments, batched with the others
    engine = make_engine(path, async_scheduling=async_scheduling)
    got = generate_ids(engine, PROMPTS, params)
    for prompt, (f, p, b), tokens in zip(PROMPTS, settings, got):
        assert tokens == reference_openai_penalties(path, prompt, 14, f, p, b)
    assert got[3] == hf_greedy(path, PROMPTS[3], 14)
    assert got[1] != hf_greedy(path, PROMPTS[1], 14), "the penalty must change this output, or the test is blind"
    assert len(engine.runner.sampler.penalties) == 0, "finished requests' penalty state is dropped"


def test_penalty_state_survives_preemption(checkpoint):
    """A preempted request is recomputed; its generated-token counts must stay those of its real output."""
    path = checkpoint("llama")
    prompts = random_prompts(6, 20, 40, seed=23)
    params = [greedy(16, frequency_penalty=1.0, repetition_penalty=1.3)] * 6
    roomy = generate_ids(make_engine(path), prompts, params)
    tight = make_engine(path, num_kv_blocks=40, max_num_seqs=6, preemption_mode="recompute")
    assert generate_ids(tight, prompts, params) == roomy
    assert tight.scheduler.preemption.num_preemptions > 0


@pytest.mark.parametrize("kwargs,name", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(max_tokens=0, prompt_logprobs=0, logit_bias={5: 1.0}), "logit_bias"),
])
def test_bad_values_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused():
    engine = make_engine()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r", PROMPTS[0], greedy(4, logit_bias={100_000: 1.0}))
    assert not engine.has_unfinished_requests()
